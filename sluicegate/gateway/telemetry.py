"""Prometheus metrics and OpenTelemetry tracing of the gateway.

Metrics live in one registry of our own (so several apps in one test process do not clash
on the global one) and are served at ``/metrics``. Tracing exports over OTLP only when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; otherwise the OpenTelemetry API's no-op tracer keeps
the request path free of span work. Spans: the HTTP server span, one for auth + rate
limiting, and a CLIENT span ``chat {model}`` per generation with the GenAI semantic
conventions — never a span per streamed chunk, and prompts only with
``otel_capture_content``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIServer

from litestar import Response, get
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Tracer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)

from sluicegate.engine.tracing import setup_otlp_tracing
from sluicegate.gateway.settings import Settings

logger = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "sluicegate_requests",
    "Generation requests answered, by public model and outcome.",
    ["model", "status"],
    registry=REGISTRY,
)
ADDED_LATENCY = Histogram(
    "sluicegate_added_latency_seconds",
    "Time the gateway itself spent on a request (total minus time waiting on the provider).",
    buckets=(0.0005, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5),
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "sluicegate_time_to_first_token_seconds",
    "From request arrival to the first generated token.",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
TOKENS = Counter(
    "sluicegate_tokens",
    "Tokens billed, by public model and kind (prompt | completion).",
    ["model", "kind"],
    registry=REGISTRY,
)
REJECTIONS = Counter(
    "sluicegate_rejections",
    "Requests refused by admission (rate_limit_requests | rate_limit_tokens | concurrency | quota).",
    ["reason"],
    registry=REGISTRY,
)
SPECULATIVE_DISPATCHES = Counter(
    "sluicegate_speculative_dispatches",
    "Requests sent upstream while their admission was in Redis, by outcome (admitted | "
    "refused: the upstream call was cancelled and its answer dropped).",
    ["outcome"],
    registry=REGISTRY,
)
UPSTREAM_ERRORS = Counter(
    "sluicegate_upstream_errors",
    "Failed calls to a deployment.",
    ["deployment"],
    registry=REGISTRY,
)
USAGE_FLUSH_LAG = Gauge(
    "sluicegate_usage_flush_lag_seconds",
    "Age of the oldest usage record not yet committed to PostgreSQL.",
    registry=REGISTRY,
)


@dataclass(frozen=True, slots=True)
class ModelMetrics:
    """A model's labelled series, resolved once (``labels()`` costs a lock and a lookup)."""

    ok: Counter
    error: Counter
    cancelled: Counter
    prompt_tokens: Counter
    completion_tokens: Counter
    time_to_first_token: Histogram

    def requests(self, status: str) -> Counter:
        return self.ok if status == "ok" else self.error if status == "error" else self.cancelled


@functools.lru_cache(maxsize=4096)
def model_metrics(model: str) -> ModelMetrics:
    """Only models the router resolved get here, so the label set stays bounded."""
    return ModelMetrics(
        ok=REQUESTS.labels(model, "ok"),
        error=REQUESTS.labels(model, "error"),
        cancelled=REQUESTS.labels(model, "cancelled"),
        prompt_tokens=TOKENS.labels(model, "prompt"),
        completion_tokens=TOKENS.labels(model, "completion"),
        time_to_first_token=TIME_TO_FIRST_TOKEN.labels(model),
    )


@get("/metrics", include_in_schema=False, sync_to_thread=False)
def metrics_endpoint() -> Response[bytes]:
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def serve_metrics(settings: Settings) -> WSGIServer | None:
    """``/metrics`` on ``settings.metrics_port`` (no auth: keep the port off the public
    network); None, logged, when the port is taken (e.g. by another worker process)."""
    try:
        server, _ = start_http_server(
            settings.metrics_port, addr=settings.metrics_host, registry=REGISTRY
        )
    except OSError as exc:
        logger.warning(
            "metrics port %d unavailable (%s); set SLUICEGATE_METRICS_PORT to a free one",
            settings.metrics_port,
            exc,
        )
        return None
    return server


# ---- tracing ---------------------------------------------------------------------------------


def setup_tracing() -> bool:
    """Export the gateway's spans over OTLP when an endpoint is configured."""
    return setup_otlp_tracing("sluicegate-gateway")


_TRACER = trace.get_tracer("sluicegate.gateway")
"""A proxy until a provider is installed, then it delegates to that provider's tracer."""


def tracer() -> Tracer:
    return _TRACER


def start_server_span(name: str, headers: Mapping[str, str], start_time: int) -> Span:
    """The HTTP server span, continuing the caller's trace when it sent ``traceparent``."""
    context = propagate.extract(headers) if "traceparent" in headers else None
    return tracer().start_span(name, context=context, kind=SpanKind.SERVER, start_time=start_time)


def child_context(parent: Span | None) -> Context | None:
    return trace.set_span_in_context(parent) if parent is not None else None


def current_traceparent() -> str | None:
    """W3C ``traceparent`` of the current span, for the engine request; None when not tracing."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def genai_request_attributes(
    operation: str, provider: str, model: str, max_tokens: int, temperature: float
) -> dict[str, Any]:
    return {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": provider,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": max_tokens,
        "gen_ai.request.temperature": temperature,
    }


def genai_response_attributes(
    response_id: str, finish_reason: str | None, input_tokens: int, output_tokens: int
) -> dict[str, Any]:
    return {
        "gen_ai.response.id": response_id,
        "gen_ai.response.finish_reasons": [finish_reason] if finish_reason else [],
        "gen_ai.usage.input_tokens": input_tokens,
        "gen_ai.usage.output_tokens": output_tokens,
    }
