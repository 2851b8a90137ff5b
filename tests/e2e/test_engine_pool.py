"""One engine worker behind the gateway: answers equal offline greedy output, exact billing,
and a client that hangs up frees the worker's KV blocks at once and pays only what it saw."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import openai
import pytest

pytestmark = pytest.mark.timeout(180)

PROMPTS = ["Tell me a story about a river.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def pool(cluster: Any, gateway: Any, redis_url: str, tools: SimpleNamespace) -> SimpleNamespace:
    name = tools.model_name("e2e-pool")
    worker = cluster.worker(name, redis_url)
    gateway.wait_model(name)
    return SimpleNamespace(model=name, worker=worker, gateway=gateway)


def _greedy(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_chat_completions_equal_offline_greedy_and_usage_rows_match(
    pool: SimpleNamespace, reference: Any
) -> None:
    client = pool.gateway.openai(max_retries=0, timeout=60)
    expected_rows: dict[str, tuple[int, int]] = {}
    for prompt in PROMPTS:
        want = reference.chat(prompt, 24)
        messages = [{"role": "user", "content": prompt}]

        raw = client.chat.completions.with_raw_response.create(
            model=pool.model, messages=messages, **_greedy(24)
        )
        reply = raw.parse()
        assert reply.choices[0].message.content == want.text
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == len(want.token_ids) == 24
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
        expected_rows[raw.headers["x-request-id"]] = (len(want.prompt_token_ids), 24)

        stream = client.chat.completions.with_raw_response.create(
            model=pool.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **_greedy(24),
        )
        pieces, usage, finish = [], None, None
        for chunk in stream.parse():
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert "".join(pieces) == want.text
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 24
        assert usage.prompt_tokens == len(want.prompt_token_ids)
        expected_rows[stream.headers["x-request-id"]] = (len(want.prompt_token_ids), 24)

    rows = pool.gateway.wait_usage_rows(len(expected_rows))
    billed = {r["request_id"]: (r["prompt_tokens"], r["completion_tokens"]) for r in rows}
    assert {rid: billed.get(rid) for rid in expected_rows} == expected_rows
    assert all(r["status"] == "ok" for r in rows)


def test_dropped_stream_frees_kv_blocks_within_a_second_and_bills_what_was_seen(
    pool: SimpleNamespace, reference: Any, tools: SimpleNamespace
) -> None:
    metrics = tools.worker_metrics(pool.worker)
    idle = metrics["sluicegate:kv_cache_usage_perc"]
    generated_before = metrics["sluicegate:generation_tokens_total"]
    prompt = "Tell me a long story about a gate and the water behind it."

    client = pool.gateway.openai(max_retries=0, timeout=60)
    raw = client.chat.completions.with_raw_response.create(
        model=pool.model,
        messages=[{"role": "user", "content": prompt}],
        stream=True,
        **_greedy(1500),
    )
    request_id = raw.headers["x-request-id"]
    stream = raw.parse()
    seen = ""
    chunks = 0
    for chunk in stream:
        for choice in chunk.choices:
            seen += choice.delta.content or ""
        chunks += 1
        if chunks == 8:
            break
    busy = tools.worker_metrics(pool.worker)["sluicegate:kv_cache_usage_perc"]
    assert busy > idle, "the request should hold KV blocks while it streams"
    stream.close()
    dropped_at = time.monotonic()
    tools.wait_until(
        lambda: tools.worker_metrics(pool.worker)["sluicegate:kv_cache_usage_perc"] <= idle,
        timeout=1.0,
        what="the worker's KV blocks to return to the idle level",
        interval=0.02,
    )
    assert time.monotonic() - dropped_at <= 1.0
    generated = tools.worker_metrics(pool.worker)["sluicegate:generation_tokens_total"]
    generated -= generated_before
    assert generated < 1500, "the worker should have stopped generating"
    # Greedy, so the first `generated` tokens of the 1500 are the offline answer that long:
    # enough to place what the client saw, without generating 1500 tokens offline.
    want = reference.chat(prompt, int(generated))

    rows: list[dict[str, Any]] = []

    def recorded() -> bool:
        nonlocal rows
        rows = pool.gateway.usage_rows([request_id])
        return bool(rows)

    tools.wait_until(recorded, 15, "the cancelled request's usage row", interval=0.2)
    row = rows[0]
    assert row["status"] == "cancelled"
    shown = reference.tokens_shown(want, seen)
    # The client read `shown` tokens; the gateway may have written more into the socket before
    # it noticed the hang-up, but never bills a token the worker did not hand it.
    assert shown <= row["completion_tokens"] <= generated
    # The prompt is billed at its real length, not the gateway's admission estimate.
    assert row["prompt_tokens"] == len(want.prompt_token_ids)


def test_too_long_a_request_is_a_400_context_length_exceeded(pool: SimpleNamespace) -> None:
    client = pool.gateway.openai(max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as failure:
        client.chat.completions.create(
            model=pool.model,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=100_000,  # the tiny model's context is 2,048 tokens
        )
    assert failure.value.code == "context_length_exceeded"


def test_malformed_stream_entries_are_acknowledged_and_the_worker_keeps_serving(
    pool: SimpleNamespace, redis_url: str, tools: SimpleNamespace
) -> None:
    import redis

    from sluicegate.engine import protocol, redis_names

    client = redis.Redis.from_url(redis_url)
    stream = redis_names.request_stream(pool.model)
    heartbeat = protocol.Heartbeat(
        worker_id="nobody", model=pool.model, served_model_name=pool.model, version="0", time=0.0
    )
    for fields in (
        {b"m": b"\xc1 not msgpack"},
        {b"other": b"no m field"},
        {b"m": protocol.encode(heartbeat)},  # valid, but not a request
    ):
        client.xadd(stream, fields)

    def all_acknowledged() -> bool:
        return client.xpending(stream, redis_names.REQUEST_GROUP)["pending"] == 0

    tools.wait_until(all_acknowledged, 10, "the bad entries to be acknowledged")
    assert pool.worker.alive()
    assert pool.worker.log().count("dropping malformed entry") >= 3
    reply = pool.gateway.openai(max_retries=0, timeout=30).chat.completions.create(
        model=pool.model, messages=[{"role": "user", "content": "still there?"}], max_tokens=3
    )
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
