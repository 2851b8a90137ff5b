"""A gateway replica SIGKILLed mid-stream: another replica settles what it was serving.

Two gateway processes share Redis, PostgreSQL and the usage stream; a real worker serves.
The stream runs on replica A, which is killed once the client has seen text. Within
``lease_s + 5`` seconds replica B's reaper has written the usage row (the prompt once, and
the tokens A had read of its reply stream, at least what the client received, not the ones
the worker went on generating until the reaper's Cancel landed: see sluicegate.gateway.leases.reaper),
freed the key's concurrency slot and given back the unused reservation.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import redis

from sluicegate.engine import redis_names

pytestmark = pytest.mark.timeout(240)

LEASE_S = 3.0
MAX_TOKENS = 400
PROMPT = "Story number 7 about a river."


def _stream_until_text(
    base_url: str, api_key: str, model: str
) -> tuple[str, str, tuple[httpx.Response, Iterator[str]]]:
    """Start a stream, read until some text arrived; (request id, text seen, the open stream).
    The caller keeps the open stream (the response and its unfinished line iterator), so the
    connection stays open until it kills the gateway under it: the gateway, seeing its client
    leave, would settle the stream itself as cancelled before the kill lands. Holding the
    response is not enough: a line iterator left by ``break`` in a ``for`` over
    ``response.iter_lines()`` is finalized at once, and httpcore closes the connection then."""
    client = httpx.Client(timeout=60)
    request = client.build_request(
        "POST",
        f"{base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        json={
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "stream": True,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    response = client.send(request, stream=True)
    assert response.status_code == 200, response.read()
    text = ""
    lines = response.iter_lines()
    for line in lines:
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            text += choice["delta"].get("content") or ""
        if len(text) >= 8:
            break
    return response.headers["x-request-id"], text, (response, lines)


def _rest_of(lines: Iterator[str]) -> str:
    """The text of the events the killed gateway had sent: the client received them too."""
    text = ""
    try:
        for line in lines:
            if not line.startswith("data: {"):
                continue
            try:
                event = json.loads(line[6:])
            except json.JSONDecodeError:
                break  # an event cut by the kill
            for choice in event.get("choices", []):
                text += choice["delta"].get("content") or ""
    except httpx.HTTPError:
        pass  # the connection ended with the process
    return text


def test_killed_gateways_stream_is_settled_by_the_survivor(
    cluster: Any,
    e2e_database_url: str,
    redis_url: str,
    reference: Any,
    tools: SimpleNamespace,
) -> None:
    model = tools.model_name("e2e-gwkill")
    cluster.worker(model, redis_url)
    shared = {"usage_stream": f"sg:usage:e2e:{uuid.uuid4().hex[:8]}", "lease_s": str(LEASE_S)}
    victim = cluster.gateway(e2e_database_url, redis_url, **shared)
    survivor = cluster.gateway(e2e_database_url, redis_url, **shared)
    victim_url = f"http://127.0.0.1:{victim.port}"
    key, key_id = tools.create_key(
        victim_url, f"e2e-gwkill-{uuid.uuid4().hex[:6]}", max_parallel_requests=1,
        token_budget=1_000_000,
    )  # fmt: skip
    gateway = tools.Gateway(survivor, e2e_database_url, key, key_id)
    gateway.wait_model(model)
    tools.Gateway(victim, e2e_database_url, key, key_id).wait_model(model)

    request_id, seen, open_stream = _stream_until_text(victim_url, key, model)
    victim.stop(signal.SIGKILL)
    killed_at = time.monotonic()
    received = seen + _rest_of(open_stream[1])

    rows: list[dict[str, Any]] = []

    def settled() -> bool:
        nonlocal rows
        rows = gateway.usage_rows([request_id])
        return bool(rows)

    tools.wait_until(settled, LEASE_S + 15, "the killed replica's usage row", interval=0.2)
    took = time.monotonic() - killed_at
    open_stream[0].close()
    # The bound (expiry after lease_s, a reap each second, the usage flush); the wait
    # above is longer only so that a miss reports how long it took.
    assert took <= LEASE_S + 5, f"the usage row took {took:.1f} s after the kill"
    want = reference.chat(PROMPT, MAX_TOKENS)
    (row,) = rows
    assert row["prompt_tokens"] == len(want.prompt_token_ids)
    # Billed: what A had read of its reply stream when it died, which is at least what its
    # client received; the worker, not told for lease_s and more, produced further tokens that
    # nobody received.
    client = redis.Redis.from_url(redis_url)
    try:
        produced = int(client.hget(redis_names.produced_key(request_id), "n") or 0)
    finally:
        client.close()
    assert row["completion_tokens"] <= MAX_TOKENS, (row, took)
    assert row["completion_tokens"] < produced, (row, produced, took)
    assert reference.tokens_shown(want, seen) > 0
    assert row["completion_tokens"] >= reference.tokens_shown(want, received), (row, received)
    assert row["status"] == "error"

    client = redis.Redis.from_url(redis_url)
    try:
        assert client.zcard(f"sg:rl:{{{key_id}}}:slots") == 0
        budget_used = int(client.get(f"sg:rl:{{{key_id}}}:b:all") or 0)
        assert budget_used == row["prompt_tokens"] + row["completion_tokens"]
    finally:
        client.close()

    # The slot is free: the key (one request at a time) is served again, by the survivor.
    answer = gateway.openai(max_retries=0, timeout=60).chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4
    )
    assert answer.usage.completion_tokens == 4
