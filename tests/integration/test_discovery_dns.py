"""DNS discovery against a real DNS server on loopback (dnslib) whose records the tests change.

End to end: `kvgate sim` replicas found through the SRV records of a headless-Service-like name, `kvgate serve` routing
the official openai client's requests the whole time; replicas join, leave and churn, and no request fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.router.fleet.discovery import Discovery
from kvgate.router.fleet.discovery.dns import DnsSource, ResolutionFailed
from kvgate.router.peers.warm_start import peer_urls
from kvgate.router.settings.schema import parse_config
from kvgate.router.upstream.client import EngineClient
from tests import support
from tests.fleets import fleet_of
from tests.loopback_dns import LoopbackDns
from tests.support import Gateway, Sim, admin_replicas, routable_replicas, start_kvgate, start_sim, wait_until_async
from tests.traffic import Traffic

pytestmark = pytest.mark.integration

ZONE = "engines.test"
INTERVAL_S = 0.5
SLACK_S = 2.0
"""Beyond one resolution interval: the first health probe, an admin poll, a loaded machine."""
ADMIN_TOKEN = "admin-s3cret"


@pytest.fixture
def dns() -> Iterator[LoopbackDns]:
    server = LoopbackDns().start()
    try:
        yield server
    finally:
        server.stop()


def host(i: int) -> str:
    return f"r{i}.{ZONE}"


def replica_name(sim: Sim, i: int) -> str:
    return f"{host(i)}:{sim.http_port + i}"


def publish(dns: LoopbackDns, sim: Sim, members: list[int]) -> None:
    """The records a headless Service with named ports has for these pods."""
    for i in range(sim.replicas):
        dns.set_a(host(i), ["127.0.0.1"])
    dns.set_srv(f"_kv-events._tcp.{ZONE}", [(host(i), sim.zmq_port + 2 * i) for i in members])
    dns.set_srv(f"_kv-replay._tcp.{ZONE}", [(host(i), sim.zmq_port + 2 * i + 1) for i in members])
    dns.set_srv(f"_http._tcp.{ZONE}", [(host(i), sim.http_port + i) for i in members])


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll until true; the time it first was."""
    support.wait_until(predicate, what, timeout)
    return time.monotonic()


def replicas(gw: Gateway) -> dict[str, dict[str, Any]]:
    return admin_replicas(gw, ADMIN_TOKEN)


def routable(gw: Gateway) -> set[str]:
    return routable_replicas(gw, ADMIN_TOKEN)


def gateway_config(sim: Sim, dns: LoopbackDns, path: Path) -> Path:
    config = yaml.safe_load(sim.config_path.read_text())
    config["replicas"] = []
    config["server"] = {**config.get("server", {}), "admin_token": ADMIN_TOKEN}
    config["health"] = {"interval_s": 0.2, "timeout_s": 0.5, "failures_to_down": 2, "successes_to_up": 1}
    config["policy"] = {**config.get("policy", {}), "name": "round_robin"}
    config["discovery"] = {
        "kind": "dns", "interval_s": INTERVAL_S, "drain_timeout_s": 10,
        "ports": {"http": "http", "kv_events": "kv-events", "kv_replay": "kv-replay"},
        "dns": {"name": ZONE, "record": "SRV", "nameservers": [dns.address], "timeout_s": 1.0},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_replicas_join_leave_and_churn_without_client_errors(tmp_path: Path, dns: LoopbackDns) -> None:
    sim = start_sim(tmp_path, 3)
    gw: Gateway | None = None
    try:
        r0, r1, r2 = (replica_name(sim, i) for i in range(3))
        publish(dns, sim, [0, 1])
        gw = start_kvgate(tmp_path, gateway_config(sim, dns, tmp_path / "kvgate.yaml"))
        wait_until(lambda: routable(gw) == {r0, r1}, 10, "the first two replicas routable")
        with Traffic(gw.url) as traffic:
            traffic.wait_for_answers(20, after=time.monotonic())

            joined_at = time.monotonic()
            publish(dns, sim, [0, 1, 2])
            routable_at = wait_until(lambda: r2 in routable(gw), INTERVAL_S + SLACK_S, "joined replica routable")
            wait_until(lambda: traffic.first_answer_from(r2, joined_at) is not None, SLACK_S, "joined replica answers")
            answered_at = traffic.first_answer_from(r2, joined_at)
            assert answered_at is not None

            left_at = time.monotonic()
            publish(dns, sim, [1, 2])
            drained_at = wait_until(lambda: r0 not in routable(gw), INTERVAL_S + SLACK_S, "left replica drained")
            removed_at = wait_until(lambda: r0 not in replicas(gw), SLACK_S, "drained replica removed")
            traffic.wait_for_answers(20, after=drained_at)
            last_on_r0 = traffic.last_start_on(r0)
            assert last_on_r0 is not None and last_on_r0 < drained_at  # nothing new reached it once drained

            for members in ([0, 2], [1], [0, 1, 2], [2], [0, 1], [1, 2], [0, 1]):  # faster than resolution
                publish(dns, sim, members)
                time.sleep(INTERVAL_S / 2)
            wait_until(lambda: set(replicas(gw)) == routable(gw) == {r0, r1}, INTERVAL_S + 3 * SLACK_S,
                       "the fleet settled on the last answer")
            settled_at = time.monotonic()
            traffic.wait_for_answers(30, after=settled_at)
            assert {o.replica for o in traffic.snapshot() if o.started > settled_at + 0.1} <= {r0, r1}

        assert traffic.errors() == [], traffic.errors()[:5]
        assert len(traffic.outcomes) > 100
        print(f"\nDNS discovery (interval {INTERVAL_S}s): join -> routable {routable_at - joined_at:.3f}s, "
              f"-> first answer {answered_at - joined_at:.3f}s; leave -> drained {drained_at - left_at:.3f}s, "
              f"-> removed {removed_at - left_at:.3f}s; {len(traffic.outcomes)} requests, 0 errors")
    finally:
        if gw is not None:
            gw.stop()
        sim.stop()


def discovery_config(dns: LoopbackDns, name: str = ZONE) -> Any:
    return parse_config(f"discovery: {{kind: dns, dns: {{name: {name}, nameservers: ['{dns.address}'], "
                        "timeout_s: 0.5}, ports: {http: 8000, kv_events: 5557, kv_replay: null}}").discovery


async def test_a_records_are_one_replica_per_address(dns: LoopbackDns) -> None:
    dns.set_a(ZONE, ["127.0.0.3", "127.0.0.2"])
    targets = await DnsSource(discovery_config(dns)).resolve()
    assert sorted(targets) == ["127.0.0.2:8000", "127.0.0.3:8000"]
    replica = targets["127.0.0.2:8000"].config
    assert (replica.url, replica.kv_events, replica.kv_replay) == ("http://127.0.0.2:8000", "tcp://127.0.0.2:5557", None)
    dns.set_a(ZONE, ["127.0.0.3"])
    assert sorted(await DnsSource(discovery_config(dns)).resolve()) == ["127.0.0.3:8000"]


async def test_a_name_without_records_is_an_empty_fleet(dns: LoopbackDns) -> None:
    assert await DnsSource(discovery_config(dns, "missing.test")).resolve() == {}
    dns.set_srv(ZONE, [])  # the name exists, with no A records
    assert await DnsSource(discovery_config(dns)).resolve() == {}


async def test_a_failing_dns_server_publishes_nothing(dns: LoopbackDns) -> None:
    dns.set_a(ZONE, ["127.0.0.2"])
    dns.failing = True
    with pytest.raises(ResolutionFailed):
        await DnsSource(discovery_config(dns)).resolve()


async def test_a_reload_restarts_discovery_and_turning_it_off_drains_what_it_found(dns: LoopbackDns) -> None:
    dns.set_a(ZONE, ["127.0.0.2"])
    dns.set_a("other.test", ["127.0.0.3"])
    text = f"discovery: {{kind: dns, interval_s: 0.1, drain_timeout_s: 0, dns: {{name: NAME, nameservers: ['{dns.address}']}}}}"
    config = parse_config(text.replace("NAME", ZONE))
    async with EngineClient(8) as session:
        fleet = fleet_of(config, session)
        discovery = Discovery(config.discovery, config.replicas, fleet)
        await discovery.start()
        try:
            await wait_until_async(lambda: set(fleet.replicas) == {"127.0.0.2:8000"})
            other = parse_config(text.replace("NAME", "other.test"))
            discovery.reconfigure(other.discovery, other.replicas)
            await wait_until_async(lambda: set(fleet.replicas) == {"127.0.0.3:8000"})
            none = parse_config("discovery: {kind: none}")
            discovery.reconfigure(none.discovery, none.replicas)
            await wait_until_async(lambda: not fleet.replicas)
        finally:
            await discovery.stop()


async def test_peers_are_found_through_the_gateways_headless_service(dns: LoopbackDns) -> None:
    """``peers.dns``: every address of the gateways' own name is a peer, next to the configured URLs."""
    dns.set_a("gateways.test", ["127.0.0.4", "127.0.0.5"])
    config = parse_config(f"peers: {{urls: ['http://10.0.0.9:8000'], dns: {{name: gateways.test, nameservers: "
                          f"['{dns.address}'], timeout_s: 0.5}}, port: 8100}}").peers
    assert sorted(await peer_urls(config)) == ["http://10.0.0.9:8000", "http://127.0.0.4:8100",
                                               "http://127.0.0.5:8100"]
    dns.failing = True  # a failed resolution adds none
    assert await peer_urls(config) == ["http://10.0.0.9:8000"]
