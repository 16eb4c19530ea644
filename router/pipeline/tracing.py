"""Tracing's section of the policy file, and whether tracing is on.

Tracing is off unless the policy file's ``tracing.enabled`` is true, or it is unset and the environment names an
OTLP endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``); ``OTEL_SDK_DISABLED=true``
or ``OTEL_TRACES_EXPORTER=none`` turn it off whatever the file says. Only then is the OpenTelemetry SDK imported
(:mod:`.spans`, by :func:`kvgate.router.gateway.start_tracing`): a gateway that does not trace never loads it, and
its stages find no trace on a request.

The section is read at startup: the exporter, its batch processor and the sampler live as long as the process, so a
reload that changes it is logged and takes effect at the next restart.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import Field

from kvgate.policies.section import Section

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


class TracingConfig(Section):
    """Request traces, exported over OTLP (docs/tracing.md); read at startup.

    A field left unset takes the standard ``OTEL_*`` environment variable, then the SDK's default."""

    enabled: bool | None = None
    """On or off; unset: on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set.
    OTEL_SDK_DISABLED=true turns tracing off whatever this says."""
    endpoint: str | None = None
    """The collector's OTLP traces URL, in full (``http://collector:4318/v1/traces``); unset: the environment's
    (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT + ``/v1/traces``), else localhost:4318."""
    service_name: str | None = None
    """The ``service.name`` of kvgate's spans; unset: OTEL_SERVICE_NAME, else ``kvgate``."""
    sample_ratio: float | None = Field(None, ge=0, le=1)
    """The share of new traces (requests that came without a ``traceparent``) that are recorded. Unset, with
    ``parent_based`` true: OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG, else every trace."""
    parent_based: bool = True
    """Honour the client's sampled flag: a request whose ``traceparent`` says sampled is recorded, one that says not
    is not. False: every request is sampled at ``sample_ratio`` (1 when unset), whatever the client asks — for a
    gateway facing clients who could otherwise make it record every request."""
    record_content: bool = False
    """Record prompts and the answers read whole as a ``gen_ai.client.inference.operation.details`` event on each
    request's span. Off: no prompt or completion text is in any span."""
    export_timeout_s: float | None = Field(None, gt=0)
    """How long one export to the collector may take; unset: OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, else 10 s."""
    max_export_batch_size: int | None = Field(None, ge=1, le=2048)
    """Spans per export, at most the export queue's size (OTEL_BSP_MAX_QUEUE_SIZE, 2048 by default); unset:
    OTEL_BSP_MAX_EXPORT_BATCH_SIZE, else 512."""


def tracing_on(config: TracingConfig, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the gateway traces requests, from the policy file's section and the standard variables."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    if config.enabled is not None:
        return config.enabled
    return config.endpoint is not None or any(environ.get(name) for name in ENDPOINT_VARIABLES)
