"""vLLM's KV transfer between two real replicas (the CPU build with NixlConnector), as kvgate's handshake drives it.

The CPU build of vLLM runs NixlConnector with ``kv_buffer_device: cpu``: NIXL's UCX backend moves host memory, over
TCP here (``UCX_TLS=tcp``, the transport two hosts would use; left alone, UCX picks its own on one host). The pair
starts once for this module, beside the suite's two plain replicas: a prefill replica (``kv_producer``) and a decode
replica (``kv_consumer``), each with its own NIXL side-channel port. The handshake: the prompt to the prefill replica
with ``do_remote_decode``, one token; then the request to the decode replica with the returned
``kv_transfer_params``. The engines' own counters show where each prompt token's KV came from.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvgate.loadgen.engines import MODEL_NAME, VllmReplica, free_ports, policy_file, start_all, stop_all
from kvgate.router.apis.openai import CHAT
from kvgate.router.routing.transfers import first_leg_body
from tests.engines.conftest import KVGATE_READY_S, SMALL_CACHE_BLOCKS, chat, unique_text, wait_ready
from tests.support import start_kvgate

TOKEN_SOURCES = "vllm:prompt_tokens_by_source_total"
"""The engine's prompt tokens by where their KV came from: ``local_compute``, ``local_cache_hit`` or
``external_kv_transfer`` (pulled through the connector)."""
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"


def nixl_replica(name: str, role: str, log_dir: Path, python: Path, model: Path) -> VllmReplica:
    """A replica with NixlConnector in ``role`` (``kv_producer`` or ``kv_consumer``), on ports of its own."""
    port = free_ports(4)  # HTTP, KV events, their replay, NIXL's side channel
    transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
    return VllmReplica(
        name, python, model, port, port + 1, port + 2, log_dir / f"{name}.log",
        extra_args=["--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS), "--kv-transfer-config", json.dumps(transfer)],
        env={"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port + 3),
             "UCX_TLS": "tcp"},
    )


@pytest.fixture(scope="module")
def pd_pair(engine_runtime: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmReplica]]:
    """The prefill replica and the decode replica, started in parallel and stopped by PID at the end."""
    python, model = engine_runtime
    log_dir = tmp_path_factory.mktemp("pd-engines")
    pair = [nixl_replica("vllm-prefill", "kv_producer", log_dir, python, model),
            nixl_replica("vllm-decode", "kv_consumer", log_dir, python, model)]
    started = time.monotonic()
    start_all(pair)
    try:
        connect(*pair)
        print(f"\nNixlConnector pair ready and connected in {time.monotonic() - started:.0f} s")
        yield pair
    finally:
        stop_all(pair)


HANDSHAKE_ATTEMPTS = 3


def connect(prefill: VllmReplica, decode: VllmReplica) -> None:
    """The pair's first transfer, retried: it carries NIXL's handshake, which the decode replica's worker makes over
    ZMQ with a fixed 5 s receive timeout. On a loaded 2-core machine the prefill replica's listener can miss that
    once, and with vLLM's default ``kv_load_failure_policy: fail`` the request then fails with a 500. The tests check
    transfers between connected replicas."""
    for attempt in range(1, HANDSHAKE_ATTEMPTS + 1):
        body = {"model": MODEL_NAME, "messages": chat(unique_text(100)), "max_tokens": 1}
        first = httpx.post(prefill.url + "/v1/chat/completions", json=first_leg_body(CHAT, body), timeout=120.0)
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        second = httpx.post(decode.url + "/v1/chat/completions", json={**body, "kv_transfer_params": params},
                            timeout=120.0)
        if second.status_code == 200:
            return
        print(f"handshake attempt {attempt}: {second.status_code} {second.text}\n{log_excerpt(decode)}")
    raise AssertionError(f"no transfer between the pair in {HANDSHAKE_ATTEMPTS} attempts\n{log_excerpt(decode)}")


def log_excerpt(replica: VllmReplica) -> str:
    """The replica log's recent errors, warnings and NIXL lines: what a failed transfer leaves behind."""
    keep = [line for line in replica.tail(60_000).splitlines() if any(word in line.lower() for word in ("error", "warn", "nixl", "fail"))]
    return "\n".join(keep[-40:])


def samples(url: str, name: str) -> list[Sample]:
    """The samples named ``name`` on the Prometheus page at ``url``/metrics."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == name]


def engine_samples(replica: VllmReplica) -> dict[tuple[str, str], float]:
    """The replica's metric samples by (name, ``source`` label), summed over its other labels."""
    out: dict[tuple[str, str], float] = {}
    text = httpx.get(replica.url + "/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("source", ""))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def grown(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], name: str,
          source: str = "") -> float:
    return after.get((name, source), 0.0) - before.get((name, source), 0.0)


def test_the_engines_run_kvgates_handshake(pd_pair: list[VllmReplica]) -> None:
    """kvgate's first leg, sent by hand to the prefill replica, returns what the decode replica needs to pull the
    prompt's KV: the protocol itself, on this build, without kvgate's routing in the way."""
    prefill, decode = pd_pair
    body = {"model": MODEL_NAME, "messages": chat(unique_text(1000)), "max_tokens": 8}
    before = engine_samples(decode)
    first = httpx.post(prefill.url + "/v1/chat/completions", json=first_leg_body(CHAT, body), timeout=120.0)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and params["remote_engine_id"] and params["remote_block_ids"]

    second = httpx.post(decode.url + "/v1/chat/completions", json={**body, "kv_transfer_params": params}, timeout=120.0)
    assert second.status_code == 200, f"{second.text}\n{log_excerpt(decode)}"
    usage = second.json()["usage"]
    after = engine_samples(decode)
    assert grown(before, after, TOKEN_SOURCES, "external_kv_transfer") == usage["prompt_tokens"]
    assert grown(before, after, TOKEN_SOURCES, "local_compute") == 0
    # The engine's usage counts only local prefix-cache hits: pulled tokens are not "cached" there.
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_kvgate_disaggregates_a_request_onto_the_pair(
    pd_pair: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path,
) -> None:
    """Through kvgate, with the official client: the prompt is prefilled on the prefill replica, its KV crosses over
    NIXL, and the answer streams from the decode replica as one completion."""
    prefill, decode = pd_pair
    model = engine_runtime[1]
    doc = policy_file(pd_pair, model)
    for replica in doc["replicas"]:
        replica["role"] = "prefill" if replica["name"] == prefill.name else "decode"
    doc["disaggregation"] = {"mode": "always"}
    # The cost model's constants describe a GPU; on this build NixlConnector pins both replicas' model threads to
    # the same last core, so a leg may take far longer than ten times its prediction. The first-byte deadline's
    # floor is the real engines' pace here, not what this test checks.
    doc["proxy"] = {"first_byte_floor_s": 60.0}
    (tmp_path / "pd.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    gw = start_kvgate(tmp_path, tmp_path / "pd.yaml", timeout=KVGATE_READY_S)
    try:
        wait_ready(gw)
        before_p, before_d = engine_samples(prefill), engine_samples(decode)
        api = OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
        raw = api.chat.completions.with_raw_response.create(
            model=MODEL_NAME, messages=chat(unique_text(1500)), max_tokens=16, stream=True,
            stream_options={"include_usage": True})
        chunks = list(raw.parse())
        after_p, after_d = engine_samples(prefill), engine_samples(decode)
        handoffs = {(s.labels["kind"], s.labels["result"]): s.value for s in samples(gw.url, "kvgate_transfers_total")}
    finally:
        gw.stop()

    assert raw.headers["x-kvgate-replica"] == decode.name
    assert raw.headers["x-kvgate-decision"] == "disaggregated"
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 16
    # The prefill replica computed the whole prompt (it never saw it before); the decode replica computed none of it:
    # every token's KV came over NIXL, and no transfer failed.
    assert grown(before_p, after_p, TOKEN_SOURCES, "local_compute") == usage.prompt_tokens
    assert grown(before_d, after_d, TOKEN_SOURCES, "external_kv_transfer") == usage.prompt_tokens
    assert grown(before_d, after_d, TOKEN_SOURCES, "local_compute") == 0
    assert grown(before_d, after_d, NIXL_FAILED) == 0
    assert handoffs[("disaggregated", "completed")] == 1
