"""Routes served in the test's own event loop by kvgate's HTTP protocol on a loopback port: real HTTP for a test
that builds its endpoints by hand (the admin API, the error shapes)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from uvicorn.server import ServerState

from kvgate.router.app.protocol import HttpProtocol
from kvgate.router.app.routes import Routes


@contextlib.asynccontextmanager
async def served(routes: Routes) -> AsyncIterator[str]:
    """The base URL of ``routes`` served on 127.0.0.1, until the block ends (every connection closed then)."""
    loop = asyncio.get_running_loop()
    state = ServerState()
    server = await loop.create_server(
        lambda: HttpProtocol(None, state, {}, loop, routes=routes, header_timeout_s=10.0, body_timeout_s=10.0,
                             max_header_bytes=65536, max_headers=100, keep_alive_s=5.0),
        "127.0.0.1", 0,
    )
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        for connection in list(state.connections):
            connection.shutdown()
        await server.wait_closed()
