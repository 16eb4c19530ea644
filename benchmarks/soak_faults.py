"""Does the prefix index lie under faults? A bounded soak of `kvgate serve` in front of `kvgate sim`, with faults.

Starts a simulated fleet and kvgate (subprocesses), drives requests that share long document prefixes through kvgate
(the official ``openai`` client, non-streamed, so every answer carries the engine's usage), and injects a fault on a
random replica every few seconds: graceful restarts (health never fails), hard restarts (the HTTP listener goes away,
the engine restarts, the listener comes back), health loss and recovery under load, dropped and delayed KV events,
replay outages, cache resets and stalls.

Per request it compares what kvgate credited on the replica that served it (its request log line's
``matched_tokens``, which is also what the policy, explain and metrics saw) with what the engine reports it reused
(``usage.prompt_tokens_details.cached_tokens``). A request is over-credited when kvgate credited at least one block
more than the engine reused. Requests sent to a replica within ``--race-window`` seconds after that replica was
restarted or reset are counted apart: nothing can know of a restart before the engine shows it (its first event or its
scraped process start time), and kvgate scrapes every 100 ms. Requests in flight on a replica when its cache is
wiped (a restart or a cache reset) are counted apart too: they were routed on a cache that was still there.

Run by hand (about five minutes by default):

    .venv/bin/python benchmarks/soak_faults.py [--seconds 300] [--replicas 4] [--concurrency 12] [--seed 1]

``--seconds 40`` gives a quick look. The output directory keeps kvgate's and the sim's logs and a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support import Sim, start_kvgate, start_sim  # noqa: E402

MODEL = "kvgate-sim"
FAULTS = (
    "restart", "hard_restart", "unhealthy", "drop_events", "replay_outage", "delay_events", "reset_cache", "stall",
)
WIPES = ("restart", "hard_restart", "reset_cache")
"""Faults that empty the engine's cache: a request in flight on that replica, or sent to it before kvgate can know,
races them."""


@dataclass
class Sent:
    request_id: str
    replica: str | None
    started: float
    finished: float
    cached_tokens: int | None
    error: str | None = None


@dataclass
class Fault:
    at: float
    replica: int
    kind: str


def documents(rng: random.Random, count: int) -> list[str]:
    """Long shared prefixes (about 1,000-3,000 tokens each) that many requests extend."""
    words = [f"w{rng.randrange(5000)}" for _ in range(20000)]
    docs = []
    for d in range(count):
        n = rng.randrange(600, 1800)
        start = rng.randrange(len(words) - n)
        docs.append(f"Document {d}: " + " ".join(words[start : start + n]))
    return docs


async def fault_injector(sim: Sim, rng: random.Random, every_s: float, stop_at: float, log: list[Fault]) -> None:
    async with httpx.AsyncClient(timeout=10) as http:

        async def fault(replica: int, body: dict) -> None:
            via = (replica + 1) % sim.replicas  # ask another replica: this one's listener may be down
            r = await http.post(sim.url(via) + "/sim/fault", json={**body, "replica": replica})
            r.raise_for_status()

        while time.monotonic() + every_s < stop_at:
            await asyncio.sleep(every_s * rng.uniform(0.6, 1.4))
            replica = rng.randrange(sim.replicas)
            kind = rng.choice(FAULTS)
            log.append(Fault(time.monotonic(), replica, kind))
            if kind == "restart":
                await fault(replica, {"action": "restart"})
            elif kind == "hard_restart":
                await fault(replica, {"action": "stop"})
                await fault(replica, {"action": "restart"})
                await asyncio.sleep(2.0)
                await fault(replica, {"action": "start"})
            elif kind == "unhealthy":
                await fault(replica, {"action": "unhealthy"})
                await asyncio.sleep(rng.uniform(2.0, 5.0))
                await fault(replica, {"action": "healthy"})
            elif kind == "drop_events":
                await fault(replica, {"action": "drop_events", "fraction": rng.choice([0.2, 0.5, 1.0])})
                await asyncio.sleep(rng.uniform(1.0, 4.0))
                await fault(replica, {"action": "drop_events", "fraction": 0.0})
            elif kind == "replay_outage":
                await fault(replica, {"action": "disable_replay"})
                await fault(replica, {"action": "drop_events", "fraction": 0.3})
                await asyncio.sleep(rng.uniform(1.0, 3.0))
                await fault(replica, {"action": "drop_events", "fraction": 0.0})
                await fault(replica, {"action": "enable_replay"})
            elif kind == "delay_events":
                await fault(replica, {"action": "delay_events", "ms": rng.choice([50, 200, 500])})
                await asyncio.sleep(rng.uniform(1.0, 4.0))
                await fault(replica, {"action": "delay_events", "ms": 0})
            elif kind == "reset_cache":
                await fault(replica, {"action": "reset_cache"})
            elif kind == "stall":
                await fault(replica, {"action": "stall", "seconds": rng.uniform(1.0, 3.0)})


async def client_worker(
    client: openai.AsyncOpenAI, rng: random.Random, docs: list[str], worker: int, stop_at: float, sent: list[Sent]
) -> None:
    i = 0
    while time.monotonic() < stop_at:
        doc = docs[min(int(rng.paretovariate(1.2)) - 1, len(docs) - 1)]  # a few hot documents, a long tail
        prompt = f"{doc}\nQuestion {worker}-{i}: what does w{rng.randrange(5000)} mean here?"
        request_id = f"soak-{worker}-{i}"
        i += 1
        started = time.monotonic()
        try:
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt=prompt, max_tokens=4, extra_headers={"x-request-id": request_id})
            completion = raw.parse()
            details = completion.usage.prompt_tokens_details if completion.usage else None
            sent.append(Sent(request_id, raw.headers.get("x-kvgate-replica"), started, time.monotonic(),
                             None if details is None else details.cached_tokens))
        except openai.APIError as e:
            sent.append(Sent(request_id, None, started, time.monotonic(), None, type(e).__name__))
            await asyncio.sleep(0.05)


def request_lines(log_text: str) -> dict[str, dict]:
    """kvgate's request log lines (one JSON object per request) by request id."""
    lines: dict[str, dict] = {}
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "matched_tokens" in record and "id" in record:
            lines[record["id"]] = record
    return lines


def event_counters(metrics_text: str) -> dict[str, float]:
    """kvgate's index counters at the end of the run: events dropped by reason, resets, restarts, purges, replays."""
    wanted = ("kvgate_events_dropped_total", "kvgate_events_resets_total", "kvgate_events_restarts_total",
              "kvgate_events_purges_total", "kvgate_events_replays_", "kvgate_events_gaps_detected_total",
              "kvgate_events_applied_total", "kvgate_events_unknown_removed_total")
    counters: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(wanted) and float(line.rsplit(" ", 1)[1]):
            name, value = line.rsplit(" ", 1)
            counters[name] = float(value)
    return counters


def racing(sent: list[Sent], faults: list[Fault], race_s: float) -> set[str]:
    """Requests that race a wipe of their replica's cache (a restart or a cache reset at time t): in flight at t, or
    sent after t before the wipe could be known. A restarted engine shows in its scraped start time within
    ``race_s``; a reset shows only in the ``AllBlocksCleared`` the engine publishes with its next step's stores, so
    requests sent before the first request sent after the reset came back are racing it as well."""
    by_replica: dict[str, list[Sent]] = {}
    for s in sent:
        if s.replica:
            by_replica.setdefault(s.replica, []).append(s)
    out: set[str] = set()
    for f in faults:
        if f.kind not in WIPES:
            continue
        mine = by_replica.get(f"sim-{f.replica}", [])
        first_back = min((s.finished for s in mine if s.started >= f.at), default=f.at)
        known_at = max(f.at + race_s, first_back)
        out.update(s.request_id for s in mine if s.started <= f.at <= s.finished or f.at <= s.started <= known_at)
    return out


AFTER_RECOVERY_S = (5.0, 35.0)
"""The 30 s after a health fault ended (it lasts 2-5 s), measured from its start."""


def after_recovery(s: Sent, faults: list[Fault]) -> bool:
    start, end = AFTER_RECOVERY_S
    return any(f.kind == "unhealthy" and f"sim-{f.replica}" == s.replica and start <= s.started - f.at <= end
               for f in faults)


def summarise(sent: list[Sent], lines: dict[str, dict], faults: list[Fault], block: int, race_s: float) -> dict:
    raced_ids = racing(sent, faults, race_s)
    recovered = recovered_over = 0
    compared = over = raced = raced_over = 0
    over_examples: list[dict] = []
    over_with_prediction = 0
    excess: Counter[int] = Counter()
    for s in sent:
        line = lines.get(s.request_id)
        if s.error or s.cached_tokens is None or line is None or line.get("status") != "200":
            continue
        matched = line["matched_tokens"]
        is_over = matched - s.cached_tokens >= block
        if after_recovery(s, faults):
            recovered += 1
            recovered_over += is_over
        if s.request_id in raced_ids:
            raced += 1
            raced_over += is_over
            continue
        compared += 1
        if is_over:
            over += 1
            over_with_prediction += bool(line.get("predicted_tokens"))
            excess[(matched - s.cached_tokens) // block * block] += 1
            recent = [f for f in faults if f"sim-{f.replica}" == s.replica and 0 <= s.started - f.at <= 10.0]
            if len(over_examples) < 40:
                over_examples.append({**asdict(s), "matched": matched, "log": line,
                                      "recent_faults": [(f.kind, round(s.started - f.at, 2)) for f in recent]})
    return {
        "requests": len(sent),
        "failed": sum(1 for s in sent if s.error),
        "compared": compared,
        "over_credited": over,
        "over_credited_share": over / compared if compared else 0.0,
        "over_credited_with_predicted_tokens": over_with_prediction,
        "over_credit_tokens_histogram": dict(sorted(excess.items())),
        "after_recovery": recovered,
        "after_recovery_over_credited": recovered_over,
        "racing_a_wipe": raced,
        "racing_a_wipe_over_credited": raced_over,
        "prompt_tokens": sum(lines[s.request_id]["prompt_tokens"] for s in sent
                             if s.request_id in lines and s.cached_tokens is not None and not s.error),
        "credited_tokens": sum(lines[s.request_id]["matched_tokens"] for s in sent
                               if s.request_id in lines and s.cached_tokens is not None and not s.error),
        "engine_cached_tokens": sum(s.cached_tokens or 0 for s in sent if not s.error),
        "faults": dict(Counter(f.kind for f in faults)),
        "fault_log": [asdict(f) for f in faults],
        "examples": over_examples,
    }


def report(summary: dict, out: Path) -> None:
    print(f"{summary['requests']} requests ({summary['failed']} failed), {summary['compared']} compared, "
          f"faults {summary['faults']}")
    print(f"over-credited by >= 1 block: {summary['over_credited']} "
          f"({100 * summary['over_credited_share']:.3f}%), of which {summary['over_credited_with_predicted_tokens']} "
          f"credited predicted tokens; racing a restart or reset: {summary['racing_a_wipe']} "
          f"({summary['racing_a_wipe_over_credited']} over-credited)")
    print(f"in the 30 s after a health loss ended: {summary['after_recovery']} requests, "
          f"{summary['after_recovery_over_credited']} over-credited")
    counters = summary.get("index_counters", {})
    print("index:", ", ".join(f"{k.removeprefix('kvgate_events_')} {v:g}" for k, v in counters.items()))
    prompt = summary.get("prompt_tokens") or 0
    hit = f" ({100 * summary['engine_cached_tokens'] / prompt:.1f}% of {prompt} prompt tokens)" if prompt else ""
    print(f"credited {summary['credited_tokens']} tokens, engines reused {summary['engine_cached_tokens']}{hit}; "
          f"details in {out}")


def reanalyse(out: Path, block: int, race_s: float) -> dict:
    """The summary of an earlier run from its output directory (its requests, faults and kvgate log)."""
    previous = json.loads((out / "summary.json").read_text())
    sent = [Sent(**json.loads(line)) for line in (out / "requests.jsonl").read_text().splitlines()]
    faults = [Fault(**f) for f in previous["fault_log"]]
    log_text = "".join(p.read_text(errors="replace") for p in sorted(out.glob("kvgate-*.log")))
    summary = summarise(sent, request_lines(log_text), faults, block, race_s)
    summary["index_counters"] = previous.get("index_counters", {})
    return summary


async def drive(sim: Sim, url: str, args: argparse.Namespace, faults: list[Fault], sent: list[Sent]) -> None:
    rng = random.Random(args.seed)
    docs = documents(rng, args.documents)
    stop_at = time.monotonic() + args.seconds
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    tasks = [asyncio.create_task(client_worker(client, random.Random(args.seed * 1000 + w), docs, w, stop_at, sent))
             for w in range(args.concurrency)]
    tasks.append(asyncio.create_task(fault_injector(sim, random.Random(args.seed + 7), args.fault_every, stop_at,
                                                    faults)))
    await asyncio.gather(*tasks)
    await client.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--documents", type=int, default=40)
    p.add_argument("--kv-blocks", type=int, default=1200, help="per replica: a few dozen documents, so it evicts")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--fault-every", type=float, default=6.0, help="mean seconds between faults")
    p.add_argument("--race-window", type=float, default=0.2,
                   help="requests sent to a replica this soon after its restart race it (reported apart)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reanalyse", type=Path, default=None, metavar="DIR",
                   help="summarise an earlier run's output directory again instead of running")
    args = p.parse_args()
    if args.reanalyse is not None:
        summary = reanalyse(args.reanalyse, args.block_size, args.race_window)
        (args.reanalyse / "summary.json").write_text(json.dumps(summary, indent=2))
        report(summary, args.reanalyse)
        return 0
    out = args.out or Path(tempfile.mkdtemp(prefix="kvgate-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    sim = start_sim(out, args.replicas, "--time-scale", str(args.time_scale), "--kv-blocks", str(args.kv_blocks),
                    "--block-size", str(args.block_size))
    gateway = None
    faults: list[Fault] = []
    sent: list[Sent] = []
    index_counters: dict[str, float] = {}
    try:
        config = yaml.safe_load(sim.config_path.read_text())
        config["health"] = {"interval_s": 0.5, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 2}
        path = out / "kvgate.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = start_kvgate(out, path)
        asyncio.run(drive(sim, gateway.url, args, faults, sent))
        index_counters = event_counters(httpx.get(gateway.url + "/metrics", timeout=10).text)
    finally:
        if gateway is not None:
            gateway.stop()  # flushes its batched request log
        sim.stop()
    assert gateway is not None
    summary = summarise(sent, request_lines(gateway.process.log_path.read_text(errors="replace")), faults,
                        args.block_size, args.race_window)
    summary["index_counters"] = index_counters
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "requests.jsonl").write_text("".join(json.dumps(asdict(s)) + "\n" for s in sent))
    report(summary, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
