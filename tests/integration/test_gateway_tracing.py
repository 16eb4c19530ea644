"""Traces end to end: a `kvgate sim` fleet, `kvgate serve` exporting over OTLP/HTTP to a receiver this test runs on
loopback, and the official openai client sending its own ``traceparent``. The engine must continue the client's
trace from kvgate's attempt span; kvgate's spans must reach the collector, under the client's trace, with the
decision on the route span and no prompt text anywhere. With tracing off, the client's context reaches the engine
unchanged."""

from __future__ import annotations

import http.server
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from kvgate.loadgen.bench import free_port_block
from tests.integration.test_gateway import MODEL, gateway_config, sim_requests
from tests.support import Gateway, Sim, start_kvgate, start_sim, wait_until

pytestmark = pytest.mark.integration

MARKER = "ZEBRA-7f3a-PROMPT-MARKER"
"""Prompt text no span may hold while content recording is off."""
SERVER_KIND, CLIENT_KIND = 2, 3
"""``Span.SpanKind`` values in OTLP."""


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind is not None else None


def attributes_of(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    service: str


@dataclass
class Receiver:
    """An OTLP/HTTP traces endpoint: every span kvgate exported to ``POST /v1/traces``."""

    port: int
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            service = attributes_of(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name, span.kind,
                        attributes_of(span.attributes), [(e.name, attributes_of(e.attributes)) for e in span.events],
                        service,
                    ))
        with self.lock:
            self.spans.extend(received)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]


def receiver_handler(receiver: Receiver) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    return Handler


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    received = Receiver(free_port_block(1))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", received.port), receiver_handler(received))
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    yield received
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tracing")


@pytest.fixture(scope="module")
def sim(workdir: Path) -> Iterator[Sim]:
    s = start_sim(workdir, 2, "--time-scale", "0.1")
    yield s
    s.stop()


UNSET_OTLP = {"OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": ""}
"""Whatever the environment running the tests says, these gateways start from no collector of their own."""


@pytest.fixture(scope="module")
def traced(sim: Sim, workdir: Path, receiver: Receiver) -> Iterator[Gateway]:
    config = gateway_config(sim, workdir, "kvgate-traced.yaml")
    env = {**UNSET_OTLP, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_SERVICE_NAME": "kvgate-under-test"}
    g = start_kvgate(workdir, config, env=env)
    yield g
    g.stop()


@pytest.fixture(scope="module")
def untraced(sim: Sim, workdir: Path) -> Iterator[Gateway]:
    g = start_kvgate(workdir, gateway_config(sim, workdir, "kvgate-untraced.yaml"), env=UNSET_OTLP)
    yield g
    g.stop()


def client_of(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def new_traceparent() -> tuple[str, str, str]:
    """A sampled ``traceparent`` of a new trace: the header, its trace id and its parent id."""
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def engine_headers(sim: Sim, request_id: str) -> dict[str, str | None]:
    """The headers the engine got for ``request_id`` (on whichever replica served it)."""

    def find() -> dict[str, str | None] | None:
        for i in range(sim.replicas):
            for seen in sim_requests(sim, i):
                if seen["headers"].get("x-request-id") == request_id:
                    return seen["headers"]
        return None

    return wait_until(find, f"the engine's record of {request_id}", timeout=10.0)


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{text} {MARKER} tell me about tracing"}]


def exported_request(receiver: Receiver, trace_id: str, attempt_span_id: str) -> list[ReceivedSpan]:
    """The request's spans once the collector has them all: the request's own (it ends last) and the attempt the
    engine continued from."""

    def arrived() -> list[ReceivedSpan] | None:
        spans = receiver.of_trace(trace_id)
        done = any(s.kind == SERVER_KIND for s in spans) and any(s.span_id == attempt_span_id for s in spans)
        return spans if done else None

    return wait_until(arrived, f"the spans of trace {trace_id}", timeout=15.0)


def check_request_trace(spans: list[ReceivedSpan], parent_id: str, attempt_span_id: str, stream: bool) -> None:
    by_name = {span.name: span for span in spans}
    (server,) = [s for s in spans if s.kind == SERVER_KIND]
    assert server.name == "POST /v1/chat/completions" and server.parent_id == parent_id
    assert server.service == "kvgate-under-test"
    assert {"admit", "tokenize", "route", "forward", "attempt"} <= set(by_name)
    assert all(by_name[stage].parent_id == server.span_id for stage in ("admit", "tokenize", "route", "forward"))
    attempt = next(s for s in spans if s.span_id == attempt_span_id)
    assert attempt.name == "attempt" and attempt.kind == CLIENT_KIND and attempt.parent_id == by_name["forward"].span_id
    assert attempt.attributes["http.response.status_code"] == 200
    assert attempt.attributes["kvgate.replica"].startswith("sim-") and attempt.attributes["server.port"] > 0
    route = by_name["route"].attributes
    assert route["kvgate.decision.reason"] and route["kvgate.replica"] == attempt.attributes["kvgate.replica"]
    assert route["kvgate.predicted_ttft_ms"] >= 0 and "kvgate.matched_tokens" in route
    assert server.attributes["gen_ai.operation.name"] == "chat" and server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["gen_ai.request.stream"] is stream
    assert server.attributes["gen_ai.usage.output_tokens"] == 3
    assert server.attributes["http.response.status_code"] == 200
    assert ("first_token" in [name for name, _ in attempt.events]) is stream
    for span in spans:
        texts = [*map(str, span.attributes.values()), *(str(v) for _, a in span.events for v in a.values())]
        assert not any(MARKER in text for text in texts), f"prompt text in span {span.name}"


def test_a_streamed_chat_continues_the_clients_trace_through_kvgate_to_the_engine(
    traced: Gateway, sim: Sim, receiver: Receiver
) -> None:
    traceparent, trace_id, parent_id = new_traceparent()
    request_id = f"traced-stream-{trace_id[:8]}"
    stream = client_of(traced).chat.completions.create(
        model=MODEL, messages=messages("streamed"), max_tokens=3, stream=True, stream_options={"include_usage": True},
        extra_headers={"traceparent": traceparent, "tracestate": "vendor=opaque", "X-Request-Id": request_id},
    )
    assert [chunk for chunk in stream]
    sent = engine_headers(sim, request_id)
    version, engine_trace_id, engine_parent_id, flags = str(sent["traceparent"]).split("-")
    assert (version, engine_trace_id, flags) == ("00", trace_id, "01") and engine_parent_id != parent_id
    assert sent["tracestate"] == "vendor=opaque"
    spans = exported_request(receiver, trace_id, engine_parent_id)
    check_request_trace(spans, parent_id, engine_parent_id, stream=True)


def test_a_chat_read_whole_is_traced_the_same_way(traced: Gateway, sim: Sim, receiver: Receiver) -> None:
    traceparent, trace_id, parent_id = new_traceparent()
    request_id = f"traced-whole-{trace_id[:8]}"
    completion = client_of(traced).chat.completions.create(
        model=MODEL, messages=messages("whole"), max_tokens=3,
        extra_headers={"traceparent": traceparent, "X-Request-Id": request_id},
    )
    assert completion.choices[0].message.content
    sent = engine_headers(sim, request_id)
    _, engine_trace_id, engine_parent_id, _ = str(sent["traceparent"]).split("-")
    assert engine_trace_id == trace_id and sent["tracestate"] is None
    spans = exported_request(receiver, trace_id, engine_parent_id)
    check_request_trace(spans, parent_id, engine_parent_id, stream=False)
    (server,) = [s for s in spans if s.kind == SERVER_KIND]
    assert server.attributes["gen_ai.response.model"] == MODEL


def test_a_request_without_trace_context_starts_a_trace_the_engine_continues(
    traced: Gateway, sim: Sim, receiver: Receiver
) -> None:
    request_id = f"traced-root-{uuid.uuid4().hex[:8]}"
    client_of(traced).chat.completions.create(model=MODEL, messages=messages("root"), max_tokens=3,
                                              extra_headers={"X-Request-Id": request_id, "traceparent": "junk"})
    _, trace_id, attempt_span_id, _ = str(engine_headers(sim, request_id)["traceparent"]).split("-")
    spans = exported_request(receiver, trace_id, attempt_span_id)
    (server,) = [s for s in spans if s.kind == SERVER_KIND]
    assert server.parent_id == ""  # a root: the malformed client header was dropped


def test_tracing_off_passes_the_clients_context_to_the_engine_unchanged(untraced: Gateway, sim: Sim) -> None:
    traceparent, _, _ = new_traceparent()
    request_id = f"untraced-{uuid.uuid4().hex[:8]}"
    client_of(untraced).chat.completions.create(
        model=MODEL, messages=messages("untraced"), max_tokens=3,
        extra_headers={"traceparent": traceparent, "tracestate": "rojo=00f067aa0ba902b7", "X-Request-Id": request_id},
    )
    sent = engine_headers(sim, request_id)
    assert (sent["traceparent"], sent["tracestate"]) == (traceparent, "rojo=00f067aa0ba902b7")
    malformed = f"untraced-bad-{uuid.uuid4().hex[:8]}"
    client_of(untraced).chat.completions.create(
        model=MODEL, messages=messages("untraced"), max_tokens=3,
        extra_headers={"traceparent": traceparent.upper(), "tracestate": "rojo=1", "X-Request-Id": malformed},
    )
    dropped = engine_headers(sim, malformed)
    assert dropped["traceparent"] is None and dropped["tracestate"] is None
