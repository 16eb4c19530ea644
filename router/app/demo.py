"""``kvgate demo``: kvgate on 127.0.0.1:8000 in front of a 4-replica simulated fleet, in one command.

Starts ``kvgate sim --replicas 4 --write-config <tmp>`` as a child process (:class:`kvgate.loadgen.procs.ChildProcess`:
its own process group, stopped by PID on every exit path), waits until every replica answers ``/health``, prints how
to call the gateway with curl and with the openai SDK, then serves in the foreground until Ctrl-C.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kvgate.loadgen.procs import ChildProcess
from kvgate.router.app import server

SIM_REPLICAS = 4
READY_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--sim-port", type=int, default=9100, help="HTTP port of sim replica 0 (replica i: +i)")
    parser.add_argument("--sim-zmq-port", type=int, default=5557, help="KV-event port of sim replica 0")
    parser.add_argument("--time-scale", type=float, default=1.0, help="sim time scale (0 = instant engines)")
    parser.add_argument("--policy", default=None, help="routing policy (default: the policy file's, cost)")


def usage_text(base_url: str, model: str) -> str:
    return f"""
kvgate is serving on {base_url} in front of {SIM_REPLICAS} simulated vLLM replicas.

  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true}}'

  curl {base_url}/kvgate/v1/explain -H 'Content-Type: application/json' \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c "from openai import OpenAI; c = OpenAI(base_url='{base_url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}]).choices[0].message.content)"

Response headers x-kvgate-replica / x-kvgate-decision say where each request went and why; metrics on
{base_url}/metrics. Ctrl-C stops kvgate and the simulated fleet.
"""


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvgate-demo-") as tmp:
        config = Path(tmp) / "fleet.yaml"
        sim = ChildProcess("kvgate sim", [
            sys.executable, "-m", "kvgate.router.cli", "sim", "--replicas", str(SIM_REPLICAS), "--port",
            str(args.sim_port), "--zmq-port", str(args.sim_zmq_port), "--time-scale", str(args.time_scale),
            "--write-config", str(config),
        ], None).start()
        try:
            for i in range(SIM_REPLICAS):
                sim.wait_http(f"http://127.0.0.1:{args.sim_port + i}/health", READY_TIMEOUT_S)
            print(usage_text(f"http://{args.host}:{args.port}", "kvgate-sim"), flush=True)
            serve_args = argparse.Namespace(
                config=str(config), host=args.host, port=args.port, policy=args.policy, log_level="info"
            )
            code = server.run(serve_args)
            return code if code != server.EXIT_BAD_CONFIG else 1
        except (RuntimeError, TimeoutError) as e:
            print(f"kvgate demo: {e}", file=sys.stderr)
            return 1
        finally:
            sim.stop(10.0)
