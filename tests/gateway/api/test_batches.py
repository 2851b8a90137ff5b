"""The Batch API through the official SDKs against a served gateway and its real upstream:
OpenAI's files + batches round trip and Anthropic's message batches, each batch line answered
as the live endpoint answers the same request; owners only; a budget shared with live traffic
ends exactly at its size; cancel stops what has not started."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(120)


def sdk(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def wait_batch(client: openai.OpenAI, batch_id: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.2)


def run_batch(client: openai.OpenAI, endpoint: str, bodies: list[dict[str, Any]]) -> Any:
    lines = [
        {"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body}
        for i, body in enumerate(bodies)
    ]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window="24h",  # type: ignore[arg-type]
    )
    assert batch.status == "in_progress" and batch.request_counts.total == len(bodies)
    return wait_batch(client, batch.id)


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def comparable(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(
    ("endpoint", "make_body"),
    [
        (
            "/v1/chat/completions",
            lambda i: {"model": "echo", "messages": [{"role": "user", "content": f"hi {i}"}],
                       "max_tokens": i + 1},
        ),
        ("/v1/completions", lambda i: {"model": "echo", "prompt": f"say {i}", "max_tokens": 2}),
        ("/v1/embeddings", lambda i: {"model": "embed", "input": ["a" * (i + 1)]}),
    ],
    ids=["chat", "completions", "embeddings"],
)  # fmt: skip
def test_openai_round_trip_matches_live_answers(
    gateway: str, make_key: Callable[..., str], endpoint: str, make_body: Callable[[int], Any]
) -> None:
    client = sdk(gateway, make_key())
    bodies = [make_body(i) for i in range(4)]
    batch = run_batch(client, endpoint, bodies)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 0)
    assert batch.error_file_id is None
    output = read_lines(client, batch.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(4)]
    for line, body in zip(output, bodies, strict=True):
        live = httpx.post(
            f"{gateway}{endpoint}", json=body, headers={"authorization": f"Bearer {client.api_key}"}
        )
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["request_id"]
        assert comparable(line["response"]["body"]) == comparable(live.json())


def test_bad_lines_fail_the_batch_naming_each(gateway: str, make_key: Callable[..., str]) -> None:
    client = sdk(gateway, make_key())
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "echo"}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "echo", "stream": True}},
    ]  # fmt: skip
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed"
    assert batch.errors is not None
    assert [(e.code, e.line) for e in batch.errors.data or []] == [
        ("mismatched_endpoint", 1),
        ("invalid_request", 2),
    ]
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )


def test_files_and_batches_are_their_owners(gateway: str, make_key: Callable[..., str]) -> None:
    owner, stranger = sdk(gateway, make_key()), sdk(gateway, make_key())
    body = {"model": "echo", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    batch = run_batch(owner, "/v1/chat/completions", [body])
    assert batch.status == "completed"
    for call in (
        lambda: stranger.batches.retrieve(batch.id),
        lambda: stranger.batches.cancel(batch.id),
        lambda: stranger.files.retrieve(batch.input_file_id),
        lambda: stranger.files.content(batch.output_file_id),
        lambda: stranger.files.delete(batch.input_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [b.id for b in stranger.batches.list()] == []
    assert batch.id in [b.id for b in owner.batches.list()]
    assert owner.files.delete(batch.input_file_id).deleted
    with pytest.raises(openai.NotFoundError):
        owner.files.retrieve(batch.input_file_id)


def test_anthropic_message_batches(gateway: str, make_key: Callable[..., str]) -> None:
    key = make_key()
    claude = anthropic.Anthropic(base_url=gateway, api_key=key, max_retries=0)
    params = [
        {"model": "echo", "max_tokens": i + 1, "messages": [{"role": "user", "content": f"q{i}"}]}
        for i in range(3)
    ]
    requests: Any = [{"custom_id": f"c{i}", "params": p} for i, p in enumerate(params)]
    requests.append({"custom_id": "bad", "params": {**params[0], "model": "no-such-model"}})
    batch = claude.messages.batches.create(requests=requests)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 4
    deadline = time.monotonic() + 60
    while (batch := claude.messages.batches.retrieve(batch.id)).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert (batch.request_counts.succeeded, batch.request_counts.errored) == (3, 1)
    results = {r.custom_id: r.result for r in claude.messages.batches.results(batch.id)}
    for i, p in enumerate(params):
        live = claude.messages.create(**p)  # type: ignore[arg-type]
        result = results[f"c{i}"]
        assert result.type == "succeeded"
        assert result.message.content == live.content and result.message.usage == live.usage
    assert results["bad"].type == "errored"
    assert results["bad"].error.error.type == "not_found_error"  # type: ignore[union-attr]
    stranger = anthropic.Anthropic(base_url=gateway, api_key=make_key(), max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        stranger.messages.batches.retrieve(batch.id)
    assert claude.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.batches.retrieve(batch.id)


def test_cancel_stops_lines_not_started(gateway: str, make_key: Callable[..., str]) -> None:
    client = sdk(gateway, make_key(max_parallel_requests=1))
    body = {"model": "slow", "messages": [{"role": "user", "content": "x"}], "max_tokens": 20}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(30)
    ]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    time.sleep(1.5)
    assert client.batches.cancel(batch.id).status == "cancelling"
    batch = wait_batch(client, batch.id)
    assert batch.status == "cancelled"
    output = read_lines(client, batch.output_file_id)
    errors = read_lines(client, batch.error_file_id)
    assert 1 <= len(output) < 30 and len(output) + len(errors) == 30
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert batch.request_counts.completed == len(output)


TEN_WORDS = [{"role": "user", "content": "a a a a a a a a a a"}]
"""The upstream counts 11 prompt tokens (a word each, one for the message); the gateway
estimates ceil(19 / 3) + 4 = 11 too: with max_tokens 5 a request reserves and uses exactly 16."""


def test_budget_shared_with_live_traffic_ends_exactly_at_its_size(
    gateway: str,
    make_key_record: Callable[..., dict[str, Any]],
    usage_events: Callable[..., list[Any]],
) -> None:
    record = make_key_record(token_budget=16 * 6)
    client = sdk(gateway, record["key"])
    body = {"model": "echo", "messages": TEN_WORDS, "max_tokens": 5}
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        for i in range(6)
    ]
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    live_ok = live_refused = 0
    for _ in range(4):
        try:
            client.chat.completions.create(**body)
            live_ok += 1
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"
            live_refused += 1
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    output = read_lines(client, batch.output_file_id)
    errors = read_lines(client, batch.error_file_id)
    assert len(output) + live_ok == 6, (len(output), live_ok)
    assert len(errors) + live_refused == 4
    for line in errors:  # refused for the budget: an error line, never a silent drop
        assert line["response"]["status_code"] == 429
        assert line["response"]["body"]["error"]["code"] == "insufficient_quota"
    assert batch.request_counts.failed == len(errors)
    info = httpx.get(
        f"{gateway}/v1/key/info", headers={"authorization": f"Bearer {record['key']}"}
    ).json()
    # Booked as admission counts (nothing is in flight by now): exactly the budget.
    assert (info["budget"]["used_tokens"], info["budget"]["remaining_tokens"]) == (96, 0), info


def test_batch_lines_cost_the_batch_multiplier_of_the_price(
    gateway: str,
    make_key: Callable[..., str],
    api_settings: Any,
    usage_events: Callable[..., list[Any]],
) -> None:
    added = httpx.post(
        f"{gateway}/admin/prices",
        json={"model": "echo", "input": 10, "output": 20},
        headers={"authorization": f"Bearer {api_settings.master_key}"},
    )
    assert added.status_code == 201, added.text
    client = sdk(gateway, make_key())
    body = {"model": "echo", "messages": TEN_WORDS, "max_tokens": 5}
    live = client.chat.completions.with_raw_response.create(**body)
    (live_event,) = usage_events(live.headers["x-request-id"])
    assert live_event.cost_micros == 11 * 10 + 5 * 20
    batch = run_batch(client, "/v1/chat/completions", [body])
    (line,) = read_lines(client, batch.output_file_id)
    (batch_event,) = usage_events(line["response"]["request_id"])
    assert batch_event.cost_micros * 2 == live_event.cost_micros
    assert (batch_event.prompt_tokens, batch_event.completion_tokens) == (11, 5)


def test_admin_api_and_ui_show_progress_and_cost(
    gateway: str, make_key_record: Callable[..., dict[str, Any]], api_settings: Any
) -> None:
    record = make_key_record()
    client = sdk(gateway, record["key"])
    body = {"model": "echo", "messages": TEN_WORDS, "max_tokens": 5}
    batch = run_batch(client, "/v1/chat/completions", [body, body])
    master = {"authorization": f"Bearer {api_settings.master_key}"}
    listed = httpx.get(f"{gateway}/admin/batches", params={"key_id": record["id"]}, headers=master)
    assert listed.status_code == 200, listed.text
    (view,) = listed.json()["data"]
    assert view["id"] == batch.id and view["status"] == "completed" and view["progress"] == 1.0
    assert view["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert (view["prompt_tokens"], view["completion_tokens"]) == (22, 10)
    assert view["cost_micros"] >= 0 and view["currency"] == api_settings.currency
    refused = httpx.get(
        f"{gateway}/admin/batches", headers={"authorization": f"Bearer {record['key']}"}
    )
    assert refused.status_code in (401, 403)

    with httpx.Client(base_url=gateway) as browser:
        token = browser.get("/ui/").cookies["sg_ui_signin"]
        signed = browser.post(
            "/ui/sign-in", data={"csrf_token": token, "key": api_settings.master_key}
        )
        assert signed.status_code == 303, signed.text
        page = browser.get("/ui/batches/")
        assert page.status_code == 200 and batch.id in page.text


def test_uploads_have_their_own_size_limit(
    gateway: str, make_key: Callable[..., str], api_settings: Any
) -> None:
    client = sdk(gateway, make_key())
    body = {"model": "echo", "messages": [{"role": "user", "content": "x" * 1000}]}
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body}
    lines = [{**line, "custom_id": f"c{i}"} for i in range(200)]
    content = jsonl(lines)
    assert api_settings.max_body_bytes < len(content) < api_settings.max_file_bytes
    uploaded = client.files.create(file=("big.jsonl", io.BytesIO(content)), purpose="batch")
    assert client.files.content(uploaded.id).content == content
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(content)), purpose="fine-tune")


def test_responses_lines_match_live_answers(gateway: str, make_key: Callable[..., str]) -> None:
    client = sdk(gateway, make_key())
    bodies = [
        {"model": "echo", "input": f"tell me {i}", "max_output_tokens": 16, "store": False}
        for i in range(2)
    ]
    batch = run_batch(client, "/v1/responses", bodies)
    assert batch.status == "completed" and batch.request_counts.failed == 0, batch
    for line, body in zip(read_lines(client, batch.output_file_id), bodies, strict=True):
        answer = line["response"]["body"]
        live = client.responses.create(**body)
        assert answer["object"] == "response" and answer["status"] == "completed"
        texts = [c["text"] for item in answer["output"] for c in item.get("content", [])]
        assert "".join(texts) == live.output_text
        assert answer["usage"]["output_tokens"] == live.usage.output_tokens  # type: ignore[union-attr]
