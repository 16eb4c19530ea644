"""One streamed chat request through the gateway, traced: it visits each pipeline stage's module once, in order, the
proxy (``router/upstream/``) calls nothing above it, and no layer calls one above it but through the API's pure
functions. Run with ``-s`` to print the walk's figures (docs/design.md). The gateway runs in this process (its server
in the test's event loop) in front of a real ``kvgate sim`` replica, so the profile hook sees the whole request."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from kvgate.loadgen.bench import free_port_block
from kvgate.router.app.gateway_app import GatewayApp
from kvgate.router.app.server import build_server, serve
from kvgate.router.settings.holder import ConfigHolder
from tests.request_walk import WalkRecorder, upward_calls, visits, walk_summary
from tests.support import Sim, start_sim, wait_until_async

pytestmark = pytest.mark.integration

STAGES = ["admit", "parse", "tokenize", "queue", "route", "forward", "relay", "account"]
"""The request path's stage modules in ``router/pipeline/``, in the order a request passes them."""
LOWER = ("router/upstream/", "router/core/")
"""What the proxy may call: its own folder and the kernel."""


@pytest.fixture
async def gateway_url(tmp_path: Path) -> AsyncIterator[str]:
    sim: Sim = start_sim(tmp_path, 1)
    server: uvicorn.Server | None = None
    serving: asyncio.Task[None] | None = None
    try:
        port = free_port_block(1)
        app = GatewayApp(ConfigHolder(str(sim.config_path)))
        server = build_server(app, "127.0.0.1", port)
        serving = asyncio.create_task(serve(app, server))
        await wait_until_async(lambda: server.started or serving.done(), what="the in-process gateway")
        assert server.started
        yield f"http://127.0.0.1:{port}"
    finally:
        if server is not None and serving is not None:
            server.should_exit = True
            await asyncio.wait_for(serving, 15)
        sim.stop()


async def streamed_chat(client: httpx.AsyncClient, text: str) -> None:
    body = {"model": "kvgate-sim", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for _ in response.aiter_bytes():
            pass


async def test_a_streamed_chat_visits_each_stage_once_in_order_and_the_proxy_calls_nothing_above_it(
    gateway_url: str,
) -> None:
    recorder = WalkRecorder()
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:
        await streamed_chat(client, "a first request warms the lazy parts (tokenizer, model state)")
        recorder.start()
        try:
            await streamed_chat(client, "the traced request")
        finally:
            recorder.stop()
    calls = recorder.request_calls("HttpProtocol._serve")

    stage_files = [f"router/pipeline/{stage}.py" for stage in STAGES]
    walked = visits([c.callee for c in calls if c.callee in stage_files])
    assert walked == stage_files

    upward = [c for c in calls if c.caller is not None and c.caller.startswith("router/upstream/")
              and c.callee.startswith("router/") and not c.callee.startswith(LOWER)
              # what the proxy is handed to call: the API's pure test of a stream's first bytes, and the forward
              # stage's record of a dispatch, once the request is written (``Forward.on_sent``)
              and c.function not in ("holds_output", "Forwarder.dispatched")]
    assert upward == [], [(c.caller, c.callee, c.function) for c in upward]

    # Nothing else calls up a layer either, but for what is handed down with the request: the API's pure functions
    # (its parser, run by the tokenizer, on a worker thread for a large body; its first-output test), the forward
    # stage's record of the dispatch, called by the engine client once the request is written, and the server's
    # writer of a streamed body, which the relay writes each chunk to.
    handed_down = {("router/prompts/tokenizer.py", "parse_chat"), ("router/upstream/first_token.py", "holds_output"),
                   ("router/upstream/client.py", "Forwarder.dispatched"),
                   ("router/pipeline/relay.py", "_ChunkWriter.write"),
                   ("router/pipeline/relay.py", "_ChunkWriter.hold_source")}
    assert {(c.caller, c.function) for c in upward_calls(calls)} <= handed_down

    stops, files, reentries, per_file = walk_summary(calls)
    print(f"\none streamed chat request: {stops} file-level stops in {files} files, {reentries} re-entries")
    for name, count in per_file.most_common():
        print(f"  {count:3d}  {name}")
    for c in upward_calls(calls):
        print(f"  up: {c.caller} -> {c.callee} {c.function}")
