"""The load generator driving the agentic workload through Anthropic Messages and OpenAI Responses, against a real
``kvgate sim``: every request answered, its prompt counted as the workload expects it (the bodies render as the
chat they came from), later turns reading the earlier turns' prefix from the cache, TTFT from the first text event,
and Claude Code's headers on the wire."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from kvgate.loadgen.apis import Api
from kvgate.loadgen.runner import RunConfig, run_workload
from kvgate.loadgen.workloads import build_workload
from kvgate.loadgen.workloads.request import WorkloadOptions
from tests.support import Sim, start_sim

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
OPTIONS = WorkloadOptions(sessions=3, turns=3, context_tokens=2000, system_tokens=300, think_s=0.0, idle_s=0.0,
                          subagent_prob=0.0, output_tokens=4, rate=0.0)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sim]:
    s = start_sim(tmp_path_factory.mktemp("bench-apis"), 1, "--time-scale", "0.01")
    yield s
    s.stop()


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_the_agentic_workload_through_an_agentic_api(sim: Sim, api: Api) -> None:
    requests = build_workload("agentic", OPTIONS)
    config = RunConfig(sim.url(0), MODEL, concurrency=8, timeout_s=30.0, progress=False, api=api)
    records, _ = asyncio.run(run_workload(requests, config))
    assert [r.error for r in records] == [None] * len(requests) and all(r.status == 200 for r in records)
    assert [r.prompt_tokens for r in records] == [r.prompt_tokens for r in requests]
    assert all(r.first_token_s is not None and r.output_tokens == OPTIONS.output_tokens for r in records)
    followers = [rec for rec, req in zip(records, requests) if req.after is not None]
    assert followers and all((rec.cached_tokens or 0) >= OPTIONS.system_tokens // 2 for rec in followers)
    entries = httpx.get(sim.url(0) + "/sim/requests", params={"limit": 500}, timeout=5).json()["requests"]
    mine = {e["headers"]["x-request-id"]: e for e in entries if e["endpoint"] == f"/v1/{api}"}
    assert {r.request_id for r in records} <= set(mine)
    sessions = {mine[r.request_id]["headers"]["x-claude-code-session-id"] for r in records}
    if api == "messages":  # Claude Code names its session in its own header, which vLLM does not read
        assert sessions == {r.session_id for r in requests}
        assert {mine[r.request_id]["headers"]["x-session-id"] for r in records} == {None}
    else:
        assert sessions == {None}
