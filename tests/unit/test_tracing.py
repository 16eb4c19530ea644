"""Tracing: the W3C headers read as hostile input (fuzzed against the Recommendation's grammar), a client's trace
context passed on unchanged when kvgate does not trace, when tracing is on and what it samples, and a traced
request's attempts as spans whose context the engine gets."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from kvgate.policies.base import Decision, RouteRequest
from kvgate.router.apis.openai import CHAT, COMPLETIONS
from kvgate.router.fleet.attempts import NO_LOAD
from kvgate.router.core.trace_context import client_trace_context, parse_traceparent, valid_tracestate
from kvgate.router.gateway import start_tracing
from kvgate.router.pipeline.admit import ClientHeaders, upstream_headers
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.pipeline.spans import RequestTrace, RequestTracer, sampler_of
from kvgate.router.pipeline.tracing import TracingConfig, tracing_on
from kvgate.router.routing.records import Routed
from kvgate.router.routing.transfers import prefill_for_transfer
from kvgate.router.upstream.proxy import Forward, Proxy
from tests.support import REPO
from tests.unit.test_proxy import closed_port_url, engines, fleet_on, proxy  # noqa: F401  (fixtures)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"

# An independent reading of the Recommendation's grammar, to judge the parser by.
HEX = "[0-9a-f]"
ORACLE_00 = re.compile(rf"00-(?!0{{32}}){HEX}{{32}}-(?!0{{16}}){HEX}{{16}}-{HEX}{{2}}")
ORACLE_LATER = re.compile(
    rf"(?!00|ff){HEX}{{2}}-(?!0{{32}}-){HEX}{{32}}-(?!0{{16}}-){HEX}{{16}}-{HEX}{{2}}(-[!-+\--~]*)?")


def oracle_traceparent(value: str) -> bool:
    return len(value) <= 256 and bool(ORACLE_00.fullmatch(value) or ORACLE_LATER.fullmatch(value))


@pytest.mark.parametrize("value", [
    VALID,
    f"00-{TRACE_ID}-{PARENT_ID}-00",
    f"00-{TRACE_ID}-{PARENT_ID}-ff",
    f"01-{TRACE_ID}-{PARENT_ID}-03",  # a later version: same first fields
    f"cc-{TRACE_ID}-{PARENT_ID}-01-what-the-future-adds",
])
def test_valid_traceparents_are_accepted(value: str) -> None:
    parsed = parse_traceparent(value)
    assert parsed is not None
    assert (f"{parsed.trace_id:032x}", f"{parsed.parent_id:016x}", parsed.header) == (TRACE_ID, PARENT_ID, value)


def test_a_later_version_keeps_only_the_sampled_flag() -> None:
    assert parse_traceparent(f"00-{TRACE_ID}-{PARENT_ID}-03").flags == 3  # type: ignore[union-attr]
    later = parse_traceparent(f"01-{TRACE_ID}-{PARENT_ID}-03")
    assert later is not None and later.flags == 1 and later.sampled


@pytest.mark.parametrize("value", [
    "", "00", VALID.upper(), f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",
    f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # the forbidden version
    f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has exactly four fields
    f"00-{TRACE_ID}-{PARENT_ID}-1", f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01", f"00-{TRACE_ID}-{PARENT_ID}0-01",
    f"00_{TRACE_ID}_{PARENT_ID}_01", f" {VALID}", f"{VALID} ", f"{VALID}\n", f"0-{TRACE_ID}-{PARENT_ID}-01",
    f"00-{TRACE_ID[:-1]}g-{PARENT_ID}-01", f"00-{TRACE_ID}-{PARENT_ID}-0g",
    f"01-{TRACE_ID}-{PARENT_ID}-01x",  # a later version must go on with a dash
    f"01-{TRACE_ID}-{PARENT_ID}",  # ... and is never shorter than 55 characters
    f"{VALID},{VALID}",  # the header sent twice
    f"01-{TRACE_ID}-{PARENT_ID}-01-" + "x" * 300,  # longer than kvgate copies to engines
])
def test_malformed_traceparents_are_dropped(value: str) -> None:
    assert parse_traceparent(value) is None
    assert parse_traceparent(None) is None


@given(st.text(max_size=80) | st.from_regex(r"\A[0-9a-fA-F\- ]{50,70}\Z"))
def test_the_traceparent_parser_never_raises_and_accepts_only_what_the_grammar_allows(value: str) -> None:
    assert (parse_traceparent(value) is not None) == oracle_traceparent(value)


@given(st.from_regex(rf"\A[0-9a-e][0-9a-f]-{HEX}{{32}}-{HEX}{{16}}-{HEX}{{2}}\Z"))
def test_every_well_formed_traceparent_is_accepted(value: str) -> None:
    assert (parse_traceparent(value) is not None) == oracle_traceparent(value)


KEY = r"([a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
VALUE = r"[ -+\--<>-~]{0,255}[!-+\--<>-~]"


def oracle_tracestate(value: str) -> bool:
    if len(value) > 512:
        return False
    members = [m.strip(" \t") for m in value.split(",")]
    members = [m for m in members if m]
    pairs = [re.fullmatch(rf"{KEY}=({VALUE})", m) for m in members]
    if not members or not all(pairs):
        return False
    keys = [m.group(1) for m in pairs if m]
    return len(keys) <= 32 and len(set(keys)) == len(keys)


@pytest.mark.parametrize("value", [
    "congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE", "a=1 , b=2\t,,", "tenant@system=x",
    "k=with spaces inside", ",".join(f"k{i}=v" for i in range(32)), "k=" + "v" * 256,
])
def test_valid_tracestates_are_accepted(value: str) -> None:
    assert valid_tracestate(value) and oracle_tracestate(value)


@pytest.mark.parametrize("value", [
    "", ",", "novalue", "=v", "Upper=v", "k=", "k=a,k=b", "k=v=w", "k@=v", "k=\x00",
    "k=\x7f", "k=é", ",".join(f"k{i}=v" for i in range(33)), "k=" + "v" * 257, "k=" + "v" * 510 + ",x=y",
    "t" * 242 + "@s=v", "k@" + "s" * 15 + "=v",
])
def test_malformed_tracestates_are_dropped(value: str) -> None:
    assert not valid_tracestate(value)
    assert not valid_tracestate(None)


@given(st.text(max_size=120) | st.from_regex(r"\A([a-z0-9@*/_\-]{1,6}=[ -~]{0,6},?){1,5}\Z"))
def test_the_tracestate_validator_never_raises_and_accepts_only_what_the_grammar_allows(value: str) -> None:
    assert valid_tracestate(value) == oracle_tracestate(value)


def headers_of(*headers: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return list(headers)


def test_a_repeated_traceparent_is_dropped_and_repeated_tracestates_are_one_list() -> None:
    twice = ClientHeaders.of(headers_of((b"traceparent", VALID.encode()), (b"traceparent", VALID.encode())))
    assert twice.traceparent is None
    joined = ClientHeaders.of(headers_of((b"traceparent", VALID.encode()), (b"tracestate", b"a=1"), (b"tracestate", b"b=2")))
    assert joined.traceparent is not None and joined.tracestate == "a=1,b=2"
    assert client_trace_context("junk", "a=1") == (None, None)  # no tracestate without a valid traceparent
    assert client_trace_context(VALID, "A=1")[1] is None


def test_tracing_off_passes_a_valid_client_context_on_unchanged_and_nothing_else() -> None:
    client = ClientHeaders.of(headers_of((b"traceparent", VALID.encode()), (b"tracestate", b"congo=t61rcWkgMzE")))
    headers = upstream_headers(client, "rid", tenants_enabled=False)
    assert (headers["traceparent"], headers["tracestate"]) == (VALID, "congo=t61rcWkgMzE")
    junk = ClientHeaders.of(headers_of((b"traceparent", b"00-xyz"), (b"tracestate", b"congo=t61rcWkgMzE")))
    assert "traceparent" not in upstream_headers(junk, "rid", False) and "tracestate" not in upstream_headers(
        junk, "rid", False)
    none = upstream_headers(ClientHeaders.of(headers_of()), "rid", False)
    assert none == {"content-type": "application/json", "x-request-id": "rid"}
    # Traced, each attempt sends its own span's context instead (test_attempts_are_spans_the_engine_continues).
    assert "traceparent" not in upstream_headers(client, "rid", False, traced=True)


@pytest.mark.parametrize(("section", "environ", "on"), [
    ({}, {}, False),
    ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({}, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"endpoint": "http://collector:4318/v1/traces"}, {}, True),
    ({"enabled": True}, {}, True),
    ({"enabled": False}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, False),
    ({"enabled": True}, {"OTEL_SDK_DISABLED": "true"}, False),
    ({"enabled": True}, {"OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_when_tracing_is_on(section: dict, environ: dict[str, str], on: bool) -> None:
    assert tracing_on(TracingConfig(**section), environ) is on


def test_tracing_off_never_loads_the_sdk_or_the_spans_module() -> None:
    probe = ("import sys; from kvgate.router.app import server; from kvgate.router.gateway import start_tracing; "
             "from kvgate.router.pipeline.tracing import TracingConfig; "
             "assert start_tracing(TracingConfig(), lambda url: None, {}) is None; "
             "loaded = [m for m in sys.modules if m.startswith('opentelemetry.sdk') or m.endswith('.spans')]; "
             "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", probe], cwd=REPO, check=True, timeout=120)


def test_tracing_wanted_without_the_sdk_is_one_warning_and_no_tracer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delitem(sys.modules, "kvgate.router.pipeline.spans")
    for name in [m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter"))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if the otel extra were not installed
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    with caplog.at_level(logging.WARNING):
        assert start_tracing(TracingConfig(enabled=True), lambda url: None, {}) is None
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "kvgate[otel]" in warning.getMessage() and "no module 'opentelemetry." in warning.getMessage()


def test_the_policy_files_sampler() -> None:
    assert sampler_of(TracingConfig()) is None  # the environment's, by default parent-based always on
    assert isinstance(sampler_of(TracingConfig(sample_ratio=0.25)), ParentBased)
    assert isinstance(sampler_of(TracingConfig(sample_ratio=0.25, parent_based=False)), TraceIdRatioBased)


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


def tracer_with(exporter: InMemorySpanExporter, config: TracingConfig = TracingConfig(),
                replicas: dict[str, str] | None = None) -> RequestTracer:
    provider = TracerProvider(sampler=sampler_of(config))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    urls = replicas or {}
    return RequestTracer(provider, config.record_content,
                         lambda url: next((name for name, base in urls.items() if url.startswith(base + "/")), None))


def begin(tracer: RequestTracer, traceparent: str | None = None) -> RequestTrace:
    client = ClientHeaders.of(headers_of(*([(b"traceparent", traceparent.encode())] if traceparent else [])))
    return tracer.begin("POST", "/v1/chat/completions", "/v1/chat/completions", client.traceparent, None, "rid")


@pytest.mark.parametrize(("traceparent", "config", "recorded"), [
    (VALID, TracingConfig(), True),  # the client's sampled flag is honoured
    (VALID.replace("-01", "-00"), TracingConfig(), False),
    (None, TracingConfig(sample_ratio=0.0), False),  # a new trace, at the ratio
    (None, TracingConfig(sample_ratio=1.0), True),
    (VALID, TracingConfig(sample_ratio=0.0, parent_based=False), False),  # the client's flag ignored
])
def test_sampling(exported: InMemorySpanExporter, traceparent: str | None, config: TracingConfig,
                  recorded: bool) -> None:
    trace = begin(tracer_with(exported, config), traceparent)
    attempt = trace.attempt("http://127.0.0.1:1/v1/chat/completions", "POST")
    sent = attempt.headers({})["traceparent"]
    attempt.answered(200, streaming=False)
    trace.finish(200)
    spans = exported.get_finished_spans()
    assert bool(spans) is recorded
    version, trace_id, parent_id, flags = sent.split("-")
    if traceparent is not None:  # sampled or not, the engine continues the client's trace, from kvgate's span
        assert trace_id == TRACE_ID and parent_id != PARENT_ID
    assert bool(int(flags, 16) & 1) is recorded and version == "00"
    if recorded:
        (server,) = [s for s in spans if s.kind == SpanKind.SERVER]
        assert server.name == "POST /v1/chat/completions"
        if traceparent is not None:
            assert server.parent is not None and f"{server.parent.span_id:016x}" == PARENT_ID


def routed_to(replica: str, ranked: list[str]) -> Routed:
    decision = Decision(replica, reason="warm", ranked=ranked, ttft_ms={replica: 12.5})
    return Routed(RouteRequest("rid", "m", 100, 16), decision, {}, {}, {}, None, None, 0.0)


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


async def test_attempts_are_spans_the_engine_continues(proxy: Proxy, engines, exported) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    seen: list[str] = []

    async def engine(request: web.Request) -> web.Response:
        seen.append(request.headers["traceparent"])
        return web.json_response({"id": "x", "model": "served-model", "choices": []})

    good, dead = await engines(engine), closed_port_url()
    d = fleet_on(proxy, {"dead": dead, "good": good})
    trace = begin(tracer_with(exported, replicas={"dead": dead, "good": good}), VALID)
    trace.admitted(Parsed(b"{}", {"messages": [{"role": "user", "content": "SECRET"}]}, "m", False, None, CHAT, 5),
                   "alice")
    trace.stage("route")
    trace.forwarding(routed_to("dead", ["dead", "good"]))
    fwd = Forward("/v1/chat/completions", b"{}", {"content-type": "application/json"}, False, ["dead", "good"], 3,
                  trace=trace)
    up = await d.attempts.forward(fwd)
    trace.finish(up.status, replica=up.replica, answer=up.body)

    spans = exported.get_finished_spans()
    (forward,), (route,) = by_name(spans, "forward"), by_name(spans, "route")
    (server,) = by_name(spans, "POST /v1/chat/completions")
    attempt_number = lambda span: span.attributes["kvgate.attempt"]  # noqa: E731
    failed, answered = sorted(by_name(spans, "attempt"), key=attempt_number)
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}
    assert failed.parent.span_id == answered.parent.span_id == forward.context.span_id  # type: ignore[union-attr]
    assert failed.kind == answered.kind == SpanKind.CLIENT
    assert failed.status.status_code == StatusCode.ERROR and failed.attributes["error.type"] == "connect"
    assert answered.attributes["kvgate.retry_reason"] == "connect"
    assert answered.attributes["http.request.resend_count"] == 1
    assert (answered.attributes["kvgate.replica"], answered.attributes["http.response.status_code"]) == ("good", 200)
    assert answered.attributes["server.address"] == "127.0.0.1"
    (sent,) = seen
    assert sent == f"00-{TRACE_ID}-{answered.context.span_id:016x}-01"
    assert route.attributes["kvgate.decision.reason"] == "warm" and route.attributes["kvgate.predicted_ttft_ms"] == 12.5
    assert server.attributes["gen_ai.response.model"] == "served-model"
    assert server.attributes["gen_ai.request.max_tokens"] == 5 and server.attributes["kvgate.tenant"] == "alice"
    assert server.status.status_code == StatusCode.UNSET
    assert not any("SECRET" in str(value) for s in spans for value in s.attributes.values())  # content is off


async def test_a_failed_request_is_an_error_and_a_client_that_left_is_not(exported: InMemorySpanExporter) -> None:
    tracer = tracer_with(exported)
    failed = begin(tracer)
    failed.stage("route")
    failed.forwarding(routed_to("a", ["a"]))
    attempt = failed.attempt("http://127.0.0.1:1/v1/chat/completions", "POST")
    attempt.failed("status_503", 503)
    failed.finish(503, error_type="status_503")
    left = begin(tracer)
    left.stage("route")
    left.forwarding(routed_to("a", ["a"]))
    streaming = left.attempt("http://127.0.0.1:1/v1/chat/completions", "POST")
    streaming.answered(200, streaming=True)
    left.finish(200, end="client_disconnect", streamed=True)
    servers = by_name(exported.get_finished_spans(), "POST /v1/chat/completions")
    assert [s.status.status_code for s in servers] == [StatusCode.ERROR, StatusCode.UNSET]
    assert servers[0].attributes["error.type"] == "status_503"
    attempts = by_name(exported.get_finished_spans(), "attempt")
    assert [e.name for e in attempts[1].events] == ["first_token"] and attempts[1].attributes["kvgate.end"] == (
        "client_disconnect")
    assert attempts[1].status.status_code == StatusCode.UNSET


def test_content_is_recorded_only_when_the_operator_asks(exported: InMemorySpanExporter) -> None:
    trace = begin(tracer_with(exported, TracingConfig(record_content=True)))
    trace.admitted(Parsed(b"{}", {"messages": [{"role": "user", "content": "MARKER"}]}, "m", False, None, CHAT), None)
    trace.finish(200, answer=b'{"choices": [{"message": {"content": "ANSWER"}}]}')
    (server,) = by_name(exported.get_finished_spans(), "POST /v1/chat/completions")
    (event,) = server.events
    assert event.name == "gen_ai.client.inference.operation.details"
    assert "MARKER" in event.attributes["gen_ai.input.messages"]  # type: ignore[index, operator]
    assert "ANSWER" in event.attributes["gen_ai.output.messages"]  # type: ignore[index, operator]


async def test_a_handoffs_prefill_leg_is_an_attempt_too(proxy: Proxy, engines, exported) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    seen: list[str] = []

    async def source(request: web.Request) -> web.Response:
        seen.append(request.headers["traceparent"])
        return web.json_response({"kv_transfer_params": {"remote_engine_id": "e"}})

    url = await engines(source)
    d = fleet_on(proxy, {"src": url})
    trace = begin(tracer_with(exported, replicas={"src": url}), VALID)
    trace.stage("route")
    trace.forwarding(routed_to("dst", ["dst"]))
    params = await prefill_for_transfer(d.attempts, COMPLETIONS, {"model": "m", "prompt": "hi"},
                                        {"content-type": "application/json"}, "src", NO_LOAD, 2.0, trace)
    trace.finish(200)
    assert params == {"remote_engine_id": "e"}
    (leg,) = by_name(exported.get_finished_spans(), "attempt")
    assert leg.attributes["kvgate.replica"] == "src"
    assert seen == [f"00-{TRACE_ID}-{leg.context.span_id:016x}-01"]
