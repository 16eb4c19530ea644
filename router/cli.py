"""The ``kvgate`` command line.

Each subcommand lives in the module that does the work; that module exposes ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their subcommand runs, so ``kvgate sim`` never loads the gateway.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.server", "run the gateway in front of the replicas of a policy file"),
    "demo": ("router.demo", "run kvgate on 127.0.0.1:8000 in front of an embedded 4-replica simulated fleet"),
    "sim": ("loadgen.sim.cli", "run a simulated fleet of vLLM-compatible replicas (one process)"),
    "loadgen": ("loadgen.cli", "drive an OpenAI-compatible endpoint with a workload and report latency and hits"),
    "bench": ("loadgen.bench", "compare routing policies side by side on fresh simulated fleets"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="Cache-aware request router for LLM engine fleets.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name)
        # Only the chosen subcommand's module is imported: peek at argv to avoid loading every module for --help.
        if _chosen(name):
            importlib.import_module(module_name).add_arguments(p)
    return parser


def _chosen(name: str) -> bool:
    args = [a for a in sys.argv[1:] if not a.startswith("-")]
    return bool(args) and args[0] == name


def main(argv: list[str] | None = None) -> int:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    args = build_parser().parse_args()
    module = importlib.import_module(args._module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
