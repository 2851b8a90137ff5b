"""OpenTelemetry spans of an engine worker: one per request, with queue, prefill and decode.

The spans are made once a request has finished, from the times the engine recorded, with
explicit start and end times: no span work per step or per token. They continue the gateway's
trace through the W3C ``traceparent`` the request carries, so the gateway's ``chat {model}``
span is their parent. Spans are exported over OTLP/HTTP only when
``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (or the process installed a tracer provider of its own);
otherwise nothing is recorded. No prompt or completion text ever goes into these spans.
"""

from __future__ import annotations

import os
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sluicegate.engine import protocol

_configured = False
_PROPAGATOR = TraceContextTextMapPropagator()


def setup_otlp_tracing(service_name: str) -> bool:
    """Install an OTLP-exporting tracer provider once, if an OTLP endpoint is configured.

    Torch-free, like the protocol: the gateway uses it too, so both sides export alike."""
    global _configured
    if _configured or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _configured
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The provider flushes its batch processor at interpreter exit, so a draining worker
    # still exports the spans of its last requests.
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True
    return True


def tracing_enabled() -> bool:
    """Whether spans are recorded: our OTLP setup ran, or the process installed its own
    provider (e.g. ``opentelemetry-instrument`` or a test's in-memory exporter)."""
    return _configured or not isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    )


class RequestTracer:
    """Makes a finished request's spans; a no-op unless tracing is enabled."""

    def __init__(self, model_name: str, worker_id: str) -> None:
        setup_otlp_tracing("sluicegate-engine")
        self.model_name = model_name
        self.worker_id = worker_id
        self._tracer = trace.get_tracer("sluicegate.engine")

    def request_finished(self, request: protocol.Request, pulled_at: float, final: Any) -> None:
        """``pulled_at`` is when the worker read the request (``time.monotonic()``); ``final``
        the engine's last delta, whose ``timings`` and ``usage`` the spans are made of."""
        if not tracing_enabled():
            return
        now_mono = time.monotonic()
        offset_ns = time.time_ns() - int(now_mono * 1e9)

        def wall(monotonic: float) -> int:
            return int(monotonic * 1e9) + offset_ns

        timings = getattr(final, "timings", None)
        finished = timings.finished if timings is not None else now_mono
        context = (
            _PROPAGATOR.extract({"traceparent": request.traceparent})
            if request.traceparent
            else None
        )
        reason = getattr(final, "finish_reason", None)
        usage = getattr(final, "usage", None)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if request.messages is not None else "text_completion",
            "gen_ai.provider.name": "sluicegate",
            "gen_ai.request.model": request.model,
            "gen_ai.response.model": self.model_name,
            "gen_ai.request.max_tokens": request.sampling.max_tokens,
            "gen_ai.request.temperature": request.sampling.temperature,
            "gen_ai.response.finish_reasons": [reason] if reason else [],
            "sluicegate.request_id": request.request_id,
            "sluicegate.worker_id": self.worker_id,
        }
        if usage is not None:
            attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
            attributes["gen_ai.usage.cache_read.input_tokens"] = usage.cached_tokens
        if timings is not None:
            attributes["sluicegate.num_preemptions"] = timings.num_preemptions
        span = self._tracer.start_span(
            "engine.request",
            context=context,
            kind=SpanKind.SERVER,
            attributes=attributes,
            start_time=wall(pulled_at),
        )
        parent = trace.set_span_in_context(span)
        scheduled = timings.first_scheduled if timings is not None else None
        first_token = timings.first_token if timings is not None else None
        # Each phase runs until the next one starts, or until the request ended in it.
        phases = (
            ("engine.queue", pulled_at, scheduled or finished),
            ("engine.prefill", scheduled, first_token or finished),
            ("engine.decode", first_token, finished),
        )
        for name, start, end in phases:
            if start is None:
                break
            child = self._tracer.start_span(name, context=parent, start_time=wall(start))
            child.end(end_time=wall(max(start, end)))
        span.end(end_time=wall(finished))
