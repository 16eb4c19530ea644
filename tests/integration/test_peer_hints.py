"""Routing hints between gateways, end to end: two `kvgate serve` processes exchange their predictions over real ZMQ
in front of a `kvgate sim` fleet whose KV events are all dropped (so a prediction is never confirmed, only expires).

A prompt routed by A is credited as predicted by B, until the time-to-live runs out; a hint that is malformed, too
old or names an unknown replica is dropped; B keeps serving when A is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import zmq

from kvgate.cache_index.index import PrefixIndex
from kvgate.cache_index.keys import block_keys, namespace_key
from kvgate.cache_index.snapshot import pack_keys
from kvgate.loadgen.bench import free_port_block
from kvgate.router.fleet.state import DispatchedWork
from kvgate.router.peers import hints as hints_module
from kvgate.router.peers.config import PeersConfig
from kvgate.router.peers.hints import HINT_FORMAT, Hint, HintExchange, curve_keys
from tests.integration.test_gateway import MODEL, gateway_config, metric_value, wait_until
from tests.loopback_dns import LoopbackDns
from tests.support import Gateway, Sim, start_kvgate, start_sim

pytestmark = pytest.mark.integration

TTL_S = 3.0
WORK_TTL_S = 1.0
BLOCK = 16
PEER_TOKEN = "peer-s3cret-for-hints"


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port_block(1)}"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("peer-hints")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 2, "--time-scale", "0", "--block-size", str(BLOCK))
    try:
        for i in range(s.replicas):  # no event ever confirms a prediction here
            httpx.post(s.url(0) + "/sim/fault", json={"action": "drop_events", "fraction": 1.0, "replica": i},
                       timeout=5).raise_for_status()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def gateways(sim: Sim, workdir: Path) -> Iterator[tuple[Gateway, Gateway, str, str]]:
    """A and B publishing to each other, and B also subscribed to the test's own publisher (the third endpoint);
    the fourth is B's publisher."""
    a_hints, b_hints, test_hints = endpoint(), endpoint(), endpoint()
    index = {"predicted_ttl_s": TTL_S}
    hints = {"work_ttl_s": WORK_TTL_S}
    server = {"peer_token": PEER_TOKEN}
    a = start_kvgate(workdir, gateway_config(sim, workdir, "a.yaml", index=index, server=server,
                                             peers={"hints": {**hints, "bind": a_hints, "connect": [b_hints]}}))
    try:
        b = start_kvgate(workdir, gateway_config(sim, workdir, "b.yaml", index=index, server=server,
                                                 peers={"hints": {**hints, "bind": b_hints,
                                                                  "connect": [a_hints, test_hints]}}))
    except BaseException:
        a.stop()
        raise
    try:
        for gw in (a, b):
            wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, timeout=30)
        yield a, b, test_hints, b_hints
    finally:
        b.stop()
        a.stop()


def predicted(gw: Gateway, prompt: list[int]) -> dict[str, int]:
    r = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": prompt}, timeout=5)
    r.raise_for_status()
    return {row["name"]: row["cached_tokens"]["predicted"] for row in r.json()["replicas"]}


def tokens(label: int) -> list[int]:
    """A prompt of 3 blocks and a token, drawn from the label: no two labels' prompts share a first block."""
    return random.Random(label).sample(range(1000, 8000), 3 * BLOCK + 1)


count = itertools.count(110).__next__
"""Labels of prompts no other test uses."""


def routed_and_shared(a: Gateway, b: Gateway, label: int, within_s: float = 1.0) -> tuple[str, list[int]] | None:
    """Route a new prompt through A; the replica it went to and the prompt if B predicts it there within
    ``within_s`` (the first hints may go out before B's SUB joined), else None."""
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    prompt = tokens(label)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=1)
    replica = raw.headers["x-kvgate-replica"]
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicted(b, prompt)[replica] == 3 * BLOCK:
            return replica, prompt
        time.sleep(0.05)
    return None


def test_a_prompt_routed_by_one_gateway_is_predicted_by_the_other_until_its_ttl(
    gateways: tuple[Gateway, Gateway, str, str]
) -> None:
    a, b, *_ = gateways
    replica, prompt = wait_until(lambda: routed_and_shared(a, b, count()), timeout=30)
    shared_at = time.monotonic()
    assert sum(predicted(b, prompt).values()) == 3 * BLOCK  # on that replica only
    wait_until(lambda: predicted(b, prompt)[replica] == 0, timeout=TTL_S + 10)
    assert time.monotonic() - shared_at > TTL_S / 2  # it was credited for a while, then forgotten


def _ignore_errors(call: Callable[[], object]) -> None:
    try:
        call()
    except openai.OpenAIError:  # the gateway it went through was stopped
        pass


def publisher(endpoint: str, token: str) -> zmq.Socket:
    """A hint publisher on ``endpoint`` holding the CURVE keys ``token`` derives (once the endpoint's previous
    publisher, closed in ZMQ's background thread, has let it go)."""
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.curve_server = True
    pub.curve_secretkey = curve_keys(token)[1]

    def bound() -> bool:
        try:
            pub.bind(endpoint)
        except zmq.ZMQError:
            return False
        return True

    wait_until(bound, timeout=10)
    return pub


def hint(prompt: list[int], replica: str = "sim-0", age_s: float = 0.0) -> bytes:
    keys = block_keys(namespace_key(MODEL), prompt, BLOCK)
    return msgspec.msgpack.encode(Hint(time.time() - age_s, "test-publisher", replica, pack_keys(keys)))


def test_bad_or_stale_hints_are_dropped(gateways: tuple[Gateway, Gateway, str, str]) -> None:
    _, b, test_hints, _ = gateways
    pub = publisher(test_hints, PEER_TOKEN)
    try:

        probe = tokens(100)
        wait_until(lambda: pub.send(hint(probe)) is None and predicted(b, probe)["sim-0"] > 0, timeout=30)
        dropped = metric_value(b, "kvgate_peer_hints_dropped_total")
        stale, unknown, fresh = tokens(101), tokens(102), tokens(103)
        truncated_keys = msgspec.msgpack.encode([HINT_FORMAT, time.time(), "x", "sim-0", b"\x00" * 7])
        for message in (b"\xc1garbage", truncated_keys,
                        hint(stale, age_s=TTL_S + 1), hint(unknown, replica="no-such-replica"), hint(fresh)):
            pub.send(message)
        wait_until(lambda: predicted(b, fresh)["sim-0"] > 0)
        assert predicted(b, stale)["sim-0"] == 0
        assert all(v == 0 for v in predicted(b, unknown).values())
        wait_until(lambda: metric_value(b, "kvgate_peer_hints_dropped_total") >= dropped + 4)
    finally:
        pub.close(0)


def prefilling(gw: Gateway) -> dict[str, tuple[int, int]]:
    """Per replica, the gateway's own requests in flight and the prefill tokens it counts there (its own and its
    peers')."""
    r = httpx.post(gw.url + "/kvgate/v1/explain", json={"model": MODEL, "prompt": tokens(145)}, timeout=5)
    r.raise_for_status()
    return {row["name"]: (row["in_flight"], row["in_flight_prefill_tokens"]) for row in r.json()["replicas"]}


def test_a_gateway_serves_on_when_its_peer_is_gone(sim: Sim, gateways: tuple[Gateway, Gateway, str, str]) -> None:
    """A's requests stuck prefilling on stalled engines count in B's queue estimates while A reports them; when A
    is gone its share expires within ``work_ttl_s``, and B goes on serving."""
    a, b, *_ = gateways
    for i in range(sim.replicas):
        httpx.post(sim.url(0) + "/sim/fault", json={"action": "stall", "seconds": 60, "replica": i},
                   timeout=5).raise_for_status()
    client_a = openai.OpenAI(base_url=a.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stuck = [threading.Thread(target=lambda label=label: _ignore_errors(
        lambda: client_a.completions.create(model=MODEL, prompt=tokens(label), max_tokens=1)), daemon=True)
        for label in range(60, 63)]
    try:
        for thread in stuck:
            thread.start()
        shared = wait_until(lambda: [n for n, (own, tokens_) in prefilling(b).items() if own == 0 and tokens_ > 0],
                            timeout=30)
        assert shared  # B has no request of its own there: the prefill tokens are A's, as A reported them
        a.stop()
        gone_at = time.monotonic()
        wait_until(lambda: all(tokens_ == 0 for _, tokens_ in prefilling(b).values()), timeout=WORK_TTL_S + 10)
        assert time.monotonic() - gone_at < WORK_TTL_S + 5
    finally:
        for i in range(sim.replicas):
            httpx.post(sim.url(0) + "/sim/fault", json={"action": "unstall", "replica": i}, timeout=5)
        for thread in stuck:
            thread.join(timeout=30)
    client = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    for label in range(50, 55):
        completion = client.completions.create(model=MODEL, prompt=tokens(label), max_tokens=1)
        assert completion.usage is not None


def test_without_the_peer_token_hints_can_be_neither_injected_nor_read(
    gateways: tuple[Gateway, Gateway, str, str]
) -> None:
    _, b, test_hints, b_hints = gateways
    outsider = publisher(test_hints, "not-the-peer-token")
    try:
        forged = tokens(40)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # long enough for B's subscription to try the handshake many times
            outsider.send(hint(forged))
            assert predicted(b, forged)["sim-0"] == 0
            time.sleep(0.05)
    finally:
        outsider.close(0)
    insider = publisher(test_hints, PEER_TOKEN)  # the same endpoint with the token's keys is heard: B was listening
    try:
        heard = tokens(41)
        wait_until(lambda: insider.send(hint(heard)) is None and predicted(b, heard)["sim-0"] > 0, timeout=30)
    finally:
        insider.close(0)

    context = zmq.Context.instance()
    plain = context.socket(zmq.SUB)  # no CURVE at all
    keyed = context.socket(zmq.SUB)  # CURVE, with the keys of another token
    public, secret = curve_keys("not-the-peer-token")
    keyed.curve_serverkey = curve_keys(PEER_TOKEN)[0]
    keyed.curve_publickey, keyed.curve_secretkey = public, secret
    for sub in (plain, keyed):
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(b_hints)
    client = openai.OpenAI(base_url=b.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    try:
        for label in range(30, 40):  # B publishes a hint for each
            client.completions.create(model=MODEL, prompt=tokens(label), max_tokens=1)
        wait_until(lambda: metric_value(b, "kvgate_peer_hints_published_total") >= 10, timeout=30)
        assert plain.poll(500) == 0 and keyed.poll(500) == 0
    finally:
        plain.close(0)
        keyed.close(0)


def test_hint_peers_are_the_addresses_dns_lists_as_they_change(sim: Sim, workdir: Path) -> None:
    """``peers.hints.port`` with ``peers.dns``: each gateway subscribes to every gateway the name's SRV records list
    (itself included, whose own messages it ignores), and stops hearing one that left within a resolution
    interval."""
    dns = LoopbackDns().start()
    zone = "gateways.test"
    members = {"gw-a": free_port_block(1), "gw-b": free_port_block(1)}

    def publish(names: list[str]) -> None:
        for name in members:
            dns.set_a(f"{name}.{zone}", ["127.0.0.1"])
        dns.set_srv(f"_http._tcp.{zone}", [(f"{name}.{zone}", 8000) for name in names])
        dns.set_srv(f"_hints._tcp.{zone}", [(f"{name}.{zone}", members[name]) for name in names])

    def config(name: str) -> Path:
        peers = {"dns": {"name": zone, "record": "SRV", "nameservers": [dns.address], "timeout_s": 0.5},
                 "port": "http", "warm_start_timeout_s": 0,
                 "hints": {"bind": f"tcp://127.0.0.1:{members[name]}", "port": "hints", "resolve_interval_s": 0.3}}
        return gateway_config(sim, workdir, f"{name}.yaml", index={"predicted_ttl_s": TTL_S},
                              server={"peer_token": PEER_TOKEN}, peers=peers)

    publish(["gw-a", "gw-b"])
    started: list[Gateway] = []
    try:
        for name in members:
            started.append(start_kvgate(workdir, config(name)))
        a, b = started
        for gw in started:
            wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, timeout=30)
        wait_until(lambda: routed_and_shared(a, b, count()), timeout=30)
        wait_until(lambda: routed_and_shared(b, a, count()), timeout=30)
        assert metric_value(a, "kvgate_peer_hints_dropped_total") == 0  # its own hints come back, ignored
        publish(["gw-b"])  # A leaves the Service
        left_at = time.monotonic()
        wait_until(lambda: routed_and_shared(a, b, count(), within_s=0.5) is None, timeout=10)
        assert time.monotonic() - left_at < 10
        assert all(routed_and_shared(a, b, count(), within_s=0.5) is None for _ in range(3))
        publish(["gw-a", "gw-b"])  # and comes back
        wait_until(lambda: routed_and_shared(a, b, count()), timeout=30)
    finally:
        for gw in started:
            gw.stop()
        dns.stop()


def test_a_reload_rebinds_the_hint_exchange(sim: Sim, workdir: Path) -> None:
    """A gateway started without peers takes its peer's hints once a reload names the peer's endpoint, and stops
    when a reload removes it; its own publisher moves to a new ``bind`` the same way."""
    a_hints, c_hints, c_moved = endpoint(), endpoint(), endpoint()
    server = {"peer_token": PEER_TOKEN, "admin_token": "admin-for-reload"}
    index = {"predicted_ttl_s": TTL_S}
    headers = {"authorization": "Bearer admin-for-reload"}
    a_path = gateway_config(sim, workdir, "reload-a.yaml", index=index, server=server,
                            peers={"hints": {"bind": a_hints, "connect": [c_hints]}})
    c_path = gateway_config(sim, workdir, "reload-c.yaml", index=index, server=server)
    a = start_kvgate(workdir, a_path)
    try:
        c = start_kvgate(workdir, c_path)
    except BaseException:
        a.stop()
        raise

    def reload_c(hints: dict[str, object]) -> None:
        gateway_config(sim, workdir, "reload-c.yaml", index=index, server=server, peers={"hints": hints})
        httpx.post(c.url + "/admin/reload", headers=headers, timeout=10).raise_for_status()

    try:
        for gw in (a, c):
            wait_until(lambda: httpx.get(gw.url + "/ready", timeout=5).status_code == 200, timeout=30)
        assert routed_and_shared(a, c, count(), within_s=0.5) is None
        reload_c({"bind": c_hints, "connect": [a_hints]})
        wait_until(lambda: routed_and_shared(a, c, count()), timeout=30)
        wait_until(lambda: routed_and_shared(c, a, count()), timeout=30)  # A hears C's new publisher
        reload_c({"bind": c_moved, "connect": []})
        wait_until(lambda: routed_and_shared(a, c, count(), within_s=0.5) is None, timeout=10)
        assert routed_and_shared(c, a, count(), within_s=0.5) is None  # C publishes where A does not listen
        reload_c({"bind": c_hints, "connect": [a_hints]})  # the endpoint it let go is bound again
        wait_until(lambda: routed_and_shared(c, a, count()), timeout=30)
        assert metric_value(c, "kvgate_peer_hints_published_total") > 0
    finally:
        c.stop()
        a.stop()


def linked_exchanges(own_work: Callable[[], dict[str, DispatchedWork]] = dict) -> tuple[HintExchange, HintExchange]:
    """A publishing and a subscribing exchange in this process, over real ZMQ (not started)."""
    bound = endpoint()

    def peers(**hints: object) -> PeersConfig:
        return PeersConfig.model_validate({"hints": hints})

    sender = HintExchange(peers(bind=bound), PrefixIndex(1000, TTL_S), lambda name: True, PEER_TOKEN, "sender",
                          own_work=own_work)
    receiver = HintExchange(peers(connect=[bound]), PrefixIndex(1000, TTL_S), lambda name: True, PEER_TOKEN,
                            "receiver")
    return sender, receiver


async def test_a_dispatch_reports_the_work_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The periodic tick set to an hour: a dispatch (``publish``) still gets the sender's prefill work to its peer,
    so two gateways do not both place a long prompt on the replica they each see idle."""
    monkeypatch.setattr(hints_module, "WORK_INTERVAL_S", 3600.0)
    work: dict[str, DispatchedWork] = {}
    sender, receiver = linked_exchanges(lambda: dict(work))
    sender.start()
    receiver.start()
    try:
        deadline = time.monotonic() + 10
        work["sim-0"] = DispatchedWork(4096, 1, 2.5)
        while receiver.work.work("sim-0") != (4096, 1, 2.5):  # the first reports may go out before the SUB joined
            assert time.monotonic() < deadline, "no work report without the tick"
            sender.publish("sim-0", [1, 2, 3])
            await asyncio.sleep(0.05)
    finally:
        await sender.stop()
        await receiver.stop()


async def test_a_started_warmup_reaches_the_peers_replication() -> None:
    sender, receiver = linked_exchanges()
    heard: list[tuple[int, str]] = []
    receiver.on_peer_warming = lambda key, target: heard.append((key, target))
    sender.start()
    receiver.start()
    try:
        deadline = time.monotonic() + 10
        while not heard:  # the first messages may go out before the SUB joined
            assert time.monotonic() < deadline, "the warm-up never reached the peer"
            sender.publish_warming(2277145186080612870, "sim-3")
            await asyncio.sleep(0.05)
        assert heard[0] == (2277145186080612870, "sim-3")
    finally:
        await sender.stop()
        await receiver.stop()
