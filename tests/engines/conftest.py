"""The real-engine suite: two real vLLM replicas (the CPU build) serving a tiny model, kvgate in front.

Kept out of ``./dev.sh test`` (``norecursedirs``): it needs vLLM's own environment (``scripts/engines_env.sh``, built
on first use) and minutes of engine start-up. ``./dev.sh test-engines`` runs it. The replicas start once per session,
in parallel, and are stopped by PID (their process groups) at the end, also on failure; each test starts its own
``kvgate serve`` and uses prompts no other test sends, so tests share engines but not cache state.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml

from kvgate.loadgen.engines import (
    MODEL_NAME, VllmReplica, engines_python, free_ports, make_replicas, policy_file, start_all, stop_all,
    tiny_model,
)
from tests.support import Gateway, start_kvgate

SMALL_CACHE_BLOCKS = 512
"""Each replica's KV cache, in 32-token blocks (16,384 tokens): small enough for a test to force evictions."""
KVGATE_READY_S = 60.0
AGENT_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--enable-scale-out",
              "--trust-request-chat-template"]
"""What agents' requests need of a vLLM server: tools with ``tool_choice: auto`` (Claude Code's, Codex's) are refused
without a tool parser; pythonic needs no special tokens in the tiny model's vocabulary. And what checking kvgate's
rendering against the engine's needs: ``--enable-scale-out`` serves ``/v1/chat/completions/render`` (the prompt ids
the engine would run, by the chat path's own code; without it the route answers 403, and no other route changes),
``--trust-request-chat-template`` lets such a request bring its own template (refused with 400 otherwise; no other
test sends one)."""
AGENT_ENV = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
"""Stored responses (``previous_response_id``), off in vLLM by default."""

T = TypeVar("T")


@pytest.fixture(scope="session")
def engine_runtime() -> tuple[Path, Path]:
    """vLLM's python and the tiny model's directory (installed and built on first use, then reused)."""
    python = engines_python()
    return python, tiny_model(python)


@pytest.fixture(scope="session")
def replicas(
    engine_runtime: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[VllmReplica]]:
    python, model = engine_runtime
    log_dir = tmp_path_factory.mktemp("engines")
    group = make_replicas(2, free_ports(2), free_ports(4), log_dir, python=python, model=model,
                          extra_args=["--num-gpu-blocks-override", str(SMALL_CACHE_BLOCKS), *AGENT_ARGS],
                          env=AGENT_ENV)
    started = time.monotonic()
    start_all(group)
    print(f"\n{len(group)} vLLM replicas ready in {time.monotonic() - started:.0f} s")
    try:
        yield group
    finally:
        stop_all(group)


def restart(replica: VllmReplica, *, kill: bool) -> None:
    """Stop ``replica`` (SIGTERM, or SIGKILL as a crash) and start it again on the same ports; waits until ready."""
    if kill:
        replica.kill()
    else:
        replica.stop()
    replica.start()
    replica.wait_ready()


def write_fleet_file(path: Path, replicas: list[VllmReplica], model: Path, **sections: Any) -> Path:
    """kvgate's policy file for ``replicas`` (no block size: kvgate must learn it), plus overridden sections."""
    doc = policy_file(replicas, model)
    doc.update(sections)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def fleet_file(replicas: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path) -> Path:
    return write_fleet_file(tmp_path / "fleet.yaml", replicas, engine_runtime[1])


@pytest.fixture
def kvgate(fleet_file: Path, tmp_path: Path) -> Iterator[Gateway]:
    gw = start_kvgate(tmp_path, fleet_file, timeout=KVGATE_READY_S)
    try:
        wait_ready(gw)
        yield gw
    finally:
        gw.stop()


def start_gateway(tmp_path: Path, name: str, replicas: list[VllmReplica], model: Path,
                  **sections: Any) -> Gateway:
    """A ``kvgate serve`` of its own in front of ``replicas``, with overridden policy-file sections; the caller stops
    it."""
    fleet = write_fleet_file(tmp_path / f"{name}.yaml", replicas, model, **sections)
    gw = start_kvgate(tmp_path, fleet, timeout=KVGATE_READY_S)
    try:
        wait_ready(gw)
    except BaseException:
        gw.stop()
        raise
    return gw


def wait_ready(gw: Gateway, timeout_s: float = KVGATE_READY_S) -> None:
    """Until kvgate says it can route (its health checks found the replicas)."""
    wait_for(lambda: httpx.get(gw.url + "/ready", timeout=2.0).status_code == 200 or None, timeout_s,
             "kvgate /ready")


def wait_for(probe: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def unique_text(tokens: int) -> str:
    """About ``tokens`` tokens (shipped tokenizer) of text that starts with a tag no other prompt of the session
    has, so no block of it, nor of anything after it, can be cached before."""
    return uuid.uuid4().hex[:8] + " " + " ".join(f"w{i}" for i in range(max(1, tokens * 10 // 38)))


def chat(content: str, *history: dict[str, str]) -> list[dict[str, str]]:
    return [*history, {"role": "user", "content": content}]


def explain(gw: Gateway, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL_NAME, **body}, timeout=30.0)
    assert resp.status_code == 200, resp.text
    return resp.json()


def rows(explained: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in explained["replicas"]}


def credited(row: dict[str, Any]) -> int:
    """Prompt tokens kvgate's cost model credits as cached on this replica (what it routes on)."""
    return sum(row.get("cached_tokens_by_tier", {}).values())  # unroutable replicas are not estimated


def settled_explain(gw: Gateway, body: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    """Explain ``body`` once no replica's match rests on predictions (blocks kvgate assumed a just-routed request
    would store): each is confirmed by the engine's events or expires, so the answer reflects the engines' events."""
    latest: dict[str, Any] = {}

    def probe() -> bool:
        latest.update(explain(gw, body))
        return all(row["cached_tokens"]["predicted"] == 0 for row in latest["replicas"])

    wait_for(probe, timeout_s, "kvgate's predictions to be confirmed or expire")
    return latest


def tokenize(replica: VllmReplica, body: dict[str, Any]) -> list[int]:
    """The engine's own token ids for a chat (``messages``) or completions (``prompt``) body."""
    resp = httpx.post(replica.url + "/tokenize", json={"model": MODEL_NAME, **body}, timeout=30.0)
    assert resp.status_code == 200, resp.text
    return resp.json()["tokens"]


def send_direct(replica: VllmReplica, body: dict[str, Any], max_tokens: int = 4) -> dict[str, Any]:
    """A request straight to the engine (bypassing kvgate, as another client would); returns its usage."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    resp = httpx.post(replica.url + path, json={"model": MODEL_NAME, "max_tokens": max_tokens, **body}, timeout=120.0)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]


def reset_prefix_cache(replica: VllmReplica) -> None:
    """Reset an idle engine's prefix cache (vLLM answers ``{"success": false}`` while a request holds blocks)."""
    resp = httpx.post(replica.url + "/reset_prefix_cache", timeout=30.0)
    assert resp.status_code == 200 and resp.json() == {"success": True}, resp.text


def metric_families(text: str) -> set[str]:
    """Family names present in a Prometheus text page (from its sample lines)."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names
