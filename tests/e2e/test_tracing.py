"""One streamed chat completion through a gateway and a real engine worker makes one trace.

The gateway runs in this process with an in-memory span exporter; the worker is a separate
process that exports over OTLP/HTTP (its real export path) to a small collector here, which
decodes the protobuf ``ExportTraceServiceRequest`` it receives.
"""

from __future__ import annotations

import gzip
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

pytestmark = pytest.mark.timeout(180)

PROMPT = "secret words about the river gate"
MAX_TOKENS = 5


class Collector:
    """An OTLP/HTTP trace receiver on 127.0.0.1 that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, OtlpSpan]] = []
        """(service.name, span) pairs."""
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                collector._receive(self.path, body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _receive(self, path: str, body: bytes) -> None:
        assert path == "/v1/traces", path
        request = ExportTraceServiceRequest.FromString(body)
        with self._lock:
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes).get("service.name")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)

    def trace(self, trace_id: int) -> list[tuple[str, OtlpSpan]]:
        with self._lock:
            return [(s, span) for s, span in self.spans if int(span.trace_id.hex(), 16) == trace_id]

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(v) for v in value.array_value.values)
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class ServerThread:
    """The gateway app under uvicorn in a background thread of this process."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.server.should_exit = True
        self._thread.join(15)


@pytest.fixture(scope="module")
def traced(
    cluster: Any,
    e2e_database_url: str,
    redis_url: str,
    tools: SimpleNamespace,
    span_exporter: InMemorySpanExporter,
) -> Iterator[SimpleNamespace]:
    from sluicegate.gateway.app import create_asgi_app
    from sluicegate.gateway.settings import Settings

    model = tools.model_name("e2e-trace")
    with Collector() as collector:
        # Only the worker process sees the endpoint: the gateway here records in memory.
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint)
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
            cluster.worker(model, redis_url)
        master_key = "sk-admin-trace-" + uuid.uuid4().hex
        settings = Settings.from_env(
            database_url=e2e_database_url,
            redis_url=redis_url,
            master_key=master_key,
            config="",
            usage_stream=f"sg:usage:e2e-trace:{uuid.uuid4().hex[:8]}",
            run_usage_flusher=False,
            worker_heartbeat_ttl_s=3.0,
        )
        with ServerThread(create_asgi_app(settings)) as server:
            base_url = f"http://127.0.0.1:{server.port}"
            response = httpx.post(
                f"{base_url}/admin/keys",
                headers={"Authorization": f"Bearer {master_key}"},
                json={"name": "e2e-trace"},
                timeout=10,
            )
            assert response.status_code == 201, response.text
            api_key = response.json()["key"]

            def listed() -> bool:
                models = httpx.get(
                    f"{base_url}/v1/models",
                    headers={"Authorization": f"Bearer {api_key}"},
                    timeout=5,
                )
                return models.status_code == 200 and any(
                    m["id"] == model for m in models.json()["data"]
                )

            tools.wait_until(listed, 30, f"model {model} in /v1/models", interval=0.2)
            yield SimpleNamespace(
                model=model, base_url=base_url, api_key=api_key, collector=collector
            )
        with redis.Redis.from_url(redis_url) as client:
            client.delete(settings.usage_stream)


def _wait_for(what: str, found: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while (value := found()) is None:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def test_one_trace_holds_gateway_and_engine_spans(
    traced: SimpleNamespace, span_exporter: InMemorySpanExporter, tiny_model_dir: Path
) -> None:
    from openai import OpenAI

    from sluicegate.engine.text.tokenizer import Tokenizer

    messages = [{"role": "user", "content": PROMPT}]
    prompt_tokens = len(Tokenizer(tiny_model_dir).apply_chat_template(messages))
    client = OpenAI(base_url=f"{traced.base_url}/v1", api_key=traced.api_key, max_retries=0)
    stream = client.chat.completions.with_raw_response.create(
        model=traced.model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    request_id = stream.headers["x-request-id"]
    chunks = list(stream.parse())
    usage = chunks[-1].usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, MAX_TOKENS)

    def gateway_trace() -> list[ReadableSpan] | None:
        # The client span ends when the request settles, just after the last byte.
        spans = [s for s in span_exporter.get_finished_spans() if s.name == f"chat {traced.model}"]
        if not spans:
            return None
        trace_id = spans[-1].context.trace_id
        return [s for s in span_exporter.get_finished_spans() if s.context.trace_id == trace_id]

    gateway = {s.name: s for s in _wait_for("the gateway's spans", gateway_trace)}
    assert set(gateway) == {
        "POST /v1/chat/completions",
        "gateway.auth_and_admission",
        f"chat {traced.model}",
    }
    server = gateway["POST /v1/chat/completions"]
    admission = gateway["gateway.auth_and_admission"]
    chat = gateway[f"chat {traced.model}"]
    trace_id = server.context.trace_id
    assert server.kind == SpanKind.SERVER and server.parent is None
    assert admission.parent is not None and admission.parent.span_id == server.context.span_id
    assert chat.kind == SpanKind.CLIENT
    assert chat.parent is not None and chat.parent.span_id == server.context.span_id
    attributes = dict(chat.attributes or {})
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "sluicegate"
    assert attributes["gen_ai.request.model"] == traced.model
    assert attributes["gen_ai.request.max_tokens"] == MAX_TOKENS
    assert attributes["gen_ai.request.temperature"] == 0
    assert attributes["gen_ai.response.id"] == f"chatcmpl-{request_id}"
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["gen_ai.usage.input_tokens"] == prompt_tokens
    assert attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS

    def engine_trace() -> dict[str, tuple[str, OtlpSpan]] | None:
        spans = traced.collector.trace(trace_id)
        return {span.name: (service, span) for service, span in spans} if len(spans) >= 4 else None

    engine = _wait_for("the worker's spans at the collector", engine_trace)
    assert set(engine) == {"engine.request", "engine.queue", "engine.prefill", "engine.decode"}
    assert len(traced.collector.trace(trace_id)) == 4, "one request makes exactly four spans"
    assert {service for service, _ in engine.values()} == {"sluicegate-engine"}
    request = engine["engine.request"][1]
    # The engine's request span continues the gateway's client span (via traceparent).
    assert int(request.parent_span_id.hex(), 16) == chat.context.span_id
    assert request.kind == OtlpSpan.SpanKind.SPAN_KIND_SERVER
    engine_attributes = _attributes(request.attributes)
    assert engine_attributes["sluicegate.request_id"] == request_id
    assert engine_attributes["gen_ai.request.model"] == traced.model
    assert engine_attributes["gen_ai.usage.input_tokens"] == prompt_tokens
    assert engine_attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert engine_attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert engine_attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert engine_attributes["sluicegate.num_preemptions"] == 0
    phases = [engine[name][1] for name in ("engine.queue", "engine.prefill", "engine.decode")]
    for phase in phases:
        assert phase.parent_span_id == request.span_id
        assert request.start_time_unix_nano <= phase.start_time_unix_nano
        assert phase.start_time_unix_nano <= phase.end_time_unix_nano
        assert phase.end_time_unix_nano <= request.end_time_unix_nano
    # Back to back: each phase starts where the one before it ended.
    assert phases[0].start_time_unix_nano == request.start_time_unix_nano
    assert phases[0].end_time_unix_nano == phases[1].start_time_unix_nano
    assert phases[1].end_time_unix_nano == phases[2].start_time_unix_nano
    assert phases[2].end_time_unix_nano == request.end_time_unix_nano
    # The engine ran within the gateway's client span.
    assert chat.start_time <= request.start_time_unix_nano
    assert request.end_time_unix_nano <= chat.end_time
    # No span carries the prompt's words.
    every_value = [str(v) for s in gateway.values() for v in (s.attributes or {}).values()]
    every_value += [str(v) for _, s in engine.values() for v in _attributes(s.attributes).values()]
    assert not any("secret" in value for value in every_value)


def test_a_request_aborted_in_the_queue_has_only_a_queue_phase(
    span_exporter: InMemorySpanExporter,
) -> None:
    from sluicegate.engine import protocol
    from sluicegate.engine.protocol import Usage
    from sluicegate.engine.serving.request_delta import RequestDelta, RequestTimings
    from sluicegate.engine.tracing import RequestTracer

    span_exporter.clear()
    now = time.monotonic()
    final = RequestDelta(
        "queued-1",
        finish_reason="abort",
        usage=Usage(7, 0),
        timings=RequestTimings(
            arrival=now - 0.2, first_scheduled=None, first_token=None, finished=now,
            num_preemptions=0,
        ),
    )  # fmt: skip
    request = protocol.Request(request_id="queued-1", model="m", prompt="x")
    RequestTracer("m", "w1").request_finished(request, now - 0.25, final)
    spans = {s.name: s for s in span_exporter.get_finished_spans()}
    assert set(spans) == {"engine.request", "engine.queue"}
    root, queue = spans["engine.request"], spans["engine.queue"]
    assert root.parent is None, "without a traceparent the engine starts a trace of its own"
    assert queue.parent is not None and queue.parent.span_id == root.context.span_id
    assert queue.end_time == root.end_time
    assert 0.24e9 < root.end_time - root.start_time < 0.26e9
    assert root.attributes is not None
    assert root.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert root.attributes["gen_ai.usage.output_tokens"] == 0


def test_no_tracing_without_an_otlp_endpoint(tools: SimpleNamespace) -> None:
    import subprocess
    import sys

    env = tools.base_env()
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    check = (
        "from sluicegate.engine.tracing import RequestTracer, tracing_enabled\n"
        "RequestTracer('m', 'w')\n"
        "assert not tracing_enabled()\n"
    )
    subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=60)
