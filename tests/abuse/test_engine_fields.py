"""The engine sees what kvgate allows: fields that steer an engine's KV, its network or its placement are kvgate's own,
and a client's are refused (400, ``forbidden_field``) before anything is forwarded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.abuse.support import assert_openai_error, gateway_config
from tests.support import Gateway, Sim, start_kvgate, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
TENANTS = {"api_keys": {"sk-alice": "alice", "sk-bob": "bob"}, "salt_secret": "engine-fields-test-secret"}
BOB = {"authorization": "Bearer sk-bob"}
NIXL_FIRST_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("engine-fields"), 1, "--time-scale", "0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gw(sim: Sim, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    workdir = tmp_path_factory.mktemp("engine-fields-gw")
    g = start_kvgate(workdir, gateway_config(sim, workdir, "k.yaml", tenants=TENANTS))
    yield g
    g.stop()


def forwarded(sim: Sim) -> int:
    return len(httpx.get(sim.url(0) + "/sim/requests?limit=100000", timeout=5).json()["requests"])


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/v1/chat/completions", "kv_transfer_params", NIXL_FIRST_LEG),
    ("/v1/completions", "kv_transfer_params", {"do_remote_prefill": True, "remote_block_ids": [[0, 1, 2]]}),
    ("/v1/chat/completions", "bootstrap_host", "203.0.113.7"),
    ("/v1/chat/completions", "bootstrap_port", 8998),
    ("/v1/completions", "bootstrap_room", 12345),
    ("/v1/chat/completions", "session_params", {"id": "another-tenants-session"}),
    ("/v1/chat/completions", "extra_key", "another-namespace"),
    ("/v1/chat/completions", "lora_path", "/etc/passwd"),
    ("/v1/embeddings", "rid", "guessable-1"),
])
def test_a_clients_engine_steering_field_is_refused(gw: Gateway, sim: Sim, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"model": MODEL, field: value}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt" if path == "/v1/completions" else "input"] = "hello"
    before = forwarded(sim)
    response = httpx.post(gw.url + path, json=body, headers=BOB, timeout=10)
    error = assert_openai_error(response, 400, "forbidden_field")
    assert error["param"] == field
    assert forwarded(sim) == before  # the engine never saw it


def test_transfer_params_hidden_in_vllm_xargs_are_refused(gw: Gateway, sim: Sim) -> None:
    before = forwarded(sim)
    body = {"model": MODEL, "prompt": "hello", "vllm_xargs": {"kv_transfer_params": NIXL_FIRST_LEG}}
    response = httpx.post(gw.url + "/v1/completions", json=body, headers=BOB, timeout=10)
    assert assert_openai_error(response, 400, "forbidden_field")["param"] == "vllm_xargs.kv_transfer_params"
    assert forwarded(sim) == before


def test_other_fields_still_pass_through(gw: Gateway) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "vllm_xargs": {"some_custom_arg": 1},
            "future_field": {"any": "thing"}}
    assert httpx.post(gw.url + "/v1/completions", json=body, headers=BOB, timeout=10).status_code == 200
