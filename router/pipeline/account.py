"""The account stage: what each request did, in the metrics, in its one JSON log line (every proxied request has
exactly one), and (for a streamed first token) as a sample for the cost model's calibration."""

from __future__ import annotations

import time

from starlette.responses import Response

from kvgate.router.apis.base import Api, Usage
from kvgate.router.core.errors import ApiError, as_json_error
from kvgate.router.core.logs import RequestLogger
from kvgate.router.core.metrics import GatewayMetrics
from kvgate.router.fleet.attempts import Upstream
from kvgate.router.pipeline.admit import Admission
from kvgate.router.pipeline.relay import StreamResult, kvgate_headers
from kvgate.router.routing.records import Routed
from kvgate.router.upstream.proxy import AttemptFailed

CLIENT_CLOSED = "499"
"""Status recorded for requests whose client left before any answer (nginx's convention)."""


def _elapsed_ms(admission: Admission, until: float | None = None) -> float:
    return round(((until if until is not None else time.monotonic()) - admission.started) * 1000.0, 3)


class Accounting:
    def __init__(self, metrics: GatewayMetrics, request_log: RequestLogger) -> None:
        self.metrics = metrics
        self.request_log = request_log

    def rejected(self, err: ApiError, admission: Admission) -> None:
        """Refused before routing (auth, limits, a bad body or prompt, no replica)."""
        self.metrics.rejections.labels(err.code or str(err.status)).inc()
        self.request_log.request(
            id=admission.request_id, tenant=admission.tenant, replica=None, decision=None, status=str(err.status),
            error=err.code, e2e_ms=_elapsed_ms(admission), attempts=0,
        )

    def failed(self, failed: AttemptFailed, routed: Routed, admission: Admission, attempts: int) -> Response:
        """Every attempt failed before any byte reached the client: the last engine error as is, else 502/504."""
        headers = kvgate_headers(admission.request_id, routed.decision.reason)
        if failed.status is not None:
            status = failed.status
            body, media_type = as_json_error(status, failed.body, failed.headers.get("content-type"))
            response = Response(body, status_code=status, headers=headers, media_type=media_type)
        else:
            err = failed.to_api_error()
            status = err.status
            response = err.response(headers)
        self.metrics.requests.labels("", str(status), routed.decision.reason).inc()
        self.request_log.request(
            id=admission.request_id, tenant=routed.request.tenant, replica=None, decision=routed.decision.reason,
            action=routed.decision.action, prompt_tokens=routed.request.prompt_tokens, status=str(status),
            error=failed.cause, e2e_ms=_elapsed_ms(admission), attempts=attempts,
        )
        return response

    def client_left(self, routed: Routed, admission: Admission) -> Response:
        self.metrics.client_disconnects.inc()
        self.metrics.requests.labels("", CLIENT_CLOSED, routed.decision.reason).inc()
        self.request_log.request(
            id=admission.request_id, tenant=routed.request.tenant, replica=None, decision=routed.decision.reason,
            action=routed.decision.action, prompt_tokens=routed.request.prompt_tokens, status=CLIENT_CLOSED,
            e2e_ms=_elapsed_ms(admission),
        )
        return Response(status_code=int(CLIENT_CLOSED))

    def answered(
        self, routed: Routed, admission: Admission, api: Api | None, up: Upstream, result: StreamResult | None
    ) -> None:
        """An answer relayed in full (``result`` for a stream, None for an answer read whole), in ``api``'s form
        (None: a body kvgate does not read, such as embeddings')."""
        if result is None:
            usage = api.usage_of_body(up.body) if up.status == 200 and api is not None else None
            self.completed(routed, admission, up, up.first_byte_at, usage, "ok", stream=False)
        else:
            self.completed(routed, admission, up, result.finished_at, result.usage, result.end, stream=True)

    def completed(
        self, routed: Routed, admission: Admission, up: Upstream, finished_at: float, usage: Usage | None, end: str,
        *, stream: bool,
    ) -> None:
        request = routed.request
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
        if end == "ok" and up.status == 200 and routed.routing is not None:
            avoided_ms = routed.routing.cost_model.prefill_avoided_ms(
                request.prompt_tokens, matched if cached is None else cached
            )
            m.prefill_avoided.inc(avoided_ms / 1000.0)
        if end == "stream_error":
            m.stream_errors.inc()
        elif end == "client_disconnect":
            m.client_disconnects.inc()
        if usage is not None:
            m.prompt_tokens.inc(usage.prompt_tokens)
            m.cached_tokens.inc(cached or 0)
        if stream:
            m.ttft.labels(hit).observe(ttft_ms / 1000.0)
            if end == "ok" and up.status == 200:
                calibrate(routed, up.replica, ttft_ms, usage)
        self.request_log.request(
            id=request.request_id, tenant=request.tenant, model=request.model, replica=up.replica,
            decision=routed.decision.reason, action=routed.decision.action, prompt_tokens=request.prompt_tokens,
            matched_tokens=matched, predicted_tokens=predicted, cached_tokens=cached,
            ttft_ms=round(ttft_ms, 3) if stream else None, e2e_ms=round(e2e_ms, 3), status=status,
            attempts=up.attempts, stream=stream,
        )


def calibrate(routed: Routed, replica: str, ttft_ms: float, usage: Usage | None) -> None:
    """A measured first token as a sample for the model's calibrator (bounded, robust fit): the engine's own token
    counts, or the router's when they are exact. Handoffs (transfers, disaggregated requests) are not prefill samples: their TTFT is a first leg plus a
    KV pull, and engines do not report pulled tokens as cached, so they would read as a whole prompt prefilled
    implausibly fast."""
    calibrator = routed.routing.calibrator if routed.routing is not None else None
    if calibrator is None or routed.decision.action != "route":
        return
    if usage is not None and usage.cached_tokens is not None:
        prompt_tokens, cached_tokens = usage.prompt_tokens, usage.cached_tokens
    elif not routed.request.approximate:
        prompt_tokens, cached_tokens = routed.request.prompt_tokens, routed.matched_tokens(replica)
    else:
        return
    calibrator.observe(prompt_tokens, cached_tokens, ttft_ms, routed.queue_delay_ms(replica))
