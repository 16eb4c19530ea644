"""``kvgate serve``: load and validate the policy file, then run the gateway under uvicorn.

uvloop + httptools with bounds on request headers and deadlines on headers and bodies
(:mod:`kvgate.router.app.protocol`), no access log (the gateway writes its own one line per request), and uvicorn's
graceful shutdown: on SIGTERM/SIGINT it stops accepting, lets in-flight requests and streams finish for up to
``server.shutdown_grace_s``, then cancels what is left. A bad policy file stops the process with exit code 2 and a
message that names the field.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import signal
import sys

import uvicorn

from kvgate.policies.registry import POLICY_NAMES
from kvgate.router.app.asgi import create_app
from kvgate.router.app.protocol import BoundedHttpProtocol
from kvgate.router.core.errors import ConfigError
from kvgate.router.core.logs import configure_logging
from kvgate.router.settings.holder import ConfigHolder
from kvgate.router.settings.schema import KvgateConfig

log = logging.getLogger(__name__)

EXIT_BAD_CONFIG = 2
GC_YOUNG_THRESHOLD = 10_000
"""Net container allocations between young-generation collections (CPython's default is 700). Requests in flight
keep parsed JSON, token arrays and aiohttp/uvicorn objects alive, so with the default the collector runs every few
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
    server_cfg = holder.current.server
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    protocol = functools.partial(
        BoundedHttpProtocol, header_timeout_s=server_cfg.header_timeout_s, body_timeout_s=server_cfg.body_timeout_s,
        max_header_bytes=server_cfg.max_header_bytes, max_headers=server_cfg.max_headers,
    )
    config = uvicorn.Config(
        create_app(holder),
        host=args.host or server_cfg.host,
        port=server_cfg.port if args.port is None else args.port,
        loop="uvloop",
        http=protocol,  # type: ignore[arg-type]  # uvicorn takes a protocol factory in place of a name
        ws="none",  # kvgate upgrades to nothing: an Upgrade request is answered as plain HTTP
        server_header=False,  # no "server: uvicorn": nothing says what kvgate runs on
        lifespan="on",
        access_log=False,
        proxy_headers=False,  # kvgate never reads the client address: skip rewriting it from X-Forwarded-For
        log_config=None,
        timeout_graceful_shutdown=server_cfg.shutdown_grace_s,
        timeout_keep_alive=server_cfg.keep_alive_timeout_s,
    )
    server = uvicorn.Server(config)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal with the handler it found: make that handler
    # a clean exit, so callers' cleanup (`kvgate demo` stopping its simulated fleet) runs instead of the process dying.
    signal.signal(signal.SIGTERM, _exit_after_shutdown)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0 if server.started else 1


def _exit_after_shutdown(signum: int, frame: object) -> None:
    raise SystemExit(0)
