"""What kvgate reads from a real engine's /metrics: the families it scrapes exist under those names, and its
prefill cost model, calibrated from observed TTFTs, converges to the TTFTs the engine itself measures."""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import httpx
from openai import OpenAI

from kvgate.loadgen.engines import BLOCK_SIZE, MODEL_NAME, VllmReplica
from kvgate.router.upstream.scrape import FINISHED, KV_USAGE, METRICS_PATH, RUNNING, VLLM_CACHE_INFO, WAITING
from tests.engines.conftest import metric_families, start_gateway, unique_text, wait_for
from tests.support import Gateway

ENGINE_TTFT = "vllm:time_to_first_token_seconds"
"""The engine's own measurement of each request's time to first token (arrival at its API server to first token:
tokenization, scheduling and prefill), what kvgate's cost model predicts."""


def test_scraped_metric_names_exist_on_the_engine(replicas: list[VllmReplica]) -> None:
    wanted = {name for name in (*WAITING, *RUNNING, *KV_USAGE, *FINISHED, VLLM_CACHE_INFO) if name.startswith("vllm:")}
    for replica in replicas:
        full = httpx.get(replica.url + "/metrics", timeout=10.0).text
        assert wanted <= metric_families(full), wanted - metric_families(full)
        # kvgate asks for only the families it reads (name[]); vLLM 0.32 ignores that and sends its whole page.
        scraped = httpx.get(replica.url + METRICS_PATH, timeout=10.0).text
        assert wanted <= metric_families(scraped)
        info = next(line for line in scraped.splitlines() if line.startswith(VLLM_CACHE_INFO + "{"))
        assert f'block_size="{BLOCK_SIZE}"' in info
        # The process collector's start time: a restart moves it (test_restarts checks that it does).
        assert "process_start_time_seconds" in metric_families(full)


def engine_ttft_seconds_total(replica: VllmReplica) -> float:
    for line in httpx.get(replica.url + "/metrics", timeout=10.0).text.splitlines():
        if line.startswith(ENGINE_TTFT + "_sum"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{ENGINE_TTFT} missing on {replica.name}")


def coefficients(gw: Gateway) -> tuple[float, float]:
    values = {}
    for line in httpx.get(gw.url + "/metrics", timeout=10.0).text.splitlines():
        for name in ("kvgate_prefill_fixed_ms", "kvgate_prefill_per_token_ms"):
            if line.startswith(name + "{") and f'model="{MODEL_NAME}"' in line:
                values[name] = float(line.rsplit(" ", 1)[1])
    return values["kvgate_prefill_fixed_ms"], values["kvgate_prefill_per_token_ms"]


def test_calibration_converges_to_the_engines_ttft(
    replicas: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path
) -> None:
    """Cold streamed prompts of 100-6,000 tokens, one at a time, against the cost model kvgate fitted from the TTFTs
    it observed. The policy file starts the model at a fixed 1,500 ms + 0.005 ms per token, far above the tiny model on
    a CPU (tens to hundreds of ms per 2,048-token chunk, as busy as this shared machine is), and lets the fit move
    each coefficient as far as the data says (``max_change`` 1000).

    What kvgate observes lies between two measurements taken here: the engine's own TTFT (its histogram's sum before
    and after: scheduling and prefill, from the moment its API server has rendered and tokenized the prompt) and the
    client's (everything, kvgate included). The engine's tokenization and HTTP sit between the two and grow with the
    prompt, more so on a loaded machine, so the fit must land in that band, not on either line."""
    start = {"fixed_ms": 1500.0, "per_token_ms": 0.005}
    gw = start_gateway(tmp_path, "calibrating", replicas, engine_runtime[1],
                       models=[{"name": MODEL_NAME, "tokenizer": str(engine_runtime[1]), "prefill": start}],
                       calibration={"min_samples": 24, "max_change": 1000.0})
    by_name = {r.name: r for r in replicas}
    api = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    rng = random.Random(7)
    engine_samples: list[tuple[int, float]] = []  # (uncached tokens, engine-measured TTFT ms)
    client_samples: list[tuple[int, float]] = []  # (uncached tokens, client-measured TTFT ms)
    try:
        for _ in range(36):
            prompt = unique_text(rng.randint(100, 6000))
            before = {r.name: engine_ttft_seconds_total(r) for r in replicas}
            sent = time.perf_counter()
            raw = api.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                                           stream=True, stream_options={"include_usage": True})
            chunks, first_token_ms = [], None
            for chunk in raw.parse():
                if first_token_ms is None and chunk.choices:  # a completion's first chunk carries its first token
                    first_token_ms = (time.perf_counter() - sent) * 1000
                chunks.append(chunk)
            replica = by_name[raw.headers["x-kvgate-replica"]]
            usage = chunks[-1].usage
            assert usage is not None and first_token_ms is not None
            engine_ms = wait_for(lambda: (engine_ttft_seconds_total(replica) - before[replica.name]) * 1000 or None,
                                 10.0, "the engine's TTFT histogram")
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            uncached = usage.prompt_tokens - (cached or 0)
            engine_samples.append((uncached, engine_ms))
            client_samples.append((uncached, first_token_ms))
        fixed, per_token = wait_for(lambda: (c := coefficients(gw)) != (start["fixed_ms"], start["per_token_ms"])
                                    and c or None, 10.0, "a calibrated fit")
    finally:
        gw.stop()

    # Lines fitted robustly (this shared machine stretches a few TTFTs), read where prefill dominates.
    sizes = (2000, 4000, 6000)
    engine_line, client_line = theil_sen(engine_samples), theil_sen(client_samples)
    engine = [engine_line[0] + engine_line[1] * n for n in sizes]
    client = [client_line[0] + client_line[1] * n for n in sizes]

    # A cost model's fixed cost is never negative. When the client's line crosses zero above 0 tokens (a negative
    # intercept: short prompts cost less per token on this engine), the best line kvgate can fit through the
    # samples passes above it at the short end, by up to that intercept: the band's upper edge allows for it.
    headroom = max(0.0, -client_line[0])

    def outside(fixed_ms: float, per_token_ms: float) -> float:
        """How far a cost model's line falls outside the band from 0.8x the engine's line to 1.2x the client's (plus
        ``headroom``), as the largest relative distance at the three sizes (0 inside the band)."""
        return max(max(0.8 * low - ms, ms - 1.2 * high - headroom, 0.0) / low
                   for low, high, ms in zip(engine, client, (fixed_ms + per_token_ms * n for n in sizes)))

    initial, fitted = outside(start["fixed_ms"], start["per_token_ms"]), outside(fixed, per_token)
    print(f"\nat {sizes} tokens: engine TTFT {[round(ms) for ms in engine]} ms, client {[round(ms) for ms in client]}"
          f" ms; kvgate's fit {fixed:.1f} ms + {per_token:.4f} ms/token, outside the band by {initial:.0%} before,"
          f" {fitted:.0%} after")
    assert initial > 0.2, "the starting guess must be far off for this test to show the fit moving"
    assert fitted == 0.0


def theil_sen(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope of the Theil-Sen line: the median of the pairwise slopes, then the median intercept."""
    slope = statistics.median((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
                              for x2, y2 in points[i + 1:] if x2 != x1)
    return statistics.median(y - slope * x for x, y in points), slope
