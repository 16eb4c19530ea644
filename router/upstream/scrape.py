"""The engine's own load numbers, scraped from its Prometheus ``/metrics``.

vLLM and SGLang both expose their queue depth and KV usage as Prometheus gauges; routers that scrape them (llm-d's
EPP every 50 ms, production-stack every 30 s) see the engine's real queue, including requests that bypassed the
router. kvgate scrapes every ``scrape.interval_ms`` (100 ms by default), so parsing must stay cheap: a vLLM
``/metrics`` page is mostly histogram buckets, so only the sample lines of the handful of wanted families are cut
out of it (``str.find``) before ``prometheus_client``'s parser sees them.

Data-parallel engines report one sample per ``engine`` (vLLM) or rank (SGLang); queue counts are summed over them
and usage fractions averaged.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlencode

from prometheus_client.parser import text_string_to_metric_families

from kvgate.router.upstream.client import EngineClient, UpstreamError

log = logging.getLogger(__name__)

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "sglang:token_usage")
FINISHED = ("vllm:request_success_total", "sglang:num_requests_total")
"""Requests the engine finished, all callers: differenced between scrapes, the engine's own request rate."""
VLLM_CACHE_INFO = "vllm:cache_config_info"
SGLANG_PAGE_SIZE = "sglang:page_size"
PROCESS_START = "process_start_time_seconds"
"""prometheus_client's standard process collector: when the engine's server process started (seconds since the epoch).
It moves when the engine restarts, a restart signal one scrape away; engines that do not export it just lack it."""

WANTED_FAMILIES = frozenset(
    (*WAITING, *RUNNING, *KV_USAGE, *FINISHED, VLLM_CACHE_INFO, SGLANG_PAGE_SIZE, PROCESS_START)
)
METRICS_PATH = "/metrics?" + urlencode([("name[]", n) for n in sorted(WANTED_FAMILIES)])
"""prometheus_client's exposition (vLLM's and SGLang's /metrics) renders only the ``name[]`` families asked for, so the
engine does not build ~100 KiB of histograms ten times a second; engines that ignore it send everything, which the
parser below filters anyway."""
NO_COMPRESSION = {"accept-encoding": "identity"}
"""prometheus_client gzips only when the client accepts it; say plainly that the gateway does not (it decompresses
nothing): plain text is cheaper than gzip on both ends for a few hundred bytes."""
MAX_METRICS_BYTES = 4 * 1024 * 1024
"""The largest /metrics page read: an engine that ignores ``name[]`` sends ~100 KiB."""
PARSED_LINES_CACHED = 1024
"""Distinct sample lines whose parse is remembered: a few per engine and value seen."""
FAMILIES_BY_PREFIX: dict[str, tuple[str, ...]] = {
    prefix: tuple(sorted(n for n in WANTED_FAMILIES if n.startswith(prefix)))
    for prefix in ("vllm:", "sglang:", "process_")
}


@dataclass(frozen=True, slots=True)
class ScrapedLoad:
    """One scrape of one engine; ``at`` is the router's monotonic clock when the response arrived."""

    at: float
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None
    """Fraction 0..1 of KV cache in use."""
    block_size: int | None = None
    """Engine KV block (SGLang: page) size, when the engine reports it."""
    num_gpu_blocks: int | None = None
    finished: float | None = None
    """Requests the engine has finished since it started (a counter: it restarts from 0 with the engine)."""
    started_at: float | None = None
    """When the engine's server process started (``process_start_time_seconds``, the engine host's epoch clock)."""


def _wanted_lines(text: str) -> list[str]:
    """Only the sample lines of the wanted families, cut out with ``str.find``.

    A vLLM page is ~100 KiB of other families, and looking at each of its lines in Python costs more than the parse
    itself. The exposition format keeps a family's samples contiguous, so each family is one ``find`` for its first
    sample plus a walk over the lines that follow; an engine's whole prefix is skipped when absent.
    """
    kept: list[str] = []
    for prefix, names in FAMILIES_BY_PREFIX.items():
        if prefix not in text:
            continue
        for name in names:
            i = _first_sample(text, name)
            while i >= 0:
                end = text.find("\n", i)
                if end < 0:
                    end = len(text)
                kept.append(text[i:end])
                i = end + 1 if _is_sample_at(text, end + 1, name) else -1
    return kept


def _first_sample(text: str, name: str) -> int:
    i = text.find(name)
    while i >= 0 and not _is_sample_at(text, i, name):
        i = text.find(name, i + len(name))
    return i


def _is_sample_at(text: str, i: int, name: str) -> bool:
    """A sample line of ``name`` starts at ``i`` (line start, exact name, then labels or the value)."""
    return (
        text.startswith(name, i)
        and (i == 0 or text[i - 1] == "\n")
        and text[i + len(name) : i + len(name) + 1] in ("{", " ")
    )


def parse_metrics(text: str, at: float) -> ScrapedLoad:
    """Parse an engine's ``/metrics`` text (vLLM or SGLang names). Raises ``ValueError`` on malformed text."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    started_at: float | None = None
    for line in _wanted_lines(text):
        for name, labels, value in _parse_sample_line(line):
            if name == VLLM_CACHE_INFO:
                block_size = _int_label(labels, "block_size", block_size)
                num_gpu_blocks = _int_label(labels, "num_gpu_blocks", num_gpu_blocks)
            elif name == SGLANG_PAGE_SIZE:
                block_size = int(value)
            elif name == PROCESS_START:
                started_at = value
            elif name in WANTED_FAMILIES:
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
    waiting = _first(sums, WAITING)
    running = _first(sums, RUNNING)
    usage_name = next((n for n in KV_USAGE if n in sums), None)
    return ScrapedLoad(
        at=at,
        waiting=None if waiting is None else int(waiting),
        running=None if running is None else int(running),
        kv_usage=None if usage_name is None else sums[usage_name] / counts[usage_name],
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        finished=_first(sums, FINISHED),
        started_at=started_at,
    )


@functools.lru_cache(maxsize=PARSED_LINES_CACHED)
def _parse_sample_line(line: str) -> tuple[tuple[str, dict[str, str], float], ...]:
    """``(name, labels, value)`` of one sample line, by ``prometheus_client``'s parser, remembered: scraped ten times a
    second, an engine's lines mostly repeat (an idle engine's always do, ``cache_config_info`` never changes), and the
    parser walks each line character by character. The labels are shared between calls: read them, never change
    them. Raises ``ValueError`` on a malformed line (not remembered)."""
    return tuple(
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(line + "\n")
        for sample in family.samples
    )


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((sums[n] for n in names if n in sums), None)


def _int_label(labels: dict[str, str], key: str, default: int | None) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return default


async def scrape_metrics(
    client: EngineClient, base_url: str, timeout_s: float, clock: Callable[[], float]
) -> ScrapedLoad | None:
    """GET the engine's ``/metrics`` (wanted families only) and parse it; ``None`` when the engine does not answer or
    answers garbage."""
    try:
        answer = await client.fetch("GET", base_url + METRICS_PATH, NO_COMPRESSION, timeout_s=timeout_s,
                                    max_bytes=MAX_METRICS_BYTES)
        if answer.status != 200:
            return None
        text = answer.body.decode("utf-8")
    except (UpstreamError, OSError, TimeoutError, UnicodeDecodeError, ValueError) as e:
        log.debug("scrape %s failed: %r", base_url, e)
        return None
    try:
        return parse_metrics(text, clock())
    except ValueError as e:
        log.debug("scrape %s: unparseable /metrics: %s", base_url, e)
        return None
