"""Who may reach what, end to end: a `kvgate sim` fleet behind one gateway with tenants and every token configured
and one with nothing configured (the defaults), probed the way an attacker would, from loopback.

- Writes need credentials: the HTTP KV-event ingest is off unless configured, then takes its own token only.
- Explain, models, ready and metrics show a caller only what it may see.
- No cache on the request path lets tenant B tell which texts tenant A sent: B's timings on A's texts and on fresh
  texts are compared, interleaved, against the spread of fresh against fresh.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest
import yaml

from kvgate.loadgen.sim.wire import BlockStored, KVEventBatch
from kvgate.loadgen.workloads.vocabulary import vocabulary_for
from tests.support import REPO, Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MODEL = "kvgate-sim"
ADMIN = {"authorization": "Bearer admin-token-for-tests"}
EVENTS = {"authorization": "Bearer events-token-for-tests"}
METRICS = {"authorization": "Bearer metrics-token-for-tests"}
ALICE = {"authorization": "Bearer sk-alice"}
BOB = {"authorization": "Bearer sk-bob"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("security")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 2, "--time-scale", "0.01")
    yield s
    s.stop()


def gateway(sim: Sim, workdir: Path, name: str, **sections: Any) -> Iterator[Gateway]:
    config = yaml.safe_load(sim.config_path.read_text())
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    config.update(sections)
    path = workdir / name
    path.write_text(yaml.safe_dump(config))
    g = start_kvgate(workdir, path)
    try:
        wait_until(lambda: httpx.get(g.url + "/ready", timeout=5).status_code == 200)
        yield g
    finally:
        g.stop()


@pytest.fixture(scope="module")
def secured(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    yield from gateway(
        sim, workdir, "secured.yaml",
        server={"admin_token": "admin-token-for-tests", "events_token": "events-token-for-tests",
                "metrics_token": "metrics-token-for-tests"},
        tenants={"api_keys": {"sk-alice": "alice", "sk-bob": "bob"}, "salt_secret": "security-test-salt-secret"},
        policy={"name": "cost", "cost": {"session_bonus_ms": 1000}},
    )


@pytest.fixture(scope="module")
def defaults(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    yield from gateway(sim, workdir, "defaults.yaml")


def explain(gw: Gateway, prompt: str | list[int], headers: dict[str, str], **extra: str) -> httpx.Response:
    return httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt},
                      headers={**headers, **extra}, timeout=30)


def stored(token_ids: list[int], hashes: list[int]) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(time.time(), [BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=token_ids, block_size=16, lora_id=None, medium="GPU",
        lora_name=None,
    )], 0))


def post_events(gw: Gateway, body: bytes, seq: int, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(gw.url + "/kvgate/v1/events", content=body, timeout=5, headers={
        "content-type": "application/msgpack", "x-kvgate-replica": "sim-0", "x-kvgate-seq": str(seq), **headers})


# writes


def test_event_ingest_is_off_unless_configured(defaults: Gateway) -> None:
    """The probe: one unauthenticated JSON frame with a far-ahead sequence number purged a replica's holdings."""
    forged = {"replica": "sim-0", "seq": 2_000_000_000, "batch": [0, [], 0]}
    r = httpx.post(defaults.url + "/kvgate/v1/events", json=forged, timeout=5)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = post_events(defaults, stored(list(range(32)), [1, 2]), 0, {})
    assert r.status_code == 404


def test_event_ingest_takes_its_own_token_and_nothing_else(secured: Gateway) -> None:
    tokens = list(range(5000, 5032))
    body = stored(tokens, [501, 502])
    for headers, status in (({}, 401), (ALICE, 403), (ADMIN, 403), (METRICS, 403)):
        r = post_events(secured, body, 0, headers)
        assert r.status_code == status, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert all(row["cached_tokens"]["gpu"] == 0 for row in explain(secured, tokens + [7], ADMIN).json()["replicas"])
    r = post_events(secured, body, 0, EVENTS)
    assert r.status_code == 200 and r.json()["status"] == "applied"
    held = {row["name"]: row["cached_tokens"]["gpu"] for row in explain(secured, tokens + [7], ADMIN).json()["replicas"]}
    assert held["sim-0"] == 32


def test_admin_endpoints_all_need_the_admin_token(secured: Gateway) -> None:
    calls = [
        ("GET", "/admin/replicas"), ("POST", "/admin/replicas"), ("POST", "/admin/replicas/sim-0/drain"),
        ("DELETE", "/admin/replicas/sim-1"), ("POST", "/admin/reload"),
    ]
    for method, path in calls:
        for headers, status in (({}, 401), (ALICE, 403), (EVENTS, 403), (METRICS, 403)):
            r = httpx.request(method, secured.url + path, headers=headers, json={}, timeout=5)
            assert r.status_code == status, (method, path, headers, r.text)
    names = {r["name"]: r for r in httpx.get(secured.url + "/admin/replicas", headers=ADMIN, timeout=5).json()["data"]}
    assert set(names) == {"sim-0", "sim-1"} and not any(r["draining"] for r in names.values())


# reads


def test_explain_needs_a_key_and_shows_a_tenant_only_its_own_namespace(secured: Gateway) -> None:
    """The probe: explain answered anyone, with per-replica cached tokens for any prompt (a cache-probing oracle)."""
    assert explain(secured, "who holds this?", {}).status_code == 401
    assert explain(secured, "who holds this?", METRICS).status_code == 401
    prompt = "alice's private document, sentence after sentence. " * 20
    alice = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-alice", max_retries=0, timeout=30)
    served = alice.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    replica = served.headers["x-kvgate-replica"]

    def held(headers: dict[str, str], **extra: str) -> int:
        rows = explain(secured, prompt, headers, **extra).json()["replicas"]
        return next(r for r in rows if r["name"] == replica)["cached_tokens"]["gpu"]

    wait_until(lambda: held(ALICE) > 0)
    assert held(BOB) == 0
    assert held(ADMIN) == 0  # the admin's own namespace: requests without a tenant
    assert held(ADMIN, **{"x-kvgate-tenant": "alice"}) > 0
    assert held(BOB, **{"x-kvgate-tenant": "alice"}) == 0  # the header means nothing without the admin token
    as_tenant = explain(secured, prompt, ALICE).json()
    assert "route_ms" not in as_tenant and "cost_model" not in as_tenant  # nothing fitted on other tenants
    assert "route_ms" in explain(secured, prompt, ADMIN).json()


def test_models_ready_and_metrics_show_only_what_the_caller_may_see(secured: Gateway) -> None:
    assert httpx.get(secured.url + "/health", timeout=5).status_code == 200
    assert httpx.get(secured.url + "/v1/models", timeout=5).status_code == 401
    for headers in (ALICE, ADMIN):
        r = httpx.get(secured.url + "/v1/models", headers=headers, timeout=5)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [MODEL]
    assert httpx.get(secured.url + "/ready", timeout=5).json() == {"status": "ready"}
    for headers in (ALICE, ADMIN):
        assert httpx.get(secured.url + "/ready", headers=headers, timeout=5).json()["routable"] == ["sim-0", "sim-1"]
    for headers, status in (({}, 401), (ALICE, 403), (EVENTS, 403), (METRICS, 200), (ADMIN, 200)):
        r = httpx.get(secured.url + "/metrics", headers=headers, timeout=5)
        assert r.status_code == status, headers
    assert "kvgate_requests_total" in r.text


def test_defaults_leave_the_single_tenant_read_endpoints_open(defaults: Gateway) -> None:
    assert httpx.get(defaults.url + "/metrics", timeout=5).status_code == 200
    assert httpx.get(defaults.url + "/v1/models", timeout=5).status_code == 200
    assert httpx.get(defaults.url + "/ready", timeout=5).json()["routable"] == ["sim-0", "sim-1"]
    r = explain(defaults, "an open question", {})
    assert r.status_code == 200 and "route_ms" in r.json()
    assert httpx.get(defaults.url + "/admin/replicas", headers=ADMIN, timeout=5).status_code == 404


def test_a_tenant_cannot_use_another_tenants_session(secured: Gateway) -> None:
    """A session id is a tenant's own: another tenant sending the same id neither gets its replica hint (which says
    where that session's cache is) nor overwrites it. The secured gateway's session bonus (1 s) outweighs anything."""
    alice = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-alice", max_retries=0, timeout=30)
    bob = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-bob", max_retries=0, timeout=30)
    prompt = "bob's own warm document, line after line. " * 20
    bobs = bob.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1).headers["x-kvgate-replica"]

    def bob_warm_on() -> str | None:
        rows = explain(secured, prompt, BOB).json()["replicas"]
        return next((r["name"] for r in rows if r["cached_tokens"]["gpu"] > 0), None)

    assert wait_until(bob_warm_on) == bobs
    for n in range(20):  # a session of alice's on the other replica
        session = {"x-session-id": f"alice-session-{n}"}
        served = alice.completions.with_raw_response.create(
            model=MODEL, prompt=f"turn one of {n}", max_tokens=1, extra_headers=session).headers["x-kvgate-replica"]
        if served != bobs:
            break
    else:
        raise AssertionError(f"alice was always served by {bobs}")
    assert explain(secured, "turn two", ALICE, **session).json()["decision"]["replica"] == served
    decision = explain(secured, prompt, BOB, **session).json()["decision"]
    assert (decision["replica"], decision["reason"]) == (bobs, "warm")
    r = bob.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1, extra_headers=session)
    assert r.headers["x-kvgate-replica"] == bobs
    assert explain(secured, "turn two", ALICE, **session).json()["decision"]["replica"] == served


# the timing side channel


def texts(rng: random.Random, count: int, tokens: int = 16_000) -> list[str]:
    """``count`` texts of ``tokens`` whole-word tokens of the shipped tokenizer (~120k characters), unique to this run.
    Every text draws on the same words, so the tokenizer library's own per-word cache treats them all alike and only
    caches of longer pieces of text can make a difference."""
    vocabulary = vocabulary_for(REPO / "loadgen" / "assets" / "tokenizer")
    return [vocabulary.render(vocabulary.sample(rng, tokens)) for _ in range(count)]


def timed(send: Callable[[], float | None]) -> float:
    """Milliseconds until ``send`` returned, or the time it measured itself."""
    started = time.perf_counter()
    measured = send()
    return measured if measured is not None else (time.perf_counter() - started) * 1000.0


def faster_than_noise(triples: list[tuple[float, float, float]]) -> tuple[bool, str]:
    """Are texts another tenant sent faster than fresh ones, beyond noise? Each triple (seen, fresh, fresh again) was
    measured back to back in random order, so comparing within a triple cancels the machine's slower swings in load.

    The gap is the median over triples of mean(fresh, fresh again) - seen. Its tolerance comes from the fresh-vs-fresh
    differences: their spread (1.4826 x MAD) scaled to the gap's (x sqrt(3/4)), the standard error of a median
    (x 1.2533 / sqrt(n)), three of those, plus 1 ms. Under no leak, a false alarm has a chance of about 0.1%."""
    gaps = [(fresh + again) / 2 - seen for seen, fresh, again in triples]
    nulls = [fresh - again for _, fresh, again in triples]
    centre = statistics.median(nulls)
    sigma = 1.4826 * statistics.median(abs(x - centre) for x in nulls) * 0.75 ** 0.5
    tolerance = 3.0 * 1.2533 * sigma / len(triples) ** 0.5 + 1.0
    gap = statistics.median(gaps)
    seen, fresh, again = (statistics.median(t[k] for t in triples) for k in range(3))
    summary = f"seen {seen:.1f} ms, fresh {fresh:.1f} / {again:.1f} ms, gap {gap:.1f} ms, tolerance {tolerance:.1f} ms"
    return gap > tolerance, summary


def measure_triples(
    rng: random.Random, seen_texts: list[str], fresh: Iterator[str], probe: Callable[[str], float | None]
) -> list[tuple[float, float, float]]:
    triples = []
    for seen in seen_texts:
        kinds = [(0, seen), (1, next(fresh)), (2, next(fresh))]
        rng.shuffle(kinds)
        times = [0.0, 0.0, 0.0]
        for k, text in kinds:
            times[k] = timed(lambda: probe(text))
        triples.append((times[0], times[1], times[2]))
    return triples


def test_another_tenants_texts_are_no_faster_than_fresh_ones(secured: Gateway) -> None:
    """The probe: the tokenizer's piece cache was shared by all tenants; on a text tenant A had sent, tenant B saw
    explain's route_ms of ~2 ms against ~18 on fresh text. B now measures, interleaved, its explain latency and its
    streaming TTFT on A's texts and on fresh ones; A's must not be faster beyond the fresh-vs-fresh noise."""
    rng = random.Random(time.time_ns())
    samples = 12
    sent, fresh = texts(rng, 2 * samples), iter(texts(rng, 4 * samples))
    alice = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-alice", max_retries=0, timeout=60)
    bob = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-bob", max_retries=0, timeout=60)
    for text in sent:
        alice.completions.create(model=MODEL, prompt=text, max_tokens=1)

    def ttft_ms(text: str) -> float:
        started = time.perf_counter()
        stream = bob.completions.create(model=MODEL, prompt=text, max_tokens=2, stream=True)
        try:
            next(iter(stream))
            return (time.perf_counter() - started) * 1000.0
        finally:
            stream.close()

    with httpx.Client(base_url=secured.url, headers=BOB, timeout=60) as http:

        def explain_ms(text: str) -> None:
            assert http.post("/kvgate/v1/explain", json={"model": MODEL, "prompt": text}).status_code == 200

        explained = measure_triples(rng, sent[:samples], fresh, explain_ms)
    first_tokens = measure_triples(rng, sent[samples:], fresh, ttft_ms)
    for measure, triples in (("explain", explained), ("ttft", first_tokens)):
        leaks, summary = faster_than_noise(triples)
        assert not leaks, f"{measure}: {summary}"


def test_route_ms_in_a_tenants_namespace_does_not_depend_on_another_tenants_texts(secured: Gateway) -> None:
    """The same comparison on the gateway's own clock: ``route_ms`` of explain in bob's namespace (asked by the
    admin, as bob), on texts alice sent and on fresh ones; alice's own texts, a second time, show the test can tell."""
    rng = random.Random(time.time_ns())
    samples = 12
    sent, fresh = texts(rng, samples), iter(texts(rng, 2 * samples))
    alice = openai.OpenAI(base_url=secured.url + "/v1", api_key="sk-alice", max_retries=0, timeout=60)
    for text in sent:
        alice.completions.create(model=MODEL, prompt=text, max_tokens=1)
    with httpx.Client(base_url=secured.url, headers=ADMIN, timeout=60) as http:

        def route_ms(text: str, tenant: str) -> float:
            r = http.post("/kvgate/v1/explain", json={"model": MODEL, "prompt": text},
                          headers={"x-kvgate-tenant": tenant})
            assert r.status_code == 200, r.text
            return float(r.json()["route_ms"])

        triples = measure_triples(rng, sent, fresh, lambda text: route_ms(text, "bob"))
        leaks, summary = faster_than_noise(triples)
        assert not leaks, f"route_ms: {summary}"
        own = [(route_ms(text, "alice"), fresh, again) for text, (_, fresh, again) in zip(sent, triples)]
        assert faster_than_noise(own)[0], faster_than_noise(own)[1]
