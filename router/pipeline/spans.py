"""A request's spans, made with the OpenTelemetry SDK and exported over OTLP by its batch span processor.

Imported only when tracing is on (:func:`kvgate.router.pipeline.tracing.start_tracing`): with tracing off no request
carries a :class:`RequestTrace`, and the stages' one check finds none.

One request is one trace tree under a ``SERVER`` span named as OpenTelemetry's HTTP conventions name it
(``POST /v1/chat/completions``). Its children are the stages, one after another: ``admit``, ``tokenize``, ``queue``
(only when the request waited at the admission gate), ``route`` and ``forward``; each stage's span ends when the
next begins. Under ``forward``, each engine request is an ``attempt`` (``CLIENT``), whose span id is the parent id in
the ``traceparent`` the engine gets, so the engine's own spans hang under it. A streamed attempt that answers stays
open until its stream ends, like ``forward`` and the request's span, which then carries the engine's token counts.

Attributes follow OpenTelemetry's HTTP and GenAI conventions where one exists (``http.*``, ``url.*``, ``server.*``,
``error.type``, ``gen_ai.*``) and are kvgate's own under ``kvgate.*`` (the decision, the replica, the prediction).
No API key is ever recorded, and no prompt or completion text unless ``tracing.record_content`` asks for it.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

import msgspec
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, Sampler, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace import TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from kvgate.router.apis.base import Usage
from kvgate.router.core.trace_context import TraceParent
from kvgate.router.pipeline.parse import Parsed
from kvgate.router.pipeline.tracing import TracingConfig
from kvgate.router.routing.records import Routed

_PROPAGATOR = TraceContextTextMapPropagator()
_encode = msgspec.json.Encoder().encode
Attributes = dict[str, AttributeValue]

OPERATIONS = {"chat": "chat", "messages": "chat", "responses": "chat", "completions": "text_completion"}
"""GenAI's ``gen_ai.operation.name`` of each API kvgate parses (by :attr:`~kvgate.router.apis.base.Api.name`)."""
PATH_OPERATIONS = {"/v1/embeddings": "embeddings"}
"""… and of the bodies it forwards unread, by path."""
CONTENT_EVENT = "gen_ai.client.inference.operation.details"
"""GenAI's opt-in event for a request's input and output messages (``tracing.record_content``)."""
_RESPONSE_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,256})"')
"""The first ``"model"`` of an answer: a JSON body's, or a stream's first event's (every API names its model there).
Inside a JSON string a quote is escaped, so text the model wrote cannot match."""
_RESPONSE_MODEL_WITHIN = 65536


def sampler_of(config: TracingConfig) -> Sampler | None:
    """The policy file's sampler, or None for the environment's (OTEL_TRACES_SAMPLER, the SDK's default
    ``parentbased_always_on``)."""
    if config.sample_ratio is None and config.parent_based:
        return None
    ratio = TraceIdRatioBased(1.0 if config.sample_ratio is None else config.sample_ratio)
    return ParentBased(ratio) if config.parent_based else ratio


def resource_of(config: TracingConfig) -> Resource:
    """Who the spans are from: ``tracing.service_name``, else OTEL_SERVICE_NAME (and OTEL_RESOURCE_ATTRIBUTES, read
    by the SDK), else ``kvgate``."""
    resource = Resource.create({SERVICE_NAME: config.service_name} if config.service_name else {})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "kvgate"}))
    return resource


def exporter_of(config: TracingConfig, environ: Mapping[str, str]) -> SpanExporter:
    """OTLP over HTTP/protobuf, or over gRPC when OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (or OTEL_EXPORTER_OTLP_PROTOCOL)
    says ``grpc`` and its exporter is installed; the endpoint and timeout from the section, else the environment."""
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter

        return GrpcSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_s)
    return OTLPSpanExporter(endpoint=config.endpoint, timeout=config.export_timeout_s)


class RequestTracer:
    """The gateway's tracer: one :class:`RequestTrace` per request (:meth:`begin`), exported in the background."""

    def __init__(self, provider: TracerProvider, record_content: bool, replica_at: Callable[[str], str | None]) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("kvgate")
        self.record_content = record_content
        self.replica_at = replica_at
        """The replica an engine URL belongs to (the fleet's), for the attempts' spans."""

    @classmethod
    def start(
        cls, config: TracingConfig, replica_at: Callable[[str], str | None], environ: Mapping[str, str]
    ) -> RequestTracer:
        timeout_ms = None if config.export_timeout_s is None else config.export_timeout_s * 1000.0
        provider = TracerProvider(sampler=sampler_of(config), resource=resource_of(config))
        provider.add_span_processor(BatchSpanProcessor(
            exporter_of(config, environ), max_export_batch_size=config.max_export_batch_size,
            export_timeout_millis=timeout_ms,
        ))
        return cls(provider, config.record_content, replica_at)

    def begin(
        self, method: str, route: str, path: str, traceparent: TraceParent | None, tracestate: str | None,
        request_id: str,
    ) -> RequestTrace:
        """A request's trace, its ``admit`` stage begun: a child of the client's ``traceparent`` when it sent a valid
        one (sampled as its flag says, with the parent-based sampler), else a new trace."""
        parent: Context | None = None
        if traceparent is not None:
            state = TraceState.from_header([tracestate]) if tracestate is not None else None
            remote = SpanContext(traceparent.trace_id, traceparent.parent_id, is_remote=True,
                                 trace_flags=TraceFlags(traceparent.flags), trace_state=state)
            parent = trace.set_span_in_context(NonRecordingSpan(remote))
        attributes: Attributes = {"http.request.method": method, "http.route": route, "url.path": path,
                                  "kvgate.request_id": request_id}
        server = self.tracer.start_span(f"{method} {route}", parent, SpanKind.SERVER, attributes)
        request = RequestTrace(self, server, route)
        request.stage("admit")
        return request

    def shutdown(self) -> None:
        """Export what is left and stop (blocks up to the export timeout)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans. The stages call it in their order; :meth:`finish` (the account stage) ends them all."""

    def __init__(self, tracer: RequestTracer, server: Span, route: str) -> None:
        self.tracer = tracer
        self.server = server
        self.recording = server.is_recording()
        """Sampled: attributes are worth computing. Unsampled spans still exist, so the engine gets fresh ids."""
        self._server_context = trace.set_span_in_context(server)
        self._route = route
        self._stage: Span | None = None
        self._stage_name = ""
        self._forward_context: Context | None = None
        self._relaying: AttemptSpan | None = None
        self._operation: str | None = PATH_OPERATIONS.get(route)
        self._model: str | None = None
        self._prompt: object = None
        self.attempts = 0
        self.last_failure: str | None = None
        """The cause of the latest failed attempt: the next attempt's retry reason."""
        self._finished = False

    def stage(self, name: str, attributes: Attributes | None = None) -> None:
        """Stage ``name`` begins (the stage before it ends)."""
        if self._stage is not None:
            self._stage.end()
        self._stage = self.tracer.tracer.start_span(name, self._server_context, attributes=attributes)
        self._stage_name = name

    def admitted(self, parsed: Parsed, tenant: str | None) -> None:
        """The request's body parsed: its model, budget and stream flag, and whose it is (a tenant's name, never its
        key)."""
        api = parsed.api
        if api is not None:
            self._operation = OPERATIONS.get(api.name)
            if self.tracer.record_content:
                self._prompt = parsed.body.get(api.prompt_param)
        self._model = parsed.model or None
        if not self.recording:
            return
        attributes: Attributes = {"gen_ai.request.stream": parsed.stream}
        if self._operation is not None:
            attributes["gen_ai.operation.name"] = self._operation
        if self._model is not None:
            attributes["gen_ai.request.model"] = self._model
        if parsed.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = parsed.max_tokens
        if tenant is not None:
            attributes["kvgate.tenant"] = tenant
        self.server.set_attributes(attributes)

    def forwarding(self, routed: Routed) -> None:
        """The decision, recorded on the ``route`` span, and the ``forward`` stage begun."""
        if self.recording and self._stage is not None and self._stage_name == "route":
            self._stage.set_attributes(decision_attributes(routed))
        self.stage("forward")
        assert self._stage is not None
        self._forward_context = trace.set_span_in_context(self._stage)

    def attempt(self, url: str, method: str) -> AttemptSpan:
        """An engine request's span, under ``forward`` (:class:`~kvgate.router.core.trace_context.AttemptTracing`)."""
        self.attempts += 1
        attributes: Attributes = {}
        if self.recording:
            attributes = attempt_attributes(url, method, self.attempts, self.last_failure,
                                            self.tracer.replica_at(url))
            if self._operation is not None:
                attributes["gen_ai.operation.name"] = self._operation
            if self._model is not None:
                attributes["gen_ai.request.model"] = self._model
        span = self.tracer.tracer.start_span("attempt", self._forward_context or self._server_context,
                                             SpanKind.CLIENT, attributes)
        return AttemptSpan(self, span)

    def relaying(self, attempt: AttemptSpan) -> None:
        """``attempt``'s stream is the one relayed to the client: it ends with the request."""
        if self._relaying is not None and self._relaying is not attempt:
            self._relaying.span.end()
        self._relaying = attempt

    def finish(
        self, status: int, *, error_type: str | None = None, end: str = "ok", usage: Usage | None = None,
        replica: str | None = None, answer: bytes = b"", streamed: bool = False,
    ) -> None:
        """The request is over (answered, failed, refused, or its client left): its spans end, the request's with
        its status, the engine's counts (``usage``) and the answering ``replica``. An error is a 5xx or a stream the
        engine cut short (``end``); a refusal (4xx) names its ``error_type`` without being one, and a client that
        left is no error at all."""
        if self._finished:
            return
        self._finished = True
        failed = status >= 500 or end == "stream_error"
        if end == "stream_error" and error_type is None:
            error_type = "upstream_stream_error"
        if self._relaying is not None:
            self._relaying.stream_ended(end)
        stage = self._stage
        if stage is not None:
            if error_type is not None and self.recording:
                stage.set_attribute("error.type", error_type)
            if failed:
                stage.set_status(Status(StatusCode.ERROR, error_type))
            stage.end()
        server = self.server
        if self.recording:
            server.set_attributes(finish_attributes(status, error_type, end, usage, replica, answer))
            if self.tracer.record_content:
                server.add_event(CONTENT_EVENT, content_attributes(self._prompt, None if streamed else answer))
        if failed:
            server.set_status(Status(StatusCode.ERROR, error_type))
        server.end()


class AttemptSpan:
    """One engine request's span (:class:`~kvgate.router.core.trace_context.TracedAttempt`)."""

    def __init__(self, request: RequestTrace, span: Span) -> None:
        self.request = request
        self.span = span
        self.started = time.monotonic()

    def headers(self, base: Mapping[str, str]) -> dict[str, str]:
        headers = dict(base)
        _PROPAGATOR.inject(headers, trace.set_span_in_context(self.span))
        return headers

    def answered(self, status: int, streaming: bool) -> None:
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR, str(status)))
        if streaming:
            span.add_event("first_token")
            span.set_attribute("gen_ai.response.time_to_first_chunk", time.monotonic() - self.started)
            self.request.relaying(self)
        else:
            span.end()

    def failed(self, cause: str, status: int | None) -> None:
        span = self.span
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        span.set_attribute("error.type", cause)
        span.set_status(Status(StatusCode.ERROR, cause))
        span.end()
        self.request.last_failure = cause

    def abandoned(self) -> None:
        self.span.set_attribute("kvgate.end", "abandoned")
        self.span.end()

    def stream_ended(self, end: str) -> None:
        """The relayed stream is over: ``ok``, ``stream_error`` (the engine cut it short) or ``client_disconnect``
        (the client left, which is not the engine's error)."""
        span = self.span
        if end != "ok":
            span.set_attribute("kvgate.end", end)
        if end == "stream_error":
            span.set_attribute("error.type", "upstream_stream_error")
            span.set_status(Status(StatusCode.ERROR, "upstream_stream_error"))
        span.end()


def decision_attributes(routed: Routed) -> Attributes:
    """The route span's: what was decided and why, for which replica, with the prediction behind it and its terms."""
    decision = routed.decision
    replica = decision.replica
    request = routed.request
    attributes: Attributes = {
        "kvgate.decision.action": decision.action, "kvgate.decision.reason": decision.reason,
        "kvgate.replica": replica, "kvgate.candidates": len(routed.views),
        "kvgate.prompt_tokens": request.prompt_tokens, "kvgate.matched_tokens": routed.matched_tokens(replica),
        "kvgate.prompt_approximate": request.approximate,
    }
    if decision.source is not None:
        attributes["kvgate.decision.source"] = decision.source
    predicted = routed.predicted_ttft_ms(replica)
    if predicted is not None:
        queue_ms = routed.queue_delay_ms(replica)
        attributes["kvgate.predicted_ttft_ms"] = round(predicted, 3)
        attributes["kvgate.predicted_queue_ms"] = round(queue_ms, 3)
        attributes["kvgate.predicted_prefill_ms"] = round(predicted - queue_ms, 3)
    return attributes


def attempt_attributes(url: str, method: str, number: int, retry_reason: str | None, replica: str | None) -> Attributes:
    """An attempt span's: where it went (without any credentials the URL holds) and which try it is."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    attributes: Attributes = {
        "http.request.method": method, "server.address": host, "server.port": port,
        "url.full": f"{parts.scheme}://{host}:{port}{parts.path}", "kvgate.attempt": number,
    }
    if replica is not None:
        attributes["kvgate.replica"] = replica
    if number > 1:
        attributes["http.request.resend_count"] = number - 1
    if retry_reason is not None:
        attributes["kvgate.retry_reason"] = retry_reason
    return attributes


def finish_attributes(
    status: int, error_type: str | None, end: str, usage: Usage | None, replica: str | None, answer: bytes
) -> Attributes:
    """The request span's at its end: its status, the engine's token counts and the model that answered."""
    attributes: Attributes = {"http.response.status_code": status}
    if error_type is not None:
        attributes["error.type"] = error_type
    if end != "ok":
        attributes["kvgate.end"] = end
    if replica is not None:
        attributes["kvgate.replica"] = replica
    if usage is not None:
        attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
        if usage.cached_tokens is not None:
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_tokens
            attributes["kvgate.cached_tokens"] = usage.cached_tokens
    model = _RESPONSE_MODEL.search(answer, 0, _RESPONSE_MODEL_WITHIN) if answer else None
    if model is not None:
        attributes["gen_ai.response.model"] = model.group(1).decode("utf-8", "replace")
    return attributes


def content_attributes(prompt: object, answer: bytes | None) -> Attributes:
    """``tracing.record_content``'s event: the request's prompt as its API sent it (``messages``, ``prompt`` or
    ``input``), and the engine's answer body when it was read whole (a stream is relayed as it comes, not kept)."""
    attributes: Attributes = {}
    if prompt is not None:
        attributes["gen_ai.input.messages"] = _encode(prompt).decode()
    if answer:
        attributes["gen_ai.output.messages"] = answer.decode("utf-8", "replace")
    return attributes
