"""Parsing real-shaped vLLM and SGLang /metrics pages, and ignoring everything else on them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvgate.router.upstream.client import EngineClient
from kvgate.router.upstream.scrape import METRICS_PATH, NO_COMPRESSION, parse_metrics, scrape_metrics

# Shaped after vLLM 0.33's /metrics with two data-parallel engines (trimmed histograms; same syntax as the real page).
VLLM_DP2 = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12873.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 9.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",reason="capacity"} 4.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 918234.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 700.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="meta-llama/Llama-3.1-8B-Instruct"} 41.0
vllm:request_success_total{engine="1",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 100.0
vllm:request_success_created{engine="0",finished_reason="stop",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.7e9
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",num_cpu_blocks="None",num_gpu_blocks="27910",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 841.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 841.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 112.6
"""

# Shaped after SGLang 0.5's /metrics with --enable-metrics.
SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 6.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.42
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 0.61
# HELP sglang:num_requests_total The number of processed requests.
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 1234.0
# HELP sglang:page_size The page size.
# TYPE sglang:page_size gauge
sglang:page_size{engine_type="unified",model_name="Qwen/Qwen3-8B",pp_rank="0",tp_rank="0"} 32.0
"""


def test_vllm_sums_engines_and_reads_cache_config() -> None:
    load = parse_metrics(VLLM_DP2, at=12.5)
    assert load.at == 12.5
    assert (load.waiting, load.running) == (5, 21)  # waiting_by_reason is not double counted
    assert load.kv_usage == pytest.approx(0.375)
    assert (load.block_size, load.num_gpu_blocks) == (16, 27910)
    assert load.finished == 841.0  # every engine and finish reason; the _created sample is not a count


def test_sglang_names() -> None:
    load = parse_metrics(SGLANG, at=0.0)
    assert (load.waiting, load.running, load.block_size) == (2, 6, 32)
    assert load.kv_usage == pytest.approx(0.42)
    assert load.num_gpu_blocks is None
    assert load.finished == 1234.0


def test_page_without_engine_metrics_gives_unknowns() -> None:
    load = parse_metrics("# TYPE up gauge\nup 1\n", at=1.0)
    assert (load.waiting, load.running, load.kv_usage, load.block_size, load.finished) == (None,) * 5


def test_metrics_without_help_lines_and_cache_info_with_odd_labels() -> None:
    text = 'vllm:num_requests_waiting 3\nvllm:cache_config_info{block_size="None"} 1\n'
    load = parse_metrics(text, at=1.0)
    assert load.waiting == 3 and load.block_size is None


def test_malformed_wanted_sample_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_metrics("vllm:num_requests_waiting{engine=0 banana\n", at=1.0)


def test_longer_names_sharing_a_prefix_are_not_taken_for_the_family() -> None:
    text = (
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 40\n'
        "# HELP vllm:num_requests_waiting waiting\n"
        'vllm:num_requests_waiting{engine="0"} 2\n'
        'vllm:num_requests_waiting{engine="1"} 1\n'
        'vllm:num_requests_waiting_by_reason{reason="deferred"} 30\n'
        "vllm:num_requests_running 5"  # no trailing newline
    )
    load = parse_metrics(text, at=1.0)
    assert (load.waiting, load.running) == (3, 5)


@pytest.fixture
def prometheus_engine() -> Iterator[str]:
    """prometheus_client's own exposition server (the code behind vLLM's and SGLang's /metrics) with vLLM gauges."""
    registry = CollectorRegistry()
    labels = ["engine", "model_name"]
    Gauge("vllm:num_requests_waiting", "w", labels, registry=registry).labels("0", "m").set(6)
    Gauge("vllm:num_requests_running", "r", labels, registry=registry).labels("0", "m").set(2)
    Gauge("vllm:kv_cache_usage_perc", "u", labels, registry=registry).labels("0", "m").set(0.5)
    Gauge("vllm:cache_config_info", "i", ["block_size", "num_gpu_blocks"], registry=registry).labels("16", "900").set(1)
    Counter("vllm:request_success", "s", [*labels, "finished_reason"], registry=registry).labels("0", "m", "stop").inc(3)
    ttft = Histogram("vllm:time_to_first_token_seconds", "t", labels, registry=registry)
    ttft.labels("0", "m").observe(0.2)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_scrape_against_prometheus_exposition(prometheus_engine: str) -> None:
    # The gateway decompresses nothing; prometheus_client gzips only for clients that accept it.
    async with EngineClient(4) as client:
        load = await scrape_metrics(client, prometheus_engine, 2.0, clock=lambda: 7.0)
        assert load is not None
        assert (load.at, load.waiting, load.running, load.kv_usage) == (7.0, 6, 2, 0.5)
        assert (load.block_size, load.num_gpu_blocks, load.finished) == (16, 900, 3.0)
        answer = await client.fetch("GET", prometheus_engine + METRICS_PATH, NO_COMPRESSION, timeout_s=2.0)
        body = answer.body.decode()
        assert answer.header("content-encoding") is None
        assert "vllm:num_requests_waiting" in body and "time_to_first_token" not in body  # rendered server-side


async def test_scrape_of_a_dead_engine_is_none() -> None:
    async with EngineClient(4) as client:
        assert await scrape_metrics(client, "http://127.0.0.1:9", 0.5, clock=lambda: 0.0) is None


def test_the_process_start_time_is_read_when_exported() -> None:
    page = VLLM_DP2 + (
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n"
        "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.79e+09\n"
        "# HELP process_start_time_seconds_total Not the one.\n# TYPE process_start_time_seconds_total counter\n"
        "process_start_time_seconds_total 5.0\n"
    )
    assert parse_metrics(page, at=0.0).started_at == 1.79e9
    assert parse_metrics(VLLM_DP2, at=0.0).started_at is None  # engines that do not export it
