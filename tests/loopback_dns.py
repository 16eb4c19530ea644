"""A real DNS server on loopback (dnslib, UDP) whose records a test changes while the code under test resolves them."""

from __future__ import annotations

import threading

from dnslib import QTYPE, RCODE, RR, SRV, A, DNSLabel
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

TTL = 1


class LoopbackDns(BaseResolver):
    """Answers A and SRV queries from ``records``; a name it has no records of at all is NXDOMAIN."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple[str, str], list[RR]] = {}
        self.queries = 0
        self.failing = False
        """When set, every query gets SERVFAIL (a DNS server in trouble)."""
        self._server = DNSServer(self, address="127.0.0.1", port=0, logger=DNSLogger("-request,-reply,-truncated,-error,-recv,-send,-data", logf=lambda _: None))

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._server.server.server_address[1]}"

    def start(self) -> "LoopbackDns":
        self._server.start_thread()
        return self

    def stop(self) -> None:
        self._server.stop()
        self._server.server.server_close()

    def set_a(self, name: str, addresses: list[str]) -> None:
        self._set(name, "A", [RR(name, QTYPE.A, ttl=TTL, rdata=A(a)) for a in addresses])

    def set_srv(self, name: str, targets: list[tuple[str, int]]) -> None:
        """``targets``: (host, port) pairs."""
        self._set(name, "SRV", [
            RR(name, QTYPE.SRV, ttl=TTL, rdata=SRV(priority=0, weight=100, port=port, target=host))
            for host, port in targets
        ])

    def _set(self, name: str, rdtype: str, records: list[RR]) -> None:
        with self._lock:
            self._records[(_key(name), rdtype)] = records

    def resolve(self, request, handler: DNSHandler):  # noqa: ANN001 - dnslib's interface
        reply = request.reply()
        qname, qtype = _key(str(request.q.qname)), QTYPE[request.q.qtype]
        with self._lock:
            self.queries += 1
            if self.failing:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            known = any(name == qname for name, _ in self._records)
            records = list(self._records.get((qname, qtype), []))
        if not known:
            reply.header.rcode = RCODE.NXDOMAIN
        for rr in records:
            reply.add_answer(rr)
        return reply


def _key(name: str) -> str:
    return str(DNSLabel(name)).lower().rstrip(".")
