"""OpenTelemetry: server span, auth + admission span, one GenAI client span; traceparent out."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from .servers import Upstream

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
INCOMING = f"00-{TRACE_ID}-b7ad6b7169203331-01"


def test_spans_follow_genai_conventions_and_keep_prompts_out(
    span_exporter: InMemorySpanExporter,
    gateway: str,
    make_key: Callable[..., str],
    upstream: tuple[Upstream, str],
) -> None:
    app, _ = upstream
    headers = {"authorization": f"Bearer {make_key()}", "traceparent": INCOMING}
    messages = [{"role": "user", "content": "secret prompt words"}]
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "echo", "messages": messages, "max_tokens": 3, "temperature": 0.5},
        headers=headers,
    )
    assert response.status_code == 200
    expected = {"POST /v1/chat/completions", "gateway.auth_and_admission", "chat echo"}
    # The call's span ends when it settles, which runs beside the response (call.py).
    deadline = time.monotonic() + 5
    while True:
        finished = [
            s for s in span_exporter.get_finished_spans() if s.context.trace_id == int(TRACE_ID, 16)
        ]
        by_name = {s.name: s for s in finished}
        if set(by_name) == expected or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert set(by_name) == expected
    server, client = by_name["POST /v1/chat/completions"], by_name["chat echo"]
    assert server.kind == SpanKind.SERVER
    assert server.attributes["http.response.status_code"] == 200
    assert client.kind == SpanKind.CLIENT
    assert client.parent is not None and client.parent.span_id == server.context.span_id
    attributes = dict(client.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == "echo"
    assert attributes["gen_ai.request.max_tokens"] == 3
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.response.id"] == f"chatcmpl-{response.headers['x-request-id']}"
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (
        4,
        3,
    )
    assert attributes["gen_ai.provider.name"] == "openai"
    for span in finished:
        assert not any("secret" in str(value) for value in (span.attributes or {}).values())
    # The upstream call carries the client span as its parent.
    sent = app.traceparents[-1]
    assert sent is not None and sent.split("-")[1] == TRACE_ID
    assert sent.split("-")[2] == format(client.context.span_id, "016x")


def test_streaming_makes_no_span_per_chunk(
    span_exporter: InMemorySpanExporter, gateway: str, make_key: Callable[..., str]
) -> None:
    span_exporter.clear()
    headers = {"authorization": f"Bearer {make_key()}", "traceparent": INCOMING}
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
        assert len([line for line in r.iter_lines() if line]) == 8
    deadline = time.monotonic() + 2
    while True:  # the client span ends when the request settles, just after the last byte
        finished = [
            s for s in span_exporter.get_finished_spans() if s.context.trace_id == int(TRACE_ID, 16)
        ]
        if len(finished) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert sorted(s.name for s in finished) == [
        "POST /v1/chat/completions",
        "chat echo",
        "gateway.auth_and_admission",
    ]
