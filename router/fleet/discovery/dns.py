"""Engine replicas from DNS: the A or SRV records of a headless Service, re-resolved every ``interval_s``.

A headless Service's records list its ready endpoints, so every replica found is ready; one that is no longer listed
has left (or become unready) and is drained. An answer that the name has no records (NXDOMAIN, no answer) is an empty
fleet; a resolution that failed (timeout, server failure) publishes nothing, so the last good set stays in force.

Replicas are named ``host:port`` (the address with A records, the SRV target with SRV records). Engine addresses are
resolved here, once per interval, so a host name that moves to another address becomes a new replica.
"""

from __future__ import annotations

import asyncio
import logging

import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from kvgate.router.fleet.config import DiscoveryConfig, parse_nameserver
from kvgate.router.fleet.discovery.targets import Publish, Target, replica_config

log = logging.getLogger(__name__)

_EMPTY = (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer)
"""Answers that say the name has no such records now: the set is empty."""


class ResolutionFailed(Exception):
    """No trustworthy answer: keep what was known."""


class DnsSource:
    def __init__(self, config: DiscoveryConfig) -> None:
        self.config = config
        settings = config.dns
        self.resolver = dns.asyncresolver.Resolver(configure=not settings.nameservers)
        if settings.nameservers:
            self.resolver.nameservers = [_nameserver(ns) for ns in settings.nameservers]
        self.resolver.lifetime = settings.timeout_s
        self.resolver.timeout = settings.timeout_s
        self.name = settings.name.rstrip(".") + "."

    async def run(self, publish: Publish) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                targets = await self.resolve()
            except ResolutionFailed as e:
                log.warning("discovery: resolving %s failed, keeping the last answer: %s", self.name, e)
            else:
                await publish(targets)
            await asyncio.sleep(max(0.0, started + self.config.interval_s - loop.time()))

    async def resolve(self) -> dict[str, Target]:
        """The replicas the records list now. :class:`ResolutionFailed` when the DNS server gave no usable answer."""
        if self.config.dns.record == "A":
            return await self._from_a_records()
        return await self._from_srv_records()

    async def _from_a_records(self) -> dict[str, Target]:
        ports = self.config.ports
        assert isinstance(ports.http, int)
        kv_events = ports.kv_events if isinstance(ports.kv_events, int) else None
        kv_replay = ports.kv_replay if isinstance(ports.kv_replay, int) else None
        targets: dict[str, Target] = {}
        for address in await self._addresses(self.name):
            name = f"{address}:{ports.http}"
            targets[name] = Target(replica_config(
                self.config, name, address, ports.http, kv_events, kv_replay, bootstrap=self._bootstrap
            ))
        return targets

    async def _from_srv_records(self) -> dict[str, Target]:
        ports = self.config.ports
        assert isinstance(ports.http, str)
        http, kv_events, kv_replay = await asyncio.gather(
            self._srv(ports.http), self._named_ports(ports.kv_events), self._named_ports(ports.kv_replay)
        )
        hosts = sorted({host for host, _ in http})
        addresses_of = dict(zip(hosts, await asyncio.gather(*(self._addresses(host + ".") for host in hosts))))
        targets: dict[str, Target] = {}
        for host, http_port in sorted(http):
            addresses = addresses_of[host]
            if not addresses:
                continue  # the target has no address (yet): not reachable
            name = f"{host}:{http_port}"
            config = replica_config(
                self.config, name, addresses[0], http_port, kv_events.get(host), kv_replay.get(host),
                bootstrap=self._bootstrap,
            )
            targets[name] = Target(config)
        return targets

    @property
    def _bootstrap(self) -> int | None:
        """The bootstrap port of every replica found (a number: the config requires one for sglang prefill)."""
        port = self.config.ports.bootstrap
        return port if isinstance(port, int) else None

    async def _named_ports(self, port: int | str | None) -> _PortsByHost:
        """A fixed number for every host, or each host's port from the ``_NAME._tcp`` SRV records."""
        if port is None:
            return _PortsByHost(None)
        if isinstance(port, int):
            return _PortsByHost(port)
        return _PortsByHost(None, {host: p for host, p in await self._srv(port)})

    async def _srv(self, service: str) -> list[tuple[str, int]]:
        answer = await self._query(f"_{service}._tcp.{self.name}", "SRV")
        return [(record.target.to_text(omit_final_dot=True), int(record.port)) for record in answer]

    async def _addresses(self, host: str) -> list[str]:
        return sorted({record.address for record in await self._query(host, "A")})

    async def _query(self, qname: str, rdtype: str) -> list:
        try:
            answer = await self.resolver.resolve(qname, rdtype, search=False)
        except _EMPTY:
            return []
        except dns.exception.DNSException as e:
            raise ResolutionFailed(f"{qname} {rdtype}: {e}") from e
        return list(answer)


class _PortsByHost:
    def __init__(self, fixed: int | None, by_host: dict[str, int] | None = None) -> None:
        self.fixed = fixed
        self.by_host = by_host or {}

    def get(self, host: str) -> int | None:
        return self.by_host.get(host, self.fixed)


def _nameserver(spec: str) -> dns.nameserver.Do53Nameserver:
    return dns.nameserver.Do53Nameserver(*parse_nameserver(spec))
