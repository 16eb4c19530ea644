"""The prefix index never lies for long, seen end to end: a real `kvgate sim` fleet publishes KV events, real
`kvgate serve` processes subscribe to them, and `POST /kvgate/v1/explain` is how the tests read what the index holds.

Prompts are sent straight to a chosen sim replica (the index learns from events, whoever sent the request), so each
fault lands on a known replica; the first test goes through kvgate with the official openai client. Every prompt is
unique to its test, so tests sharing the module's fleet never read each other's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from kvgate.cache_index.match import reusable_blocks
from kvgate.router.core.config import TenantsConfig
from kvgate.router.core.tenants import TenantResolver
from tests.integration.test_gateway import MODEL, gateway_config, metric_value, sim_fault
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

BLOCK = 16
KV_BLOCKS = 96
"""Small GPU caches, so a handful of prompts evicts a replica's older blocks."""
TENANT_KEYS = {"key-alpha": "alpha", "key-beta": "beta"}
TENANTS = {"api_keys": TENANT_KEYS, "salt_secret": "index-e2e-salt-secret"}
SAME_HOLDINGS_WITHIN_S = 1.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("index-e2e")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 3, "--time-scale", "0", "--kv-blocks", str(KV_BLOCKS), "--block-size", str(BLOCK))
    yield s
    s.stop()


def start_subscribed(sim: Sim, workdir: Path, name: str, api_key: str | None = None, **sections: dict) -> Gateway:
    """A kvgate whose replicas are all routable and whose event subscriptions all deliver (ZMQ drops what a PUB
    sends before a SUB has joined, so a test's first prompt could otherwise go unseen). With tenants, the probes
    carry the cache salt kvgate derives for ``api_key``'s tenant."""
    g = start_kvgate(workdir, gateway_config(sim, workdir, name, **sections))
    salt = None if api_key is None else TenantResolver(TenantsConfig(**TENANTS)).cache_salt(TENANT_KEYS[api_key], None)
    auth = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    try:
        wait_until(lambda: httpx.get(g.url + "/ready", headers=auth, timeout=5).json().get("routable") == [
            f"sim-{i}" for i in range(sim.replicas)])
        for replica in range(sim.replicas):
            probe = prompt_of(f"{name}-joined-{replica}", words=8)
            wait_until(lambda: send(sim, replica, probe, salt) >= 0 and gpu_tokens(g, probe, replica, api_key) > 0,
                       interval=0.1)
    except BaseException:
        g.stop()
        raise
    return g


@pytest.fixture(scope="module")
def gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_subscribed(sim, workdir, "kvgate.yaml", index={"replay_timeout_s": 0.5})
    yield g
    g.stop()


@pytest.fixture(scope="module")
def twin_gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    """A second, independent kvgate subscribed to the same fleet (how kvgate scales out)."""
    g = start_subscribed(sim, workdir, "kvgate-twin.yaml")
    yield g
    g.stop()


@pytest.fixture(scope="module")
def tenant_gw(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_subscribed(sim, workdir, "kvgate-tenants.yaml", "key-alpha", tenants=TENANTS)
    yield g
    g.stop()


def prompt_of(label: str, words: int = 20) -> str:
    """A prompt of 100-200 tokens (a tenth of a replica's cache or less) that no other test sends."""
    return " ".join(f"{label}-{i}" for i in range(words))


def send(sim: Sim, replica: int, prompt: str | list[int], cache_salt: str | None = None) -> int:
    """One completion straight to a sim replica (its KV events reach every subscribed kvgate); the prompt tokens the
    engine found cached."""
    client = openai.OpenAI(base_url=sim.url(replica) + "/v1", api_key="unused", max_retries=0, timeout=30)
    extra = {} if cache_salt is None else {"cache_salt": cache_salt}
    usage = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return usage.prompt_tokens_details.cached_tokens or 0


def explain(gw: Gateway, prompt: str | list[int], api_key: str | None = None) -> dict:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, headers=headers, timeout=5)
    r.raise_for_status()
    return r.json()


def row(explained: dict, replica: int) -> dict:
    return next(r for r in explained["replicas"] if r["name"] == f"sim-{replica}")


def full_blocks(explained: dict) -> int:
    """Tokens of the prompt's reusable blocks: what a replica holding the whole prompt is credited with (its full
    blocks, less the last one when the prompt ends on a block boundary: the engine computes the last token)."""
    return reusable_blocks(explained["prompt_tokens"], BLOCK) * BLOCK


def gpu_tokens(gw: Gateway, prompt: str, replica: int, api_key: str | None = None) -> int:
    return row(explain(gw, prompt, api_key), replica)["cached_tokens"]["gpu"]


def wait_held(gw: Gateway, prompt: str, replica: int, api_key: str | None = None) -> dict:
    """Wait until ``replica`` holds every full block of ``prompt`` on GPU, confirmed by events (not predicted)."""

    def held() -> dict | None:
        explained = explain(gw, prompt, api_key)
        return explained if row(explained, replica)["cached_tokens"]["gpu"] == full_blocks(explained) else None

    return wait_until(held)


def wait_gone(gw: Gateway, prompt: str, replica: int) -> None:
    wait_until(lambda: gpu_tokens(gw, prompt, replica) == 0)


def events_metric(gw: Gateway, field: str, **labels: str) -> float:
    return metric_value(gw, f"kvgate_events_{field}", **labels)


def sim_fault_body(sim: Sim, replica: int, body: dict) -> None:
    """A fault with parameters (``sim_fault`` sends only the action)."""
    httpx.post(sim.url(replica) + "/sim/fault", json=body, timeout=5).raise_for_status()


def next_seq(sim: Sim, replica: int) -> int:
    """The sequence number the replica's publisher gives its next frame."""
    return httpx.get(sim.url(replica) + "/sim/stats", timeout=5).json()["events"]["next_seq"]


def test_a_completed_request_is_held_by_the_replica_that_served_it(gw: Gateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    prompt = prompt_of("served")
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    served = int(raw.headers["x-kvgate-replica"].removeprefix("sim-"))
    explained = wait_held(gw, prompt, served)
    assert full_blocks(explained) >= 4 * BLOCK and explained["approximate"] is False
    for other in explained["replicas"]:
        if other["name"] != f"sim-{served}":
            assert other["cached_tokens"] == {"gpu": 0, "cpu": 0, "storage": 0, "predicted": 0}


def test_a_prediction_no_event_confirms_is_forgotten_at_its_ttl(sim: Sim, gw: Gateway) -> None:
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    prompt = prompt_of("predicted")
    for replica in range(sim.replicas):
        sim_fault_body(sim, replica, {"action": "drop_events", "fraction": 1.0})
    try:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
        served = int(raw.headers["x-kvgate-replica"].removeprefix("sim-"))
        explained = explain(gw, prompt)  # well within the default 2 s TTL
        assert row(explained, served)["cached_tokens"] == {
            "gpu": 0, "cpu": 0, "storage": 0, "predicted": full_blocks(explained)}
        wait_until(lambda: row(explain(gw, prompt), served)["cached_tokens"]["predicted"] == 0)
        assert gpu_tokens(gw, prompt, served) == 0
    finally:
        for replica in range(sim.replicas):
            sim_fault_body(sim, replica, {"action": "drop_events", "fraction": 0.0})
    send(sim, served, prompt_of("reveals-unconfirmed"))  # the gap is replayed: now events confirm the blocks
    wait_held(gw, prompt, served)


def test_eviction_removes_the_evicted_blocks(sim: Sim, gw: Gateway) -> None:
    first = prompt_of("evicted")
    send(sim, 2, first)
    blocks = full_blocks(wait_held(gw, first, 2))
    for i in range(2 * KV_BLOCKS * BLOCK // blocks):  # twice the cache's capacity of other prompts
        send(sim, 2, prompt_of(f"pressure{i}"))
    wait_until(lambda: gpu_tokens(gw, first, 2) < blocks)
    assert gpu_tokens(gw, prompt_of(f"pressure{i}"), 2) > 0  # the latest prompt is what the cache holds now


def test_a_restarted_replica_loses_its_holdings_under_a_new_generation(sim: Sim, gw: Gateway) -> None:
    before = prompt_of("before-restart")
    send(sim, 1, before)
    generation = row(wait_held(gw, before, 1), 1)["generation"]
    restarts = events_metric(gw, "restarts")
    # frames the old engine published that kvgate never received must not come back after the restart
    sim_fault_body(sim, 1, {"action": "drop_events", "fraction": 1.0})
    lost = prompt_of("lost-before-restart")
    send(sim, 1, lost)
    sim_fault(sim, 0, "restart", 1)
    sim_fault_body(sim, 1, {"action": "drop_events", "fraction": 0.0})
    after = prompt_of("after-restart")
    send(sim, 1, after)  # the new engine's first frame (seq 0) is how kvgate learns of the restart
    wait_held(gw, after, 1)
    explained = explain(gw, before)
    assert row(explained, 1)["cached_tokens"]["gpu"] == 0
    assert row(explained, 1)["generation"] > generation
    assert events_metric(gw, "restarts") == restarts + 1
    assert events_metric(gw, "generation", replica="sim-1") == row(explained, 1)["generation"]
    assert gpu_tokens(gw, lost, 1) == 0


def test_dropped_frames_are_repaired_by_replay(sim: Sim, gw: Gateway) -> None:
    requested, succeeded = events_metric(gw, "replays_requested"), events_metric(gw, "replays_succeeded")
    sim_fault_body(sim, 0, {"action": "drop_events", "fraction": 1.0})
    dropped = [prompt_of(f"dropped{i}") for i in range(2)]
    for prompt in dropped:
        send(sim, 0, prompt)
    sim_fault_body(sim, 0, {"action": "drop_events", "fraction": 0.0})
    assert all(gpu_tokens(gw, prompt, 0) == 0 for prompt in dropped)  # nothing arrived yet
    send(sim, 0, prompt_of("after-drop"))  # its frame reveals the gap
    for prompt in dropped:
        wait_held(gw, prompt, 0)
    assert events_metric(gw, "replays_requested") == requested + 1
    assert events_metric(gw, "replays_succeeded") == succeeded + 1


def test_a_restart_hidden_behind_a_gap_is_not_replayed_into_the_old_generation(sim: Sim, gw: Gateway) -> None:
    """The engine restarts while kvgate misses its frames, and counts past the missing number before a frame gets
    through: the new engine's replay buffer covers the gap, but its frames must not extend the old engine's state."""
    before = prompt_of("before-hidden-restart")
    send(sim, 0, before)
    generation = row(wait_held(gw, before, 0), 0)["generation"]
    detected = events_metric(gw, "resets", reason="replay_mismatch") + events_metric(gw, "restarts")
    sim_fault_body(sim, 0, {"action": "drop_events", "fraction": 1.0})
    try:
        send(sim, 0, prompt_of("unseen-before-hidden-restart"))
        old_next_seq = next_seq(sim, 0)
        sim_fault(sim, 1, "restart", 0)
        wait_until(lambda: send(sim, 0, prompt_of(f"unseen-after-restart-{next_seq(sim, 0)}")) >= 0
                   and next_seq(sim, 0) > old_next_seq + 1)
    finally:
        sim_fault_body(sim, 0, {"action": "drop_events", "fraction": 0.0})
    after = prompt_of("after-hidden-restart")
    send(sim, 0, after)
    wait_held(gw, after, 0)
    explained = explain(gw, before)
    assert row(explained, 0)["cached_tokens"]["gpu"] == 0 and row(explained, 0)["generation"] > generation
    assert send(sim, 0, before) == 0  # the engine indeed lost it
    # the replay's mismatch shows the restart, unless the engine's process start time showed it first
    assert events_metric(gw, "resets", reason="replay_mismatch") + events_metric(gw, "restarts") > detected


def test_a_restart_right_after_a_replay_is_not_taken_for_duplicates(sim: Sim, gw: Gateway) -> None:
    """A replay covers the live frames still in flight; the restarted engine's first frames reuse those numbers."""
    sim_fault_body(sim, 2, {"action": "drop_events", "fraction": 1.0})
    send(sim, 2, prompt_of("dropped-before-replay"))
    sim_fault_body(sim, 2, {"action": "drop_events", "fraction": 0.0})
    replayed = prompt_of("replayed-then-restarted")
    send(sim, 2, replayed)
    generation = row(wait_held(gw, replayed, 2), 2)["generation"]
    detected = events_metric(gw, "resets", reason="restart_after_replay") + events_metric(gw, "restarts")
    sim_fault(sim, 0, "restart", 2)
    after = prompt_of("first-after-replay-and-restart")
    send(sim, 2, after)
    wait_held(gw, after, 2)
    explained = explain(gw, replayed)
    assert row(explained, 2)["cached_tokens"]["gpu"] == 0 and row(explained, 2)["generation"] > generation
    assert events_metric(gw, "resets", reason="restart_after_replay") + events_metric(gw, "restarts") == detected + 1


def test_without_replay_a_gap_purges_the_replica_and_holdings_rebuild(sim: Sim, gw: Gateway) -> None:
    kept = prompt_of("held-before-gap")
    send(sim, 1, kept)
    wait_held(gw, kept, 1)
    purges, failed = events_metric(gw, "purges"), events_metric(gw, "replays_failed")
    sim_fault(sim, 0, "disable_replay", 1)
    try:
        sim_fault_body(sim, 1, {"action": "drop_events", "fraction": 1.0})
        dropped = prompt_of("dropped-unreplayable")
        send(sim, 1, dropped)
        sim_fault_body(sim, 1, {"action": "drop_events", "fraction": 0.0})
        revealing = prompt_of("reveals-gap")
        send(sim, 1, revealing)
        wait_until(lambda: events_metric(gw, "purges") == purges + 1)
        assert events_metric(gw, "replays_failed") == failed + 1
        wait_held(gw, revealing, 1)  # the frame after the gap starts the rebuilt holdings
        assert gpu_tokens(gw, kept, 1) == 0  # purged, although the engine still holds it: forget when in doubt
        assert gpu_tokens(gw, dropped, 1) == 0
        assert send(sim, 1, kept) > 0  # the engine did still hold it
        rebuilt = prompt_of("after-purge")
        send(sim, 1, rebuilt)
        wait_held(gw, rebuilt, 1)
    finally:
        sim_fault(sim, 0, "enable_replay", 1)
        sim_fault_body(sim, 1, {"action": "drop_events", "fraction": 0.0})


def test_tenants_never_see_each_others_blocks(tenant_gw: Gateway) -> None:
    alpha = openai.OpenAI(base_url=tenant_gw.url + "/v1", api_key="key-alpha", max_retries=0, timeout=30)
    prompt = prompt_of("tenant-secret")
    raw = alpha.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    served = int(raw.headers["x-kvgate-replica"].removeprefix("sim-"))
    wait_held(tenant_gw, prompt, served, api_key="key-alpha")
    as_beta = explain(tenant_gw, prompt, api_key="key-beta")
    assert all(r["cached_tokens"] == {"gpu": 0, "cpu": 0, "storage": 0, "predicted": 0} for r in as_beta["replicas"])
    unauthenticated = httpx.post(tenant_gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt})
    assert unauthenticated.status_code == 401


def test_two_gateways_report_the_same_holdings_within_a_second(sim: Sim, gw: Gateway, twin_gw: Gateway) -> None:
    prompts = {replica: prompt_of(f"twin{replica}") for replica in range(sim.replicas)}
    for replica, prompt in prompts.items():
        send(sim, replica, prompt)

    for replica, prompt in prompts.items():
        wait_held(gw, prompt, replica)
    assert_same_holdings_within_a_second(gw, twin_gw, list(prompts.values()))


def test_a_gateway_started_later_catches_up_from_the_replay_buffers(sim: Sim, gw: Gateway, workdir: Path) -> None:
    """Scaling out (or restarting) kvgate: what the engines published before it subscribed is in their replay
    buffers, and the newcomer applies it first, so it agrees with the routers subscribed all along."""
    prompts = {replica: prompt_of(f"history{replica}") for replica in range(sim.replicas)}
    for replica, prompt in prompts.items():
        send(sim, replica, prompt)
        wait_held(gw, prompt, replica)
    late = start_subscribed(sim, workdir, "kvgate-late.yaml")
    try:
        assert_same_holdings_within_a_second(gw, late, list(prompts.values()))
        assert events_metric(late, "replays_succeeded") >= sim.replicas
    finally:
        late.stop()


def assert_same_holdings_within_a_second(first: Gateway, second: Gateway, prompts: list[str]) -> None:
    """Per prompt and replica, the tokens held per tier as ``first`` explains them now, and ``second`` soon after."""

    def holdings(g: Gateway) -> dict[str, list[tuple[str, dict]]]:
        return {prompt: [(r["name"], r["cached_tokens"]) for r in explain(g, prompt)["replicas"]] for prompt in prompts}

    seen = holdings(first)
    deadline = time.monotonic() + SAME_HOLDINGS_WITHIN_S
    while holdings(second) != seen:
        assert time.monotonic() < deadline, f"{second.url} still differs from {first.url}"
        time.sleep(0.02)


def test_reset_cache_clears_the_replicas_holdings_at_once(sim: Sim, gw: Gateway) -> None:
    prompt = prompt_of("reset")
    send(sim, 0, prompt)
    generation = row(wait_held(gw, prompt, 0), 0)["generation"]
    sim_fault(sim, 1, "reset_cache", 0)
    send(sim, 0, prompt_of("after-reset"))  # as in vLLM, AllBlocksCleared goes out with the engine's next step
    wait_gone(gw, prompt, 0)
    assert row(explain(gw, prompt), 0)["generation"] > generation


def test_health_loss_clears_the_replicas_holdings_and_recovery_rebuilds(sim: Sim, gw: Gateway) -> None:
    prompt = prompt_of("health")
    send(sim, 2, prompt)
    generation = row(wait_held(gw, prompt, 2), 2)["generation"]

    def marked_down() -> dict | None:
        explained = explain(gw, prompt)
        return None if row(explained, 2)["healthy"] else explained

    sim_fault(sim, 0, "unhealthy", 2)
    try:
        down = row(wait_until(marked_down), 2)
        assert down["cached_tokens"]["gpu"] == 0 and down["generation"] > generation
    finally:
        sim_fault(sim, 0, "healthy", 2)
    wait_until(lambda: row(explain(gw, prompt), 2)["healthy"])
    assert gpu_tokens(gw, prompt, 2) == 0  # recovery forgets again: nothing from before the outage is trusted
    rebuilt = prompt_of("after-recovery")
    send(sim, 2, rebuilt)
    wait_held(gw, rebuilt, 2)


def test_a_replica_replaced_by_a_reload_keeps_feeding_the_index(sim: Sim, workdir: Path) -> None:
    """A reload that changes a replica's endpoints replaces it: its old subscription stops, its new one must live."""
    g = start_subscribed(sim, workdir, "kvgate-reload.yaml", server={"admin_token": "admin-secret"})
    try:
        config = yaml.safe_load(g.config_path.read_text())
        config["replicas"][1]["url"] = config["replicas"][1]["url"].replace("127.0.0.1", "localhost")
        g.config_path.write_text(yaml.safe_dump(config))
        r = httpx.post(g.url + "/admin/reload", headers={"authorization": "Bearer admin-secret"}, timeout=5)
        assert r.status_code == 200 and r.json()["reloaded"] is True
        prompt = prompt_of("after-reload")
        wait_until(lambda: send(sim, 1, prompt) >= 0 and gpu_tokens(g, prompt, 1) > 0, interval=0.1)
    finally:
        g.stop()


def test_a_prompt_ending_on_a_block_boundary_is_credited_one_block_less(sim: Sim, gw: Gateway) -> None:
    """The engine always computes the last prompt token: 10 full blocks held, 9 reused."""
    prompt = [1000 + i for i in range(10 * BLOCK)]
    send(sim, 1, prompt)
    wait_until(lambda: row(explain(gw, prompt), 1)["cached_tokens"]["gpu"] > 0)
    credited = row(explain(gw, prompt), 1)["cached_tokens"]["gpu"]
    assert credited == 9 * BLOCK == send(sim, 1, prompt)
    longer = [*prompt, 7]  # one token more: all ten blocks are reused
    assert row(explain(gw, longer), 1)["cached_tokens"]["gpu"] == 10 * BLOCK == send(sim, 1, longer)


def models_section(sim: Sim, **fields: object) -> list[dict]:
    """The sim's model entry without its block_size, plus ``fields``."""
    model = {k: v for k, v in yaml.safe_load(sim.config_path.read_text())["models"][0].items() if k != "block_size"}
    return [{**model, **fields}]


def test_the_block_size_is_learned_from_the_engine_when_the_policy_file_has_none(workdir: Path) -> None:
    """vLLM's CPU attention runs 32-token blocks only; the policy file's default is 16."""
    big = start_sim(workdir, 2, "--time-scale", "0", "--block-size", "32")
    g = None
    try:
        g = start_kvgate(workdir, gateway_config(big, workdir, "kvgate-bs32.yaml", models=models_section(big)))
        wait_until(lambda: httpx.get(g.url + "/ready", timeout=5).json().get("routable") == ["sim-0", "sim-1"])
        prompt = prompt_of("block-size-32", words=40)
        wait_until(lambda: [r["block_size"] for r in explain(g, prompt)["replicas"]] == [32, 32])  # scraped
        wait_until(lambda: send(big, 0, prompt) >= 0 and row(explain(g, prompt), 0)["cached_tokens"]["gpu"] > 0,
                   interval=0.1)
        explained = explain(g, prompt)
        assert row(explained, 0)["cached_tokens"]["gpu"] == reusable_blocks(explained["prompt_tokens"], 32) * 32
        assert row(explained, 0)["cached_tokens"]["gpu"] == send(big, 0, prompt)
        assert metric_value(g, "kvgate_replica_block_size", replica="sim-0") == 32
        assert metric_value(g, "kvgate_block_size_mismatch", replica="sim-0") == 0
    finally:
        if g is not None:
            g.stop()
        big.stop()


def test_a_policy_file_block_size_the_engine_contradicts_is_logged_and_metered(workdir: Path) -> None:
    big = start_sim(workdir, 1, "--time-scale", "0", "--block-size", "32")
    g = None
    try:
        config = gateway_config(big, workdir, "kvgate-bs-mismatch.yaml", models=models_section(big, block_size=16))
        g = start_kvgate(workdir, config)
        wait_until(lambda: metric_value(g, "kvgate_block_size_mismatch", replica="sim-0") == 1)
        assert metric_value(g, "kvgate_replica_block_size", replica="sim-0") == 32
        for _ in range(3):
            explain(g, prompt_of("mismatch"))
        assert g.process.output().count("the policy file says block_size 16, the engine uses 32") == 1
    finally:
        if g is not None:
            g.stop()
        big.stop()


def test_a_restart_with_health_never_failing_is_seen_before_any_new_event(sim: Sim, gw: Gateway) -> None:
    """The restarted engine publishes nothing until it stores something: its scraped process start time shows it."""
    prompt = prompt_of("restart-unannounced")
    send(sim, 0, prompt)
    generation = row(wait_held(gw, prompt, 0), 0)["generation"]
    restarts = events_metric(gw, "restarts")
    frames = next_seq(sim, 0)
    sim_fault(sim, 1, "restart", 0)
    wait_until(lambda: gpu_tokens(gw, prompt, 0) == 0, timeout=3.0)
    assert next_seq(sim, 0) == 0 < frames  # the new engine has published nothing: no event told kvgate
    explained = explain(gw, prompt)
    assert row(explained, 0)["healthy"] and row(explained, 0)["generation"] > generation
    assert events_metric(gw, "restarts") == restarts + 1
    assert send(sim, 0, prompt) == 0  # the engine indeed lost it


def test_what_a_restarted_engine_stored_while_held_down_is_kept_on_recovery(sim: Sim, gw: Gateway) -> None:
    """The engine restarted and served a request while this gateway still held it down (another gateway saw it up
    first): those frames are the new process's own, so recovery keeps them."""
    prompt = prompt_of("served-while-down")
    sim_fault(sim, 0, "restart", 2)
    sim_fault(sim, 0, "unhealthy", 2)
    try:
        wait_until(lambda: not row(explain(gw, prompt), 2)["healthy"])
        send(sim, 2, prompt)
        wait_until(lambda: gpu_tokens(gw, prompt, 2) > 0)
    finally:
        sim_fault(sim, 0, "healthy", 2)
    wait_until(lambda: row(explain(gw, prompt), 2)["healthy"])
    assert gpu_tokens(gw, prompt, 2) > 0
