"""``kvgate bench``: every routing policy on its own fresh simulated fleet, the same seeded workload, one report.

For each policy: start ``kvgate sim`` (same arguments every time, free ports, ``--write-config``) and ``kvgate serve
--config ... --policy P`` in front of it, wait until both are ready, run the workload, stop both. ``--peer sglang``
adds the SGLang Model Gateway (cache_aware) in front of an identical fleet when ``sglang_router`` is installed. Every
child runs in its own process group and is stopped by PID when its run ends — also on errors and Ctrl-C.

``--repeat N`` does that N times with the same seed and workload (what varies is this machine, not the requests),
in an order rotated by one each repeat, so that every policy runs early and late and a drift in the machine's load
does not favour whichever policy runs at a given time. The report then shows medians with their ranges and the
candidate's wins per repeat (``loadgen.report``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from loadgen.cli import add_workload_arguments, drive, load_workload, run_config
from loadgen.plots import write_plots
from loadgen.report import (
    CANDIDATE, Repeat, RepeatedComparison, compare, print_table, schedule_warning, summarize, write_repeated_results,
    write_results,
)
from loadgen.runner import RequestRecord
from loadgen.runstats import group_cpu_seconds, scrape_gateway_counters
from loadgen.workloads import Request
from policies.config import ConfigError, load_config

POLICIES = ("cost", "prefix_affinity", "least_loaded", "round_robin")
PEERS = ("sglang",)
KVGATE = [sys.executable, "-m", "router.cli"]


def free_port_block(n: int) -> int:
    """First port p of a random start such that p..p+n-1 are free on 127.0.0.1."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - n)
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports on 127.0.0.1")


@dataclass
class Child:
    """A subprocess in its own session (process group), logging to a file, stopped by PID."""

    name: str
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    url: str = ""
    """Where it serves, once ready (gateways)."""

    def start(self) -> "Child":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, url: str, timeout_s: float) -> None:
        """Poll ``url`` until it answers 200; fail early if the child exits."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited early; last output:\n{self._tail()}")
            try:
                if httpx.get(url, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name}: {url} not ready after {timeout_s:.0f}s; last output:\n{self._tail()}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is left of it (the leader included) after ``grace_s``."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)
        self.proc.wait(grace_s)

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def _tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@dataclass(frozen=True)
class Fleet:
    config_path: Path
    replica_urls: list[str]
    replica_names: list[str]
    pid: int
    """The sim's process-group leader (for its CPU seconds)."""


@contextmanager
def running(child: Child) -> Iterator[Child]:
    child.start()
    try:
        yield child
    finally:
        child.stop()


@contextmanager
def sim_fleet(args: argparse.Namespace, out_dir: Path, label: str, settings: list[str]) -> Iterator[Fleet]:
    http_port = free_port_block(args.replicas)
    zmq_port = free_port_block(2 * args.replicas)
    config = out_dir / "logs" / f"{label}-fleet.yaml"
    cmd = [*KVGATE, "sim", "--replicas", str(args.replicas), "--port", str(http_port), "--zmq-port", str(zmq_port),
           "--time-scale", str(args.time_scale), "--seed", str(args.seed), "--model", args.model,
           "--tokenizer", str(args.tokenizer), "--write-config", str(config)]
    if args.kv_blocks is not None:
        cmd += ["--kv-blocks", str(args.kv_blocks)]
    cmd += shlex.split(args.sim_args)
    with running(Child(f"{label} sim", cmd, out_dir / "logs" / f"{label}-sim.log")) as sim:
        urls = [f"http://127.0.0.1:{http_port + i}" for i in range(args.replicas)]
        for url in urls:
            sim.wait_ready(url + "/health", args.ready_timeout)
        deadline = time.monotonic() + args.ready_timeout
        while not config.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        apply_settings(config, settings)
        names = [r.name for r in load_config(config).replicas]
        assert sim.proc is not None
        yield Fleet(config, urls, names, sim.proc.pid)


def run_settings(settings: list[str], policy: str) -> list[str]:
    """The policy-file overrides of one run: ``--set`` ones, plus ``replication.enabled=false`` behind a baseline
    policy. Baselines stand for the peers they imitate, none of which warms extra replicas; kvgate's hot-prefix
    replication belongs to the ``cost`` side of the comparison (an explicit ``--set replication.…`` wins)."""
    if policy == CANDIDATE or any(s.startswith("replication.") for s in settings):
        return settings
    return ["replication.enabled=false", *settings]


def apply_settings(config: Path, settings: list[str]) -> None:
    """Edit the fleet's policy file with ``--set section.field=value`` overrides (values parsed as YAML), so a run
    can vary the policy file (e.g. ``replication.enabled=false``) without a hand-written one."""
    if not settings:
        return
    doc = yaml.safe_load(config.read_text()) or {}
    for setting in settings:
        path, sep, raw = setting.partition("=")
        if not sep or not path:
            raise ConfigError(f"--set {setting!r}: expected section.field=value")
        *parents, leaf = path.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {setting!r}: {key} is not a section")
        node[leaf] = yaml.safe_load(raw)
    config.write_text(yaml.safe_dump(doc, sort_keys=False))
    load_config(config)  # a bad override fails here, naming the field, before any gateway starts


@contextmanager
def gateway(args: argparse.Namespace, out_dir: Path, fleet: Fleet, policy: str, label: str) -> Iterator[Child]:
    """kvgate serve with ``policy`` in front of ``fleet``; yields it (``url`` set) once /ready says 200. ``label``
    names its log file."""
    port = free_port_block(1)
    cmd = [*KVGATE, "serve", "--config", str(fleet.config_path), "--host", "127.0.0.1", "--port", str(port),
           "--policy", policy, *shlex.split(args.serve_args)]
    url = f"http://127.0.0.1:{port}"
    with running(Child(f"kvgate serve ({policy})", cmd, out_dir / "logs" / f"{label}-kvgate.log")) as gw:
        gw.wait_ready(url + "/ready", args.ready_timeout)
        gw.url = url
        yield gw


@contextmanager
def sglang_gateway(args: argparse.Namespace, out_dir: Path, fleet: Fleet, label: str) -> Iterator[Child]:
    """The SGLang Model Gateway with its cache_aware policy (default parameters) in front of ``fleet``."""
    port = free_port_block(1)
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *fleet.replica_urls,
           "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), *shlex.split(args.peer_args)]
    url = f"http://127.0.0.1:{port}"
    with running(Child("sglang router", cmd, out_dir / "logs" / f"{label}-router.log")) as gw:
        gw.wait_ready(url + "/health", args.ready_timeout)
        gw.url = url
        yield gw


def attach_engine_view(records: list[RequestRecord], fleet: Fleet) -> None:
    """Fill in what the sim replicas saw (their /sim/requests, matched by X-Request-Id): each request's TTFT on the
    model clock, and the replica that served it when the router did not say (a peer router sends no
    x-kvgate-replica header). Wall-clock latencies on a shared machine include CPU starvation of the sim and the
    router; the model clock counts only the queueing and prefill the routing decision caused."""
    by_id = {r.request_id: r for r in records}
    for url, name in zip(fleet.replica_urls, fleet.replica_names):
        try:
            resp = httpx.get(url + "/sim/requests", params={"limit": 100_000}, timeout=10.0)
            entries = resp.json().get("requests", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            continue
        for entry in entries:
            record = by_id.get((entry.get("headers") or {}).get("x-request-id"))
            if record is None:
                continue
            record.replica = record.replica or name
            if isinstance(entry.get("ttft_ms"), (int, float)):
                record.engine_ttft_ms = float(entry["ttft_ms"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    b = parser.add_argument_group("bench")
    b.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated (default {','.join(POLICIES)})")
    b.add_argument("--replicas", type=int, default=8, help="simulated replicas per fleet (default 8)")
    b.add_argument("--kv-blocks", type=int, help="KV blocks per simulated replica (sim default if unset)")
    b.add_argument("--time-scale", type=float, default=1.0,
                   help="sim time scale (default 1: real time); trace replay runs at 1/time-scale unless --speed is "
                        "given. Below 1 the sim, router and client need proportionally more CPU")
    b.add_argument("--peer", action="append", choices=PEERS, default=[], help="also run a peer router (sglang)")
    b.add_argument("--peer-args", default="", help="extra arguments for the peer router")
    b.add_argument("--sim-args", default="", help="extra arguments for kvgate sim, e.g. '--cpu-blocks 4096'")
    b.add_argument("--serve-args", default="", help="extra arguments for kvgate serve")
    b.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a policy-file field for every kvgate run, e.g. replication.enabled=false "
                        "(repeatable; value parsed as YAML)")
    b.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for sim and gateway readiness")
    b.add_argument("--repeat", type=_positive_int, default=1, metavar="N",
                   help="run every policy N times (fresh fleets, same workload, order rotated each repeat) and report "
                        "medians with min-max and wins per repeat (default 1)")
    add_workload_arguments(parser)
    parser.set_defaults(speed=None)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def rotated(runs: list[str], k: int) -> list[str]:
    """The run order of repeat ``k`` (0-based): ``runs`` rotated left by k, so over len(runs) repeats every run
    takes every position once."""
    if not runs:
        return []
    shift = k % len(runs)
    return runs[shift:] + runs[:shift]


def _runs(args: argparse.Namespace) -> list[str]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    return policies + list(dict.fromkeys(args.peer))


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.speed is None:
        args.speed = 1.0 / args.time_scale if args.time_scale > 0 else 1.0
    runs = _runs(args)
    if not runs:
        console.print("[red]no policies to run")
        return 2
    if "sglang" in runs and importlib.util.find_spec("sglang_router") is None:
        console.print("[yellow]--peer sglang skipped: sglang_router is not installed (pip install sglang-router)")
        runs.remove("sglang")
    requests = load_workload(args, console)
    if requests is None:
        return 2
    out_dir: Path = args.out or Path("bench-out") / f"{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"{args.workload}: {len(requests)} requests, {sum(r.prompt_tokens for r in requests):,} prompt tokens;"
                  f" {args.replicas} replicas; runs: {', '.join(runs)}"
                  + (f"; {args.repeat} repeats, order rotated each repeat" if args.repeat > 1 else "")
                  + f"; output in {out_dir}")
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    repeats: list[Repeat] = []
    fleets: dict[str, list[str]] = {}
    try:
        for k in range(args.repeat):
            repeat, fleets_seen = _run_repeat(args, out_dir, runs, k, requests, console)
            repeats.append(repeat)
            if k == 0:
                fleets = fleets_seen  # same sim arguments every repeat: the same replica names
    except (RuntimeError, ConfigError) as e:
        console.print(f"[red]bench stopped: {e}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process started was stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    title = f"kvgate bench: {args.workload}, {args.replicas} replicas, time scale {args.time_scale}"
    meta = {
        "workload": args.workload, "seed": args.seed, "requests": len(requests), "replicas": args.replicas,
        "kv_blocks": args.kv_blocks, "time_scale": args.time_scale, "speed": args.speed, "policies": runs,
        **({"targets": repeats[0].targets} if len(repeats) == 1 else {"repeats": len(repeats)}),
        "settings": {name: run_settings(args.set, name) for name in runs if name not in PEERS},
        "argv": " ".join(sys.argv[1:]),
        "note": "simulated fleet (kvgate sim) with its stated cost constants; latencies are wall-clock (scaled) except"
                " engine TTFT, which is the sim's model clock (unscaled ms, free of this machine's CPU noise)",
    }
    if len(repeats) == 1:
        only = repeats[0]
        summaries, ratios = only.summaries, compare(only.summaries)
        print_table(title, summaries, ratios, console)
        write_results(out_dir, meta, only.records, summaries, ratios, title)
    else:
        title += f", {len(repeats)} repeats"
        comparison = RepeatedComparison.of(repeats)
        summaries = comparison.summaries
        print_table(title, summaries, comparison.ratios, console, comparison.ranges, comparison.wins)
        write_repeated_results(out_dir, meta, comparison, title)
    for k, repeat in enumerate(repeats, start=1):
        for name, summary in repeat.summaries.items():
            warning = schedule_warning(summary)
            if warning:
                where = f"{name}, repeat {k}/{len(repeats)}" if len(repeats) > 1 else name
                console.print(f"[yellow]warning ({where}): {warning}")
    plots = write_plots(out_dir, repeats[0].records, summaries, fleets, len(repeats))
    console.print(f"wrote {out_dir}/results.json, report.md" + (f", {len(plots)} plots" if plots else " (no matplotlib: no plots)"))
    return 0


def _run_repeat(
    args: argparse.Namespace, out_dir: Path, runs: list[str], k: int, requests: list[Request], console: Console
) -> tuple[Repeat, dict[str, list[str]]]:
    """Repeat ``k`` (0-based): every run once, in ``runs`` rotated by k, each on a fresh fleet. The repeat's dicts
    keep the order of ``runs`` (the report's columns); also returns each run's fleet replica names."""
    order = rotated(runs, k)
    tag = f"repeat {k + 1}/{args.repeat}: " if args.repeat > 1 else ""
    records: dict[str, list[RequestRecord]] = {}
    fleets: dict[str, list[str]] = {}
    targets: dict[str, str] = {}
    summaries: dict[str, dict[str, Any]] = {}
    for name in order:
        label = name if args.repeat == 1 else f"{name}-r{k + 1}"
        console.print(f"{tag}[bold]{name}[/]: starting a fresh fleet")
        records[name], fleets[name], targets[name], cost = _run_one(args, out_dir, name, label, requests)
        summaries[name] = {**summarize(records[name], fleets[name]), **cost.fields()}
        done = summaries[name]
        console.print(f"{tag}[bold]{name}[/]: {done['ok']}/{done['requests']} ok, TTFT mean {done['ttft_mean_ms']:.0f} ms")
    repeat = Repeat(order=order, targets={n: targets[n] for n in runs}, records={n: records[n] for n in runs},
                    summaries={n: summaries[n] for n in runs})
    return repeat, {n: fleets[n] for n in runs}


def _run_one(
    args: argparse.Namespace, out_dir: Path, name: str, label: str, requests: list[Request]
) -> tuple[list[RequestRecord], list[str], str, RunCost]:
    """One run on its own fleet (``label`` names its log files): the records, the fleet's replica names, the URL the
    workload was sent to, and what the run cost (CPU) and did (gateway counters)."""
    with sim_fleet(args, out_dir, label, run_settings(args.set, name)) as fleet:
        front = (sglang_gateway(args, out_dir, fleet, label) if name == "sglang"
                 else gateway(args, out_dir, fleet, name, label))
        with front as gw:
            assert gw.proc is not None
            cpu_before = (group_cpu_seconds(gw.proc.pid), group_cpu_seconds(fleet.pid))
            records = drive(requests, run_config(args, gw.url))
            cpu_after = (group_cpu_seconds(gw.proc.pid), group_cpu_seconds(fleet.pid))
            counters = scrape_gateway_counters(gw.url) if name != "sglang" else None
        attach_engine_view(records, fleet)
        return records, fleet.replica_names, gw.url, RunCost(
            router_cpu_s=_delta(cpu_before[0], cpu_after[0]), sim_cpu_s=_delta(cpu_before[1], cpu_after[1]),
            counters=counters,
        )


@dataclass(frozen=True)
class RunCost:
    """CPU seconds the router and the sim used while the workload ran, and the gateway's counters at its end."""

    router_cpu_s: float | None
    sim_cpu_s: float | None
    counters: dict[str, dict[str, float]] | None

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"router_cpu_s": self.router_cpu_s, "sim_cpu_s": self.sim_cpu_s}
        if self.counters is not None:
            out["gateway"] = self.counters
        return out


def _delta(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
