"""How soon a gateway restarted mid-run is warm again: its own requests' hit ratio, second by second.

One simulated fleet whose replay buffers keep only their last batches (``--replay-buffer-steps``), two gateways A
and B (B lists A as its peer), documents asked again and again, each request sent to A or B at random. Mid-run B is
stopped and started again, once with ``peers`` (warm start from A) and once without (what the replay buffers give);
the script prints, per second since B's restart, the engines' hit ratio of B's requests next to A's in the same
second, and when B was ready. Run by hand: ``.venv/bin/python benchmarks/bench_restart_warm.py``.
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from kvgate.loadgen.bench import KVGATE, free_port_block
from kvgate.loadgen.procs import ChildProcess, interrupt_on_sigterm

MODEL = "kvgate-sim"
PEER_TOKEN = "bench-restart-peer-token"


def document(i: int, words: int) -> str:
    rng = random.Random(i)
    return " ".join(f"doc{i}-{rng.randrange(10_000)}" for _ in range(words))


def start_gateway(config: Path, out: Path, name: str) -> ChildProcess:
    port = free_port_block(1)
    gw = ChildProcess(name, [*KVGATE, "serve", "--config", str(config), "--port", str(port)], out / f"{name}.log")
    gw.start()
    gw.url = f"http://127.0.0.1:{port}"
    return gw


def config_for(fleet: Path, out: Path, name: str, peers: list[str]) -> Path:
    doc = yaml.safe_load(fleet.read_text())
    doc["server"] = {"peer_token": PEER_TOKEN}
    if peers:
        doc["peers"] = {"urls": peers, "warm_start_timeout_s": 10}
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class Traffic:
    """Requests at a fixed rate, each to A or B at random (B only while it accepts connections); records
    (time, gateway, prompt tokens, cached tokens) from the engines' usage."""

    def __init__(self, gateways: dict[str, str], docs: list[str], rate: float) -> None:
        self.gateways = gateways
        self.docs = docs
        self.rate = rate
        self.records: list[tuple[float, str, int, int]] = []
        self.stop = threading.Event()
        self.rng = random.Random(0)
        self.weights = [1 / (k + 1) ** 1.1 for k in range(len(docs))]

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            n = 0
            started = time.monotonic()
            while not self.stop.is_set():
                n += 1
                time.sleep(max(0.0, started + n / self.rate - time.monotonic()))
                name = self.rng.choice(list(self.gateways))
                doc = self.rng.choices(self.docs, self.weights)[0]
                body = {"model": MODEL, "prompt": f"{doc} question {n}", "max_tokens": 1}
                try:
                    r = client.post(self.gateways[name] + "/v1/completions", json=body)
                except httpx.HTTPError:
                    continue
                if r.status_code == 200:
                    usage = r.json()["usage"]
                    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    self.records.append((time.monotonic(), name, usage["prompt_tokens"], cached))


def ready_after(gw: ChildProcess, since: float, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(gw.url + "/ready", timeout=1).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{gw.name} not ready after {timeout_s}s")


def one_restart(args: argparse.Namespace, out: Path, warm: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    http_port, zmq_port = free_port_block(args.replicas), free_port_block(2 * args.replicas)
    fleet_config = out / "fleet.yaml"
    sim = ChildProcess("sim", [*KVGATE, "sim", "--replicas", str(args.replicas), "--port", str(http_port), "--zmq-port",
                        str(zmq_port), "--time-scale", "0", "--replay-buffer-steps", str(args.replay_buffer_steps),
                        "--write-config", str(fleet_config)], out / "sim.log")
    children = [sim.start()]
    try:
        for i in range(args.replicas):
            sim.wait_http(f"http://127.0.0.1:{http_port + i}/health", 60)
        while not fleet_config.exists():
            time.sleep(0.05)
        a = start_gateway(config_for(fleet_config, out, "a", []), out, "a")
        children.append(a)
        ready_after(a, time.monotonic(), 60)
        b_config = config_for(fleet_config, out, "b", [a.url] if warm else [])
        b = start_gateway(b_config, out, "b")
        children.append(b)
        ready_after(b, time.monotonic(), 60)
        docs = [document(i, args.document_words) for i in range(args.documents)]
        traffic = Traffic({"a": a.url, "b": b.url}, docs, args.rate)
        thread = threading.Thread(target=traffic.run, daemon=True)
        thread.start()
        time.sleep(args.before_s)
        b.stop()
        restarted = time.monotonic()
        b = start_gateway(b_config, out, "b-restarted")
        children.append(b)
        traffic.gateways["b"] = b.url
        ready_s = ready_after(b, restarted, 60)
        time.sleep(args.after_s)
        traffic.stop.set()
        thread.join(30)
        report(traffic.records, restarted, ready_s, warm, args.after_s)
    finally:
        for child in reversed(children):
            child.stop()


def report(records: list[tuple[float, str, int, int]], restarted: float, ready_s: float, warm: bool,
           after_s: float) -> None:
    label = "with peers (warm start)" if warm else "without peers (replay buffers only)"
    print(f"\nB restarted {label}: ready {ready_s:.2f} s after its process started")
    before = [r for r in records if r[0] < restarted]
    print(f"  before the restart: A {ratio(before, 'a')}, B {ratio(before, 'b')}")
    print("  second since restart | B's hit ratio (requests) | A's hit ratio (requests)")
    for second in range(int(after_s) + 1):
        window = [r for r in records if restarted + second <= r[0] < restarted + second + 1]
        print(f"  {second:>2}-{second + 1:<2} | {ratio(window, 'b')} | {ratio(window, 'a')}")


def ratio(records: list[tuple[float, str, int, int]], gateway: str) -> str:
    mine = [r for r in records if r[1] == gateway]
    prompt = sum(r[2] for r in mine)
    return f"{sum(r[3] for r in mine) / prompt:.3f} ({len(mine)})" if prompt else "- (0)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--document-words", type=int, default=600, help="words per document (~2-3 tokens each)")
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second over both gateways")
    parser.add_argument("--replay-buffer-steps", type=int, default=20)
    parser.add_argument("--before-s", type=float, default=20.0, help="traffic before B's restart")
    parser.add_argument("--after-s", type=float, default=10.0, help="traffic after B is ready again")
    parser.add_argument("--out", type=Path, default=Path("bench-out/restart-warm"))
    args = parser.parse_args()
    for warm in (True, False):
        one_restart(args, args.out / ("warm" if warm else "cold"), warm)
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # stopped by kill or timeout: stop what it started
    sys.exit(main())
