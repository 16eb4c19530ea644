"""The runner against a fake OpenAI-compatible engine on loopback: what it records from a real HTTP stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvgate.loadgen.runner import RunConfig, run_workload
from kvgate.loadgen.workloads import build_workload
from kvgate.loadgen.workloads.request import WorkloadOptions

pytestmark = pytest.mark.integration
SENT = web.AppKey("sent", list)


async def _fake_completion(request: web.Request) -> web.StreamResponse:
    """Streams max_tokens text chunks 5 ms apart, then a usage chunk claiming half the prompt was cached; answers
    400 to a prompt-less body, like an engine would."""
    body = await request.json()
    if "prompt" not in body and "messages" not in body:
        return web.json_response({"error": {"message": "missing prompt", "type": "BadRequestError"}}, status=400)
    sent = request.app[SENT]
    sent.append((body, request.headers.copy()))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kvgate-replica": f"r{len(sent) % 2}",
                                       "x-kvgate-decision": "fake"})
    await resp.prepare(request)
    await asyncio.sleep(0.02)
    chat = "messages" in body
    for _ in range(body["max_tokens"]):
        choice = {"index": 0, "delta": {"content": " x"}} if chat else {"index": 0, "text": " x"}
        await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        await asyncio.sleep(0.005)
    usage = {"prompt_tokens": 100, "completion_tokens": body["max_tokens"], "prompt_tokens_details": {"cached_tokens": 50}}
    await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def fake_engine() -> AsyncIterator[tuple[str, web.Application]]:
    app = web.Application()
    app[SENT] = []
    app.router.add_post("/v1/completions", _fake_completion)
    app.router.add_post("/v1/chat/completions", _fake_completion)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


async def test_records_stream_timing_usage_and_headers(fake_engine: tuple[str, web.Application]) -> None:
    url, app = fake_engine
    requests = build_workload("unique", WorkloadOptions(requests=6, prompt_tokens=32, output_tokens=4, rate=0))
    records, wall = await asyncio.wait_for(run_workload(requests, RunConfig(url, "m", progress=False)), 20)
    assert [r.index for r in records] == list(range(6))
    for r in records:
        assert r.ok, r.error
        assert r.ttft_s is not None and 0.015 < r.ttft_s < r.e2e_s
        assert len(r.itl_s) == 3
        assert (r.prompt_tokens, r.cached_tokens, r.output_tokens) == (100, 50, 4)
        assert r.replica in {"r0", "r1"} and r.decision == "fake"
    body, _ = app[SENT][0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["model"] == "m"
    assert sorted(h["X-Request-Id"] for _, h in app[SENT]) == sorted(f"loadgen-{i}" for i in range(6))


async def test_sessions_wait_for_their_previous_turn(fake_engine: tuple[str, web.Application]) -> None:
    url, app = fake_engine
    options = WorkloadOptions(sessions=2, turns=3, turn_tokens=8, output_tokens=2, think_s=0.01, rate=0)
    requests = build_workload("multi-turn", options)
    records, _ = await asyncio.wait_for(run_workload(requests, RunConfig(url, "m", progress=False)), 20)
    by_index = {r.index: r for r in records}
    for req in requests:
        if req.after is not None:
            assert by_index[req.index].start_s >= by_index[req.after].end_s
    assert {h.get("X-Session-ID") for _, h in app[SENT]} == {"mt-0-0", "mt-0-1"}


async def test_errors_are_recorded_not_raised(fake_engine: tuple[str, web.Application]) -> None:
    url, _ = fake_engine
    requests = build_workload("unique", WorkloadOptions(requests=2, prompt_tokens=8, output_tokens=1, rate=0))
    broken = [dataclasses.replace(r, body={}) for r in requests]
    records, _ = await asyncio.wait_for(run_workload(broken, RunConfig(url, "m", progress=False)), 20)
    assert [r.status for r in records] == [400, 400] and all("missing prompt" in (r.error or "") for r in records)
    dead, _ = await asyncio.wait_for(run_workload(requests, RunConfig("http://127.0.0.1:9", "m", progress=False)), 20)
    assert all(r.status == 0 and r.error for r in dead)


async def test_duration_bound_stops_new_arrivals(fake_engine: tuple[str, web.Application]) -> None:
    url, _ = fake_engine
    requests = build_workload("unique", WorkloadOptions(requests=40, prompt_tokens=8, output_tokens=1, rate=50, seed=2))
    late = sum(r.arrival_s > 0.2 for r in requests)
    assert late > 0
    records, _ = await asyncio.wait_for(run_workload(requests, RunConfig(url, "m", duration_s=0.2, progress=False)), 20)
    assert len(records) == len(requests) - late


async def test_spread_sends_each_request_to_one_of_the_targets(fake_engine: tuple[str, web.Application]) -> None:
    url, app = fake_engine
    other = web.Application()
    other[SENT] = []
    other.router.add_post("/v1/completions", _fake_completion)
    runner = web.AppRunner(other)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    other_url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        requests = build_workload("unique", WorkloadOptions(requests=40, prompt_tokens=32, output_tokens=1, rate=0))
        config = RunConfig(url, "m", progress=False, spread=(other_url,))
        records, _ = await asyncio.wait_for(run_workload(requests, config), 20)
    finally:
        await runner.cleanup()
    assert all(r.ok for r in records)
    assert len(app[SENT]) + len(other[SENT]) == 40
    assert len(app[SENT]) >= 5 and len(other[SENT]) >= 5
