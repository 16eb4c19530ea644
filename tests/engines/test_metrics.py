"""What kvgate reads from a real engine's /metrics: the families it scrapes exist under those names, and its
prefill cost model, calibrated from observed TTFTs, converges to the TTFTs the engine itself measures."""

from __future__ import annotations

import random
import statistics
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
    """Cold streamed prompts of 100-6,000 tokens, one at a time: each one's TTFT as the engine measured it (its
    histogram's sum before and after) against the cost model kvgate fitted from the TTFTs it observed. The
    policy file starts the model at a fixed 150 ms + 0.005 ms per token, far from the tiny model on a CPU (tens of
    ms per 2,048-token chunk), and lets the fit move each coefficient up to twentyfold."""
    start = {"fixed_ms": 150.0, "per_token_ms": 0.005}
    gw = start_gateway(tmp_path, "calibrating", replicas, engine_runtime[1],
                       models=[{"name": MODEL_NAME, "tokenizer": str(engine_runtime[1]), "prefill": start}],
                       calibration={"min_samples": 24, "max_change": 19.0})
    by_name = {r.name: r for r in replicas}
    api = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    rng = random.Random(7)
    samples: list[tuple[int, float]] = []  # (uncached tokens, engine-measured TTFT ms)
    try:
        for _ in range(36):
            prompt = unique_text(rng.randint(100, 6000))
            before = {r.name: engine_ttft_seconds_total(r) for r in replicas}
            raw = api.completions.with_raw_response.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                                           stream=True, stream_options={"include_usage": True})
            replica = by_name[raw.headers["x-kvgate-replica"]]
            chunks = list(raw.parse())
            usage = chunks[-1].usage
            assert usage is not None
            engine_ms = wait_for(lambda: (engine_ttft_seconds_total(replica) - before[replica.name]) * 1000 or None,
                                 10.0, "the engine's TTFT histogram")
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            samples.append((usage.prompt_tokens - (cached or 0), engine_ms))
        fixed, per_token = wait_for(lambda: (c := coefficients(gw)) != (start["fixed_ms"], start["per_token_ms"])
                                    and c or None, 10.0, "a calibrated fit")
    finally:
        gw.stop()

    engine_fixed, engine_per_token = theil_sen(samples)

    def error(fixed_ms: float, per_token_ms: float) -> float:
        """How far a cost model's line is from the line through the engine's own TTFTs (fitted robustly: this shared
        machine stretches a few of them), as the mean relative difference at 2,000, 4,000 and 6,000 tokens, where
        prefill dominates what the gateway adds to a TTFT (HTTP, its own tokenization)."""
        engine = [engine_fixed + engine_per_token * n for n in (2000, 4000, 6000)]
        return statistics.mean(abs(fixed_ms + per_token_ms * n - e) / e for n, e in zip((2000, 4000, 6000), engine))

    initial, fitted = error(start["fixed_ms"], start["per_token_ms"]), error(fixed, per_token)
    print(f"\nengine TTFT {min(ms for _, ms in samples):.0f}-{max(ms for _, ms in samples):.0f} ms, its line "
          f"{engine_fixed:.1f} ms + {engine_per_token:.4f} ms/token; kvgate's fit {fixed:.1f} ms + {per_token:.4f} "
          f"ms/token; distance {initial:.0%} before, {fitted:.0%} after")
    # How far the starting guess is depends on this machine's speed (48-140% seen), and the fit follows the TTFTs
    # the gateway observes, which add its own HTTP and tokenization to the engine's: it must land within 40% of the
    # engine's line, closer than it started.
    assert fitted < 0.4 and fitted < initial


def theil_sen(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Intercept and slope of the Theil-Sen line: the median of the pairwise slopes, then the median intercept."""
    slope = statistics.median((y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(points)
                              for x2, y2 in points[i + 1:] if x2 != x1)
    return statistics.median(y - slope * x for x, y in points), slope
