"""The ``kvgate`` command line.

Each subcommand lives in the module that does the work; that module exposes ``add_arguments(parser)`` and
``run(args) -> int``. A module is imported only when its subcommand runs, so ``kvgate sim`` never loads the gateway
and ``kvgate serve`` never loads the simulated fleet. ``sim``, ``loadgen`` and ``bench`` come from extras
(``kvgate[sim]``, ``kvgate[bench]``); without them the command says how to install them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class CommandModule(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class MissingExtra(Exception):
    """A subcommand whose module or one of its dependencies is not installed."""


def _serve() -> CommandModule:
    from kvgate.router.app import server

    return server


def _demo() -> CommandModule:
    from kvgate.router.app import demo

    return demo


def _sim() -> CommandModule:
    from kvgate.loadgen.sim import cli

    return cli


def _loadgen() -> CommandModule:
    from kvgate.loadgen import cli

    return cli


def _bench() -> CommandModule:
    from kvgate.loadgen import bench

    return bench


@dataclass(frozen=True)
class Command:
    load: Callable[[], CommandModule]
    help: str
    extra: str | None = None
    """The extra that installs this command's module and dependencies (None: part of the gateway)."""

    def module(self, name: str) -> CommandModule:
        if self.extra is None:
            return self.load()
        try:
            return self.load()
        except ModuleNotFoundError as e:
            raise MissingExtra(
                f"kvgate {name} needs the '{self.extra}' extra, which is not installed (no module {e.name!r}): "
                f"pip install 'kvgate[{self.extra}]'") from e


COMMANDS: dict[str, Command] = {
    "serve": Command(_serve, "run the gateway in front of the replicas of a policy file"),
    "demo": Command(_demo, "run kvgate on 127.0.0.1:8000 in front of an embedded 4-replica simulated fleet",
                    extra="sim"),
    "sim": Command(_sim, "run a simulated fleet of vLLM-compatible replicas (one process)", extra="sim"),
    "loadgen": Command(_loadgen, "drive an OpenAI-compatible endpoint with a workload and report latency and hits",
                       extra="bench"),
    "bench": Command(_bench, "compare routing policies side by side on fresh simulated fleets", extra="bench"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Cache-aware request router for LLM engine fleets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help)
        # Only the chosen subcommand's module is imported, so `kvgate --help` loads none of them.
        if name == chosen:
            command.module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv).parse_args(argv)
        return int(COMMANDS[args.command].module(args.command).run(args) or 0)
    except MissingExtra as e:
        print(e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
