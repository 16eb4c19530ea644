"""The account stage: what each request did, in the metrics, in its one JSON log line (every proxied request has
exactly one), as a sample for the parity monitor (the engine's counts against kvgate's), as the test of the blocks
predicted where it went (the engine's reuse refutes those it did not reuse), and (for a streamed first token) as a
sample for the cost model's calibration. A traced request's spans end here too, once, as its log line is written."""

from __future__ import annotations

import time
from collections.abc import Callable

from starlette.responses import Response

from kvgate.policies.cost_model import need_tokens
from kvgate.router.admission.gate import Ticket
from kvgate.router.apis.base import Api, Usage
from kvgate.router.core.errors import OPENAI_ERRORS, ApiError, ErrorShape
from kvgate.router.core.logs import RequestLogger
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.attempts import Upstream
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.relay import StreamResult, kvgate_headers
from kvgate.router.routing.parity import ParityMonitor, Sample
from kvgate.router.routing.predictions import Predictions
from kvgate.router.routing.records import Routed
from kvgate.router.upstream.proxy import AttemptFailed

Answered = Callable[[Upstream, StreamResult | None], None]
"""Told of an answer once it is complete: a stream's result, or None for one read whole."""
CLIENT_CLOSED = "499"
"""Status recorded for requests whose client left before any answer (nginx's convention)."""


def _elapsed_ms(admission: Admission, until: float | None = None) -> float:
    return round(((until if until is not None else time.monotonic()) - admission.started) * 1000.0, 3)


class Accounting:
    def __init__(self, metrics: GatewayMetrics, request_log: RequestLogger, parity: ParityMonitor,
                 predictions: Predictions) -> None:
        self.metrics = metrics
        self.request_log = request_log
        self.parity = parity
        self.predictions = predictions

    def rejected(self, err: ApiError, admission: Admission, api: Api | None) -> None:
        """Refused before routing (auth, limits, a bad body or prompt, no replica)."""
        if admission.trace is not None:
            admission.trace.finish(err.status, error_type=err.code or err.error_type,
                                   end="client_disconnect" if err.status == int(CLIENT_CLOSED) else "ok")
        self.metrics.rejections.labels(err.code or str(err.status)).inc()
        self.request_log.request(
            id=admission.request_id, tenant=admission.tenant, api=api.name if api is not None else None, replica=None,
            decision=None, status=str(err.status), error=err.code, e2e_ms=_elapsed_ms(admission), attempts=0,
        )

    def failed(
        self, failed: AttemptFailed, routed: Routed, admission: Admission, attempts: int, api: Api | None
    ) -> Response:
        """Every attempt failed before any byte reached the client: the last engine error (in the API's shape), else
        502/504."""
        headers = kvgate_headers(admission.request_id, routed.decision.reason)
        shape: ErrorShape = api.errors if api is not None else OPENAI_ERRORS
        if failed.status is not None:
            status = failed.status
            body, media_type = shape.from_engine(status, failed.body, failed.headers.get("content-type"))
            response = Response(body, status_code=status, headers=headers, media_type=media_type)
        else:
            err = failed.to_api_error()
            status = err.status
            response = err.response(headers, shape)
        if admission.trace is not None:
            admission.trace.finish(status, error_type=failed.cause)
        self.metrics.requests.labels("", str(status), routed.decision.reason).inc()
        self.request_log.request(
            id=admission.request_id, tenant=routed.request.tenant, api=api.name if api is not None else None,
            replica=None, decision=routed.decision.reason, action=routed.decision.action,
            prompt_tokens=routed.request.prompt_tokens, status=str(status), error=failed.cause,
            e2e_ms=_elapsed_ms(admission), attempts=attempts,
        )
        return response

    def client_left(self, routed: Routed, admission: Admission, api: Api | None) -> Response:
        if admission.trace is not None:
            admission.trace.finish(int(CLIENT_CLOSED), end="client_disconnect")
        self.metrics.client_disconnects.inc()
        self.metrics.requests.labels("", CLIENT_CLOSED, routed.decision.reason).inc()
        self.request_log.request(
            id=admission.request_id, tenant=routed.request.tenant, api=api.name if api is not None else None,
            replica=None, decision=routed.decision.reason,
            action=routed.decision.action, prompt_tokens=routed.request.prompt_tokens, status=CLIENT_CLOSED,
            e2e_ms=_elapsed_ms(admission),
        )
        return Response(status_code=int(CLIENT_CLOSED))

    def answered(
        self, routed: Routed, admission: Admission, api: Api | None, up: Upstream, result: StreamResult | None, *,
        then: Answered | None = None, ticket: Ticket | None = None,
    ) -> None:
        """An answer relayed in full (``result`` for a stream, None for an answer read whole), in ``api``'s form
        (None: a body kvgate does not read, such as embeddings'); ``then`` is told of it once it is accounted, and
        the admission ``ticket`` given back whatever happens. A request routed on its prompt's beginning is
        accounted once its whole prompt is tokenized (:attr:`Routed.completed`): its counts are the whole prompt's."""
        completed = routed.completed
        if completed is not None and not completed.done():
            completed.add_done_callback(
                lambda _: self.answered(routed, admission, api, up, result, then=then, ticket=ticket))
            return
        try:
            if result is None:
                usage = api.usage_of_body(up.body) if up.status == 200 and api is not None else None
                self.completed(routed, admission, api, up, up.first_byte_at, usage, "ok", stream=False)
            else:
                self.completed(routed, admission, api, up, result.finished_at, result.usage, result.end, stream=True)
            if then is not None:
                then(up, result)
        finally:
            if ticket is not None:
                ticket.release()

    def completed(
        self, routed: Routed, admission: Admission, api: Api | None, up: Upstream, finished_at: float,
        usage: Usage | None, end: str, *, stream: bool,
    ) -> None:
        request = routed.request
        if admission.trace is not None:
            admission.trace.finish(up.status, end=end, usage=usage, replica=up.replica, answer=up.body, streamed=stream)
        started = admission.started
        matched = routed.matched_tokens(up.replica)
        view = routed.views.get(up.replica)
        predicted = min(view.match.predicted, matched) if view is not None else 0
        cached = usage.cached_tokens if usage is not None and usage.cached_tokens is not None else None
        hit = "hit" if (cached if cached is not None else matched) > 0 else "miss"
        ttft_ms = (up.first_byte_at - started) * 1000.0
        e2e_ms = (finished_at - started) * 1000.0
        status = str(up.status) if end == "ok" else end
        m = self.metrics
        m.requests.labels(up.replica, status, routed.decision.reason).inc()
        m.e2e.labels(hit).observe(e2e_ms / 1000.0)
        m.matched_tokens.observe(matched)
        if end == "ok" and up.status == 200 and routed.routing is not None and routed.prefills:
            avoided_ms = routed.routing.cost_model.prefill_avoided_ms(
                request.prompt_tokens, matched if cached is None else cached
            )
            m.prefill_avoided.inc(avoided_ms / 1000.0)
        if end == "stream_error":
            m.stream_errors.inc()
        elif end == "client_disconnect":
            m.client_disconnects.inc()
        if usage is not None and routed.prefills:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(cached or 0)
        if usage is not None and api is not None and routed.tokenized is not None and routed.routing is not None \
                and routed.whole:
            self.parity.observe(parity_sample(routed, api, up.replica, usage))
            if cached is not None and routed.prefills and routed.decision.action == "route":
                # a handoff's engine does not count the tokens it pulled as cached: no refutation there
                self.predictions.refuted(routed, up.replica, cached)
        if stream:
            m.ttft.labels(hit).observe(ttft_ms / 1000.0)
        if end == "ok" and up.status == 200:
            calibrate(routed, up, usage, first_token=stream)
        decision = routed.decision
        priced = decision.ttft_ms
        predicted_ttft = priced.get(up.replica) if priced is not None else None
        chosen = up.replica == decision.replica
        self.request_log.request(
            id=request.request_id, tenant=request.tenant, api=api.name if api is not None else None,
            model=request.model, replica=up.replica,
            decision=decision.reason, action=decision.action, prompt_tokens=request.prompt_tokens,
            matched_tokens=matched, predicted_tokens=predicted, cached_tokens=cached,
            predicted_ttft_ms=None if predicted_ttft is None else round(predicted_ttft, 3),
            predicted_queue_ms=None if predicted_ttft is None else round(routed.queue_delay_ms(up.replica), 3),
            predicted_load_ms=_rounded(decision.load_ms) if chosen else None,
            predicted_interference_ms=_rounded(decision.interference_ms) if chosen else None,
            ttft_ms=round(ttft_ms, 3) if stream else None,
            upstream_ttft_ms=round(up.engine_ms, 3) if stream else None,
            e2e_ms=round(e2e_ms, 3), status=status,
            attempts=up.attempts, stream=stream,
        )


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 3)


def parity_sample(routed: Routed, api: Api, replica: str, usage: Usage) -> Sample:
    """The engine's counts of an answered request beside kvgate's: its own count only when it tokenized the (whole,
    single) prompt itself, and what it credited the replica with."""
    tokenized = routed.tokenized
    assert tokenized is not None and routed.routing is not None
    exact = tokenized.source == "local" and tokenized.prompt_count == 1
    return Sample(
        model=routed.routing.config.name, api=api.name, request_id=routed.request.request_id,
        counted=len(tokenized.token_ids) if exact else None, engine_prompt=usage.prompt_tokens,
        credited=routed.matched_tokens(replica), engine_cached=usage.cached_tokens,
        block_size=routed.block_sizes.get(replica, routed.request.block_size),
    )


def calibrate(routed: Routed, up: Upstream, usage: Usage | None, *, first_token: bool) -> None:
    """An answer as a sample for the model's calibrator (bounded, robust fit), timed from its dispatch to the
    replica (the gateway's own queue and tokenizing are not the engine's time): a streamed answer's first token
    (``first_token``), or an answer read whole as a bound on its first token. The engine's own token counts, or the
    router's when they are exact. Handoffs (transfers, disaggregated requests) are not prefill samples: their TTFT is
    a first leg plus a KV pull, and engines do not report pulled tokens as cached, so they would read as a whole
    prompt prefilled implausibly fast."""
    replica = up.replica
    routing = routed.routing
    calibrator = routing.calibrator if routing is not None else None
    if routing is None or calibrator is None or routed.decision.action != "route":
        return
    if usage is not None and usage.cached_tokens is not None:
        prompt_tokens, cached_tokens = usage.prompt_tokens, usage.cached_tokens
    elif not routed.request.approximate:
        prompt_tokens, cached_tokens = routed.request.prompt_tokens, routed.matched_tokens(replica)
    else:
        return
    view = routed.views.get(replica)
    work_ahead_ms = 0.0
    if view is not None:
        model = routing.cost_model
        need = need_tokens(prompt_tokens - cached_tokens, routed.request.max_tokens)
        work_ahead_ms = model.work_ahead_ms(view) + model.kv_wait_ms(view, need)
    if first_token:
        calibrator.observe(prompt_tokens, cached_tokens, up.engine_ms, work_ahead_ms)
    else:
        calibrator.observe_bound(prompt_tokens, cached_tokens, up.engine_ms, work_ahead_ms)
