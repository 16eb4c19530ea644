"""``kvgate serve``: load and validate the policy file, then run the gateway: kvgate's HTTP protocol
(:mod:`kvgate.router.app.protocol`) on uvloop, under uvicorn's server, which binds the socket, handles the signals and
shuts down gracefully: on SIGTERM/SIGINT it stops accepting, lets in-flight requests and streams finish for up to
``server.shutdown_grace_s``, then cancels what is left. The gateway starts before the socket is bound and stops after
the server. A bad policy file stops the process with exit code 2 and a message that names the field.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import signal
import sys

import uvicorn
import uvloop

from kvgate.policies.registry import POLICY_NAMES
from kvgate.router.app.gateway_app import GatewayApp
from kvgate.router.app.protocol import HttpProtocol
from kvgate.router.core.errors import ConfigError
from kvgate.router.core.logs import configure_logging
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import KvgateConfig

log = logging.getLogger(__name__)

EXIT_BAD_CONFIG = 2
GC_YOUNG_THRESHOLD = 10_000
"""Net container allocations between young-generation collections (CPython's default is 700). Requests in flight
keep parsed JSON, token arrays and connection objects alive, so with the default the collector runs every few
requests and walks them all, and its older generations follow; with 10,000 it runs dozens of times less often.
Reference counting frees nearly everything anyway; the collector only has to find cycles, and a few thousand more
objects waiting for it cost nothing. Its effect shows in the CPU per request of ``benchmarks/bench_overhead.py``
(docs/benchmarks.md, "Router overhead")."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="policy file (YAML); reloaded on change and on SIGHUP")
    parser.add_argument("--host", default=None, help="listen address (default: server.host of the policy file)")
    parser.add_argument("--port", type=int, default=None, help="listen port (default: server.port of the policy file)")
    parser.add_argument(
        "--policy", default=None, choices=POLICY_NAMES, help="routing policy, overriding policy.name of the file"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


class PolicyOverride:
    """``--policy``: applied to every config the holder loads, so it survives reloads."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, config: KvgateConfig) -> KvgateConfig:
        return config.model_copy(update={"policy": config.policy.model_copy(update={"name": self.name})})


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    try:
        holder = ConfigHolder(args.config, transform=PolicyOverride(args.policy) if args.policy else None)
    except ConfigError as e:
        print(f"kvgate serve: bad policy file: {e}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    app = GatewayApp(holder)
    server_cfg = holder.current.server
    server = build_server(app, args.host or server_cfg.host, server_cfg.port if args.port is None else args.port)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal with the handler it found: make that handler
    # a clean exit, so callers' cleanup (`kvgate demo` stopping its simulated fleet) runs instead of the process dying.
    signal.signal(signal.SIGTERM, _exit_after_shutdown)
    try:
        uvloop.run(serve(app, server))
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0 if server.started else 1


def build_server(app: GatewayApp, host: str, port: int) -> uvicorn.Server:
    """uvicorn's server, running kvgate's protocol over ``app``'s routes with the policy file's bounds."""
    server_cfg = app.gateway.holder.current.server
    protocol = functools.partial(
        HttpProtocol, routes=app.routes, header_timeout_s=server_cfg.header_timeout_s,
        body_timeout_s=server_cfg.body_timeout_s, max_header_bytes=server_cfg.max_header_bytes,
        max_headers=server_cfg.max_headers, keep_alive_s=server_cfg.keep_alive_timeout_s,
    )
    config = uvicorn.Config(
        _no_asgi_app,
        host=host,
        port=port,
        http=protocol,  # type: ignore[arg-type]  # uvicorn takes a protocol factory in place of a name
        ws="none",  # kvgate upgrades to nothing: an Upgrade request is answered as plain HTTP
        lifespan="off",  # the gateway is started and stopped around the server (:func:`serve`)
        server_header=False,  # no "server: uvicorn": nothing says what kvgate runs on
        access_log=False,  # the gateway writes its own one line per request
        log_config=None,
        timeout_graceful_shutdown=server_cfg.shutdown_grace_s,
    )
    return uvicorn.Server(config)


async def serve(app: GatewayApp, server: uvicorn.Server) -> None:
    """Start the gateway, serve until shut down, stop the gateway."""
    await app.start()
    # What starting loaded (tokenizers, templates, the policy file, the libraries' own objects) lives as long as the
    # process: out of the collector's sight, its oldest-generation passes walk only what serving allocates.
    gc.freeze()
    try:
        await server.serve()
    finally:
        await app.stop()


async def _no_asgi_app(scope: object, receive: object, send: object) -> None:
    """uvicorn's config wants an ASGI app; kvgate's protocol serves the routes itself and never calls it."""
    raise RuntimeError("kvgate serves its routes through its own protocol")


def _exit_after_shutdown(signum: int, frame: object) -> None:
    raise SystemExit(0)
