"""The Batch API on a real engine worker (the tiny random model) and an OpenAI-compatible test
upstream, through the official SDKs, against gateway processes: every output line is what the
live endpoint answers for the same request (greedy); a gateway killed mid-batch leaves every
line ending exactly once, and the usage rows equal the served lines."""

from __future__ import annotations

import io
import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0, "ignore_eos": True}


class _Upstream(BaseHTTPRequestHandler):
    """Answers a chat completion with the words of its last message, reversed."""

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        words = str(body["messages"][-1]["content"]).split()
        payload = {
            "id": "up-1",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": " ".join(reversed(words))},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": len(words), "completion_tokens": len(words),
                      "total_tokens": 2 * len(words)},
        }  # fmt: skip
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.fixture(scope="module")
def batch_database_url(admin_database_url: str, tools: SimpleNamespace) -> Iterator[str]:
    """A database of this module's own: every gateway on a database runs its batches' lines,
    and the session's other gateways route other models."""
    url, drop = tools.new_database(admin_database_url)
    yield url
    drop()


@pytest.fixture(scope="module")
def setup(
    cluster: Any,
    batch_database_url: str,
    redis_url: str,
    upstream: str,
    tools: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> SimpleNamespace:
    engine_model = tools.model_name("e2e-batch")
    config = {
        "models": [
            {"name": engine_model, "deployments": [{"provider": "engine", "model": engine_model}]},
            {"name": "reverser", "deployments": [
                {"provider": "openai", "base_url": upstream, "model": "up"}]},
        ]
    }  # fmt: skip
    config_path = tmp_path_factory.mktemp("routing") / "models.yaml"
    config_path.write_text(json.dumps(config))
    cluster.worker(engine_model, redis_url)
    shared = {
        "config": str(config_path),
        "usage_stream": f"sg:usage:e2e:{uuid.uuid4().hex[:8]}",
        "lease_s": "3",
        "batch_claim_s": "3",
    }
    process = cluster.gateway(batch_database_url, redis_url, **shared)
    url = f"http://127.0.0.1:{process.port}"
    key, key_id = tools.create_key(url, f"e2e-batch-{uuid.uuid4().hex[:6]}")
    gateway = tools.Gateway(process, batch_database_url, key, key_id)
    gateway.wait_model(engine_model)
    return SimpleNamespace(gateway=gateway, model=engine_model, shared=shared)


def _lines(endpoint: str, bodies: list[dict[str, Any]]) -> bytes:
    return b"".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": b}).encode()
        + b"\n"
        for i, b in enumerate(bodies)
    )


def _wait(client: Any, batch_id: str, timeout: float = 180.0) -> Any:
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in (
        "completed", "failed", "expired", "cancelled",
    ):  # fmt: skip
        assert time.monotonic() < deadline, batch
        time.sleep(0.3)
    return batch


def _output(client: Any, batch: Any) -> list[dict[str, Any]]:
    text = client.files.content(batch.output_file_id).text if batch.output_file_id else ""
    return [json.loads(line) for line in text.splitlines()]


def _submit(client: Any, endpoint: str, bodies: list[dict[str, Any]]) -> Any:
    uploaded = client.files.create(
        file=("in.jsonl", io.BytesIO(_lines(endpoint, bodies))), purpose="batch"
    )
    return client.batches.create(
        input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h"
    )


def _answer(body: dict[str, Any]) -> Any:
    """What is compared: the choices and the token counts (ids and times differ)."""
    usage = body["usage"]
    return body["choices"], usage["prompt_tokens"], usage["completion_tokens"]


def test_openai_sdk_round_trip_on_the_engine_and_an_upstream(setup: SimpleNamespace) -> None:
    client = setup.gateway.openai(max_retries=0, timeout=60)
    chat = [
        {"model": setup.model, "messages": [{"role": "user", "content": f"Story {i}"}],
         "max_tokens": 6 + i, **GREEDY}
        for i in range(3)
    ] + [{"model": "reverser", "messages": [{"role": "user", "content": "one two three"}]}]  # fmt: skip
    completions = [
        {"model": setup.model, "prompt": f"Once {i}", "max_tokens": 5, **GREEDY} for i in range(2)
    ]
    for endpoint, bodies in (("/v1/chat/completions", chat), ("/v1/completions", completions)):
        batch = _wait(client, _submit(client, endpoint, bodies).id)
        assert batch.status == "completed" and batch.request_counts.failed == 0, batch
        output = _output(client, batch)
        assert [line["custom_id"] for line in output] == [f"r{i}" for i in range(len(bodies))]
        create = client.chat.completions if "chat" in endpoint else client.completions
        for line, body in zip(output, bodies, strict=True):
            sent = {k: v for k, v in body.items() if k != "ignore_eos"}
            extra = {"ignore_eos": True} if "ignore_eos" in body else None
            live = create.with_raw_response.create(**sent, extra_body=extra)
            assert _answer(line["response"]["body"]) == _answer(json.loads(live.text))


def test_anthropic_sdk_message_batch_on_the_engine(setup: SimpleNamespace) -> None:
    import anthropic

    claude = anthropic.Anthropic(
        base_url=setup.gateway.base_url, api_key=setup.gateway.api_key, max_retries=0
    )
    params = [
        {"model": setup.model, "max_tokens": 6, "temperature": 0.0,
         "messages": [{"role": "user", "content": f"Tell me about {i}"}]}
        for i in range(3)
    ]  # fmt: skip
    batch = claude.messages.batches.create(
        requests=[{"custom_id": f"m{i}", "params": p} for i, p in enumerate(params)]  # type: ignore[misc]
    )
    deadline = time.monotonic() + 180
    while (batch := claude.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert batch.request_counts.succeeded == 3
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    for i, p in enumerate(params):
        sent = {k: v for k, v in p.items() if k != "temperature"}
        live = claude.messages.create(**sent, extra_body={"temperature": 0.0})  # type: ignore[arg-type]
        result = results[f"m{i}"]
        assert result.type == "succeeded"
        assert result.message.content == live.content
        assert result.message.usage.output_tokens == live.usage.output_tokens


def test_killed_gateway_mid_batch_every_line_ends_once(
    setup: SimpleNamespace, cluster: Any, redis_url: str, tools: Any
) -> None:
    database_url = setup.gateway.database_url
    victim = cluster.gateway(database_url, redis_url, **setup.shared, batch_concurrency="4")
    url = f"http://127.0.0.1:{victim.port}"
    key, key_id = tools.create_key(url, f"e2e-batch-kill-{uuid.uuid4().hex[:6]}")
    gateway = tools.Gateway(victim, database_url, key, key_id)
    gateway.wait_model(setup.model)
    # Both gateways run lines: the victim holds up to four when it is killed.
    client = gateway.openai(max_retries=0, timeout=60)
    bodies = [
        {"model": setup.model, "messages": [{"role": "user", "content": f"Line {i}"}],
         "max_tokens": 48, **GREEDY}
        for i in range(12)
    ]  # fmt: skip
    batch = _submit(client, "/v1/chat/completions", bodies)
    tools.wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 2,
        timeout=120,
        what="two lines done",
        interval=0.05,
    )
    victim.stop(signal.SIGKILL)
    watcher = tools.Gateway(setup.gateway.process, database_url, key, key_id)
    survivor = watcher.openai(max_retries=0, timeout=60)
    batch = _wait(survivor, batch.id)
    assert batch.status == "completed", batch
    output = _output(survivor, batch)
    assert sorted(line["custom_id"] for line in output) == sorted(f"r{i}" for i in range(12))
    assert batch.error_file_id is None
    served = {line["response"]["request_id"] for line in output}
    watcher.wait_usage_rows(12)
    time.sleep(1.0)  # any late row (a reaped lease) has landed too
    rows = watcher.usage_rows()
    by_request = {row["request_id"]: row for row in rows}
    # One ok row per served line, billed what the line reports (committed with the line).
    assert {rid for rid, row in by_request.items() if row["status"] == "ok"} == served
    for line in output:
        row = by_request[line["response"]["request_id"]]
        usage = line["response"]["body"]["usage"]
        assert (row["prompt_tokens"], row["completion_tokens"]) == (
            usage["prompt_tokens"],
            usage["completion_tokens"],
        ), row
    # Requests the victim had under way when it died: settled by the reaper, nothing served.
    for request_id, row in by_request.items():
        if request_id not in served:
            assert row["prompt_tokens"] + row["completion_tokens"] == 0, row


def test_killed_worker_mid_batch_every_line_ends_once(
    setup: SimpleNamespace, cluster: Any, redis_url: str, reference: Any, tools: Any
) -> None:
    # A second worker of the module's model, killed mid-batch; the first one survives. Every
    # gateway on this database runs batch lines, so the model is one they all route.
    options = ("--max-num-seqs", "2", "--heartbeat-ttl", "2")
    victim = cluster.worker(setup.model, redis_url, *options)
    url = setup.gateway.base_url
    key, key_id = tools.create_key(url, f"e2e-batch-wkill-{uuid.uuid4().hex[:6]}")
    gateway = tools.Gateway(setup.gateway.process, setup.gateway.database_url, key, key_id)
    client = gateway.openai(max_retries=0, timeout=60)
    model = setup.model
    prompts = [f"Worker line {i}" for i in range(8)]
    bodies = [
        {"model": model, "messages": [{"role": "user", "content": p}], "max_tokens": 64, **GREEDY}
        for p in prompts
    ]
    batch = _submit(client, "/v1/chat/completions", bodies)
    tools.wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1,
        timeout=120,
        what="a line done",
        interval=0.05,
    )
    victim.stop(signal.SIGKILL)
    batch = _wait(client, batch.id)
    assert batch.status == "completed", batch
    output = _output(client, batch)
    error_text = client.files.content(batch.error_file_id).text if batch.error_file_id else ""
    errors = [json.loads(line) for line in error_text.splitlines()]
    ids = sorted(line["custom_id"] for line in output + errors)
    assert ids == sorted(f"r{i}" for i in range(8)), ids
    wants = reference.chat_many(prompts, 64)
    for line in output:  # greedy, resumed or not: the offline answer
        want = wants[int(line["custom_id"][1:])]
        assert line["response"]["body"]["choices"][0]["message"]["content"] == want.text
    served = {line["response"]["request_id"] for line in output}
    gateway.wait_usage_rows(len(served))
    time.sleep(1.0)  # a late row, were there one, has landed too
    ok = {row["request_id"] for row in gateway.usage_rows() if row["status"] == "ok"}
    assert ok == served
