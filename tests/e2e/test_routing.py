"""The API's routing over our engine pool: a model alias reaches the workers, and when no worker
is alive the same model falls back to its ``openai`` deployment (a real local HTTP upstream)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(180)

UPSTREAM_TEXT = "the upstream answered"


class _Upstream(BaseHTTPRequestHandler):
    """Answers every chat completion with ``UPSTREAM_TEXT``, streaming or not."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        common = {"id": "up-1", "created": 1, "model": body["model"]}
        if not body.get("stream"):
            payload = {
                **common,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": UPSTREAM_TEXT},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
            data = json.dumps(payload).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        chunks = [
            {"index": 0, "delta": {"content": word}, "finish_reason": None}
            for word in UPSTREAM_TEXT.split(" ")
        ]
        for i, choice in enumerate(chunks):
            if i:
                choice["delta"]["content"] = " " + choice["delta"]["content"]
            event = {**common, "object": "chat.completion.chunk", "choices": [choice]}
            self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        last = {"index": 0, "delta": {}, "finish_reason": "stop"}
        event = {**common, "object": "chat.completion.chunk", "choices": [last], "usage": usage}
        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def routed(
    cluster: Any,
    e2e_database_url: str,
    redis_url: str,
    upstream: str,
    tools: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> SimpleNamespace:
    engine_model = tools.model_name("e2e-route")
    public, alias = f"{engine_model}-public", f"{engine_model}-alias"
    config = {
        "models": [
            {
                "name": public,
                "aliases": [alias],
                "deployments": [
                    # The pool is preferred while it has a live worker.
                    {"provider": "engine", "model": engine_model, "weight": 1000},
                    {"provider": "openai", "base_url": upstream, "model": "up", "weight": 0.001},
                ],
            }
        ]
    }
    config_path = tmp_path_factory.mktemp("routing") / "models.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    worker = cluster.worker(engine_model, redis_url)
    process = cluster.gateway(e2e_database_url, redis_url, config=str(config_path))
    key, key_id = tools.create_key(f"http://127.0.0.1:{process.port}", "e2e-routing")
    gateway = tools.Gateway(process, e2e_database_url, key, key_id)
    return SimpleNamespace(gateway=gateway, worker=worker, public=public, alias=alias)


def _ask(client: Any, model: str, stream: bool) -> str:
    kwargs: dict[str, Any] = {
        "max_tokens": 12,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    messages = [{"role": "user", "content": "Where does the river go?"}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, **kwargs)
        return reply.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=model, messages=messages, stream=True, **kwargs)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_alias_reaches_the_engine_pool_then_falls_back_to_openai_when_no_worker_is_left(
    routed: SimpleNamespace, reference: Any, tools: SimpleNamespace
) -> None:
    client = routed.gateway.openai(max_retries=0, timeout=30)
    want = reference.chat("Where does the river go?", 12).text
    tools.wait_until(
        lambda: _ask(client, routed.alias, stream=False) == want,
        timeout=20,
        what="the alias to be served by the engine worker",
        interval=0.3,
    )
    assert _ask(client, routed.alias, stream=True) == want
    assert _ask(client, routed.public, stream=False) == want

    routed.worker.stop()  # graceful: its heartbeat disappears at once
    tools.wait_until(
        lambda: _ask(client, routed.alias, stream=False) == "the upstream answered",
        timeout=15,
        what="the fallback to the openai deployment",
        interval=0.3,
    )
    assert _ask(client, routed.alias, stream=True) == "the upstream answered"
    models = client.models.list()
    assert routed.public in {m.id for m in models.data}
