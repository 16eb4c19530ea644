"""Engines and kvgate restarting under each other, and engine cache resets: kvgate never credits what an engine
no longer holds, and catches up on what it missed from the engines' replay buffers."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from kvgate.loadgen.engines import MODEL_NAME, VllmReplica
from tests.engines.conftest import (
    chat, credited, explain, reset_prefix_cache, restart, rows, send_direct, settled_explain, start_gateway,
    tokenize, unique_text, wait_for,
)
from tests.engines.engine_state import replay_state
from tests.engines.test_cache_truth import send_checked
from tests.engines.test_disaggregation import samples
from tests.support import Gateway

SCRAPE_MARGIN_S = 5.0
"""How long after an engine is back kvgate may take to stop crediting what the engine lost: a few scrape and health
intervals, far below the 40-60 s an engine takes to restart."""


def credits_for(gw: Gateway, replica: VllmReplica, bodies: list[dict[str, Any]]) -> list[int]:
    return [credited(rows(settled_explain(gw, body))[replica.name]) for body in bodies]


def expect_credits(gw: Gateway, replica: VllmReplica, bodies: list[dict[str, Any]], expected: list[int] | None,
                   timeout_s: float, what: str) -> None:
    """Wait until ``gw`` credits ``expected`` on ``replica`` for ``bodies``; with None, what the engine's replay buffer
    says it holds, read afresh on each poll (the engine publishes a request's blocks around the time it answers, not
    strictly before)."""
    latest: list[int] = []
    target: list[int] = [] if expected is None else expected

    def agrees() -> bool:
        if expected is None:
            target[:] = engine_truth(replica, bodies)
        latest[:] = credits_for(gw, replica, bodies)
        return latest == target

    try:
        wait_for(agrees, timeout_s, what)
    except AssertionError:
        raise AssertionError(f"{what}: kvgate credits {latest} on {replica.name}, expected {target}") from None


def engine_truth(replica: VllmReplica, bodies: list[dict[str, Any]]) -> list[int]:
    """What the engine would serve from cache for each body, from its own replay buffer."""
    state = replay_state(replica.replay_endpoint)
    return [state.reusable_tokens(tokenize(replica, body)) for body in bodies]


def process_start_time(replica: VllmReplica) -> float | None:
    for line in httpx.get(replica.url + "/metrics", timeout=10.0).text.splitlines():
        if line.startswith("process_start_time_seconds "):
            return float(line.split()[1])
    return None


def test_engine_restarts_graceful_and_killed(
    replicas: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path
) -> None:
    """vllm-0 is stopped gracefully and vllm-1 killed with SIGKILL, both restarted on the same ports. Two gateways
    watch: one with default health checks (they fail while an engine is down), and one whose health checks never
    mark a replica down, so only the engine's restart itself can tell it the cache is gone."""
    model = engine_runtime[1]
    default = start_gateway(tmp_path, "default", replicas, model)
    patient = start_gateway(tmp_path, "patient", replicas, model,
                            health={"interval_s": 2.0, "failures_to_down": 1_000_000})
    try:
        held = {r.name: [{"messages": chat(unique_text(2000))}] for r in replicas}
        for replica in replicas:
            send_direct(replica, held[replica.name][0])
        for replica in replicas:
            truth = engine_truth(replica, held[replica.name])
            assert truth[0] > 0
            for gw in (default, patient):
                expect_credits(gw, replica, held[replica.name], truth, 10.0, "credits before the restart")
        started_before = [process_start_time(r) for r in replicas]

        errors: list[BaseException] = []

        def restart_one(replica: VllmReplica, kill: bool) -> None:
            try:
                restart(replica, kill=kill)
            except BaseException as e:  # re-raised below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=restart_one, args=(replicas[0], False)),
                   threading.Thread(target=restart_one, args=(replicas[1], True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

        started_after = [process_start_time(r) for r in replicas]
        assert all(s is not None for s in started_before + started_after)
        assert all(a > b for a, b in zip(started_after, started_before))

        for replica in replicas:
            for gw, name in ((default, "default health"), (patient, "health never failing")):
                expect_credits(gw, replica, held[replica.name], [0], SCRAPE_MARGIN_S + 5.0,
                               f"{name}: nothing credited on the restarted {replica.name}")

        # The restarted engines' new event streams (sequence numbers from 0 again) are followed, once each gateway
        # sees the engines healthy again. (A request an engine serves while a gateway still holds it down is a miss
        # there: the gateway forgets what it learned meanwhile unless it can prove it came from the new process.)
        probe = {"messages": chat("health")}
        for gw in (default, patient):
            wait_for(lambda: all(row["healthy"] for row in rows(explain(gw, probe)).values()), 60.0,
                     "every replica healthy again")
        by_name = {r.name: r for r in replicas}
        for c in range(2):
            body = {"messages": chat(unique_text(1200))}
            for label in ("cold", "warm"):
                for gw in (default, patient):
                    turn, _ = send_checked(gw, body, f"after restart {c} {label}", stream=False)
                    assert turn.credited == turn.engine_cached, turn
                    # The other gateway learns of this request only from the engine's events, which can trail the
                    # reply: wait until both credit what the engine now holds before the next send.
                    served = by_name[turn.replica]
                    for watcher in (default, patient):
                        expect_credits(watcher, served, [body], None, 10.0, f"after restart {c} {label}")
    finally:
        patient.stop()
        default.stop()


def test_kvgate_restart_catches_up_from_replay(
    replicas: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path
) -> None:
    """kvgate stops while engines keep serving; a new kvgate learns what they stored meanwhile from replay."""
    model = engine_runtime[1]
    first = start_gateway(tmp_path, "first", replicas, model)
    try:
        seen = [{"messages": chat(unique_text(1600))} for _ in range(2)]
        for body in seen:
            send_checked(first, body, "while kvgate runs", stream=False)
    finally:
        first.stop()
    missed = {r.name: {"messages": chat(unique_text(1600))} for r in replicas}
    for replica in replicas:
        send_direct(replica, missed[replica.name])

    second = start_gateway(tmp_path, "second", replicas, model)
    try:
        # A subscription catches up when its first frame arrives; the engines publish again with their next request.
        new = {r.name: {"messages": chat(unique_text(400))} for r in replicas}
        for replica in replicas:
            send_direct(replica, new[replica.name])
        for replica in replicas:
            bodies = [*seen, missed[replica.name], new[replica.name]]
            truth = engine_truth(replica, bodies)
            assert truth[-2] > 0 and truth[-1] > 0
            expect_credits(second, replica, bodies, truth, 15.0, "caught up from replay")
    finally:
        second.stop()


def test_kvgate_restart_across_a_cache_reset(
    replicas: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path
) -> None:
    """While no kvgate runs, an engine resets its prefix cache and stores new prompts. A kvgate started afterwards
    replays the engine's buffer, through the AllBlocksCleared, and credits exactly what was stored after it."""
    target = replicas[1]
    before = {"messages": chat(unique_text(1600))}
    after = {"messages": chat(unique_text(1600))}
    send_direct(target, before)
    reset_prefix_cache(target)
    send_direct(target, after)  # the engine publishes AllBlocksCleared at this step, with after's blocks
    truth = engine_truth(target, [before, after])
    assert truth[0] == 0 and truth[1] > 0

    gw = start_gateway(tmp_path, "late", replicas, engine_runtime[1])
    try:  # the engine stays idle: the subscription catches up from replay when it starts
        expect_credits(gw, target, [before, after], truth, 15.0, "caught up across the reset")
    finally:
        gw.stop()


def test_kvgate_started_while_the_engines_idle_credits_their_history_at_once(
    replicas: list[VllmReplica], engine_runtime: tuple[Path, Path], tmp_path: Path
) -> None:
    """Prompts stored while no kvgate ran, the engines idle since: a kvgate started now credits them from the
    engines' replay buffers without any new request (no live frame comes to trigger a catch-up)."""
    stored = {r.name: {"messages": chat(unique_text(1200))} for r in replicas}
    for replica in replicas:
        send_direct(replica, stored[replica.name])
    truths = {r.name: engine_truth(r, [stored[r.name]]) for r in replicas}
    assert all(truth[0] > 0 for truth in truths.values())
    gw = start_gateway(tmp_path, "idle-start", replicas, engine_runtime[1])
    try:
        for replica in replicas:
            expect_credits(gw, replica, [stored[replica.name]], truths[replica.name], 15.0, "credited at start")
    finally:
        gw.stop()


def test_a_cache_reset_is_refused_while_a_request_runs(replicas: list[VllmReplica]) -> None:
    """vLLM forgets nothing and answers ``{"success": false}`` while a request holds blocks (``kvgate sim`` does the
    same); the cache is still there afterwards.

    The tiny model decodes the held request's 4,000 tokens in a second or two, so on a loaded machine it can end
    before the reset arrives. A reset that succeeded is a failure only if the engine still runs a request after it
    (then one ran throughout); otherwise the request had ended, and the case is set up again."""
    target = replicas[0]
    for _ in range(3):
        held = {"prompt": unique_text(600)}
        send_direct(target, held)
        body = {"model": MODEL_NAME, "prompt": held["prompt"], "max_tokens": 4000, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=60.0) as client:
            with client.stream("POST", target.url + "/v1/completions", json=body) as streamed:
                chunks = streamed.iter_lines()
                next(line for line in chunks if line.startswith("data: {"))  # running: its blocks are in use
                answer = client.post(target.url + "/reset_prefix_cache")
                running = sum(s.value for s in samples(target.url, "vllm:num_requests_running"))
        assert answer.status_code == 200, answer.text
        if answer.json() == {"success": False}:
            break
        assert running == 0, f"the cache was reset while {running:g} requests ran: {answer.text}"
    else:
        raise AssertionError("the held request ended before the reset three times")
    assert send_direct(target, held)["prompt_tokens_details"]["cached_tokens"] > 0


def test_reset_prefix_cache_while_kvgate_runs(kvgate: Gateway, replicas: list[VllmReplica]) -> None:
    """vLLM announces a reset at its next scheduler step (AllBlocksCleared with that step's BlockStored); from then
    on kvgate credits nothing stored before it."""
    target = replicas[0]
    before = {"messages": chat(unique_text(1600))}
    after = {"messages": chat(unique_text(1600))}
    send_direct(target, before)
    expect_credits(kvgate, target, [before], engine_truth(target, [before]), 10.0, "credited before the reset")
    reset_prefix_cache(target)
    send_direct(target, after)
    truth = engine_truth(target, [before, after])
    assert truth[0] == 0 and truth[1] > 0
    expect_credits(kvgate, target, [before, after], truth, 10.0, "nothing from before the reset")
    assert send_direct(target, before)["prompt_tokens_details"]["cached_tokens"] == 0
