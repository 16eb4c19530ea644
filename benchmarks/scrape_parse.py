"""Cost of parsing one engine /metrics page, run 10x/s per replica: kvgate's filtered parse vs parsing the whole page.

Usage: .venv/bin/python benchmarks/scrape_parse.py
The page is shaped like vLLM 0.33's with two data-parallel engines (gauges, counters, ~20 histograms).
"""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from kvgate.router.upstream.scrape import parse_metrics

MODEL = 'model_name="meta-llama/Llama-3.1-8B-Instruct"'
BUCKETS = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5",
           "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0", "640.0", "2560.0", "+Inf"]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
              "request_params_n", "request_params_max_tokens", "iteration_tokens_total", "request_max_num_generation_tokens",
              "request_time_per_output_token_seconds", "kv_block_lifetime_seconds", "kv_block_idle_before_evict_seconds",
              "kv_block_reuse_gap_seconds", "request_prefill_kv_computed_tokens", "prompt_tokens_cached", "spec_decode_x"]


def vllm_page(engines: int = 2) -> str:
    lines = []
    for gauge, value in [("num_requests_running", 12), ("num_requests_waiting", 4), ("kv_cache_usage_perc", 0.4)]:
        lines += [f"# HELP vllm:{gauge} x", f"# TYPE vllm:{gauge} gauge"]
        lines += [f'vllm:{gauge}{{engine="{e}",{MODEL}}} {value}' for e in range(engines)]
    for counter in ["prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "num_preemptions",
                    "request_success"]:
        lines += [f"# HELP vllm:{counter}_total x", f"# TYPE vllm:{counter}_total counter"]
        lines += [f'vllm:{counter}_total{{engine="{e}",{MODEL}}} 918234.0' for e in range(engines)]
    lines += ["# HELP vllm:cache_config_info x", "# TYPE vllm:cache_config_info gauge"]
    lines += [f'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="27910"}} 1.0' for e in range(engines)]
    for h in HISTOGRAMS:
        lines += [f"# HELP vllm:{h} x", f"# TYPE vllm:{h} histogram"]
        for e in range(engines):
            lines += [f'vllm:{h}_bucket{{engine="{e}",le="{b}",{MODEL}}} {i * 7}.0' for i, b in enumerate(BUCKETS)]
            lines += [f'vllm:{h}_count{{engine="{e}",{MODEL}}} 841.0', f'vllm:{h}_sum{{engine="{e}",{MODEL}}} 112.6']
    return "\n".join(lines) + "\n"


def per_call_us(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    t0 = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - t0) / repeat * 1e6


def main() -> None:
    page = vllm_page()
    filtered = per_call_us(lambda: parse_metrics(page, 0.0), 300)
    full = per_call_us(lambda: [list(f.samples) for f in text_string_to_metric_families(page)], 30)
    print(f"page: {len(page.splitlines())} lines, {len(page) / 1024:.1f} KiB")
    print(f"kvgate parse_metrics (filtered): {filtered:8.1f} us CPU per page")
    print(f"full prometheus_client parse:    {full:8.1f} us CPU per page  ({full / filtered:.1f}x)")
    print(f"at 10 scrapes/s: {filtered * 10 / 1000:.2f} ms CPU per second per replica")


if __name__ == "__main__":
    main()
