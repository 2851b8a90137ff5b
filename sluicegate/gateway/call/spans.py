"""What a call's spans say: ``gateway.auth_and_admission`` (auth and admission, begun when the
guard began authenticating) and the GenAI client span ``{operation} {model}`` (what was asked;
once settled, what was answered and by which kind of deployment).

Only made when tracing is on: ``admit`` starts no span at all otherwise (even a no-op one
costs a context and a propagation), and settlement records nothing on ``INVALID_SPAN``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from sluicegate.gateway.canonical import ChatRequest, Usage
from sluicegate.gateway.schemas.wire import encode
from sluicegate.gateway.telemetry import (
    current_traceparent,
    genai_request_attributes,
    genai_response_attributes,
    tracer,
)

if TYPE_CHECKING:
    from sluicegate.gateway.call.state import CallState


def start_admission_span(parent: Context | None, auth_started_ns: int) -> Span:
    return tracer().start_span(
        "gateway.auth_and_admission", context=parent, start_time=auth_started_ns
    )


def start_generation_span(
    parent: Context | None,
    body: ChatRequest,
    *,
    operation: str,
    model: str,
    max_tokens: int,
    capture_content: bool,
) -> Span:
    """The call's GenAI span, and ``body.traceparent`` naming it for the upstream."""
    span = tracer().start_span(f"{operation} {model}", context=parent, kind=SpanKind.CLIENT)
    if span.is_recording():
        temperature = body.sampling.temperature
        span.set_attributes(
            genai_request_attributes(
                operation,
                "sluicegate",
                model,
                max_tokens,
                1.0 if temperature is None else temperature,
            )
        )
        if capture_content:
            content = body.messages if body.messages is not None else body.prompt
            span.set_attribute("gen_ai.input.messages", encode(content).decode())
    with trace.use_span(span, end_on_exit=False):
        body.traceparent = current_traceparent()
    return span


def record_outcome(call: CallState, usage: Usage) -> None:
    """The settled call's answer on its (recording) GenAI span."""
    span = call.span
    span.set_attributes(
        genai_response_attributes(
            call.response_id, call.finish_reason, usage.prompt_tokens, usage.completion_tokens
        )
    )
    if call.deployment is not None:
        # Known only now: the deployment that served ("openai" for HTTP upstreams).
        provider = "openai" if call.deployment.kind == "openai" else "sluicegate"
        span.set_attribute("gen_ai.provider.name", provider)
    if call.status != "ok":
        span.set_attribute("error.type", call.status)
