"""Speculative dispatch (sluicegate.gateway.admission.speculation): a key far from its limits has its request sent
upstream while admission is in Redis; limits, refusals and usage stay exactly as without."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import redis

from sluicegate.gateway.admission.scripts import WINDOW_S
from sluicegate.gateway.admission.speculation import MAX_AGE_S, HeadroomBook
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.telemetry import REGISTRY

from .servers import Upstream

HI = [{"role": "user", "content": "hi"}]


def _dispatched(outcome: str) -> float:
    return (
        REGISTRY.get_sample_value("sluicegate_speculative_dispatches_total", {"outcome": outcome})
        or 0.0
    )


@pytest.fixture
def new_key(make_key_record: Callable[..., dict[str, Any]]) -> Callable[..., tuple[str, str]]:
    """Creates a key over the admin API: (plaintext, id)."""

    def create(**limits: Any) -> tuple[str, str]:
        record = make_key_record(**limits)
        return str(record["key"]), str(record["id"])

    return create


@pytest.fixture
def redis_client(api_settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(api_settings.redis_url)
    yield client
    client.close()


def _chat(gateway: str, key: str, **extra: Any) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "echo", "messages": HI, "max_tokens": 3, **extra},
        headers={"authorization": f"Bearer {key}"},
    )


def test_a_key_far_from_its_limits_is_answered_and_billed_as_ever(
    gateway: str,
    new_key: Callable[..., tuple[str, str]],
    usage_events: Callable[..., list],
) -> None:
    key, _ = new_key(rpm_limit=1000, tpm_limit=100_000, token_budget=1_000_000)
    first = _chat(gateway, key)
    assert first.status_code == 200
    before = _dispatched("admitted")
    second = _chat(gateway, key)
    assert second.status_code == 200, second.text
    assert _dispatched("admitted") == before + 1
    assert (
        second.json()["choices"][0]["message"]["content"]
        == first.json()["choices"][0]["message"]["content"]
    )
    assert second.headers["x-ratelimit-remaining-requests"] == "998"
    usage = second.json()["usage"]
    (event,) = usage_events(second.headers["x-request-id"])
    assert (event.prompt_tokens, event.completion_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_a_request_refused_after_it_was_sent_gets_its_429_and_nothing_is_billed(
    gateway: str,
    upstream: tuple[Upstream, str],
    new_key: Callable[..., tuple[str, str]],
    redis_client: redis.Redis,
    usage_events: Callable[..., list],
) -> None:
    app, _ = upstream
    key, key_id = new_key(rpm_limit=10)
    assert _chat(gateway, key).status_code == 200  # 1 of 10: headroom
    # Other replicas use up the minute meanwhile: this replica's view is a second stale.
    window = int(time.time() // WINDOW_S)
    redis_client.set(f"sg:rl:{{{key_id}}}:r:{window}", 10, ex=2 * WINDOW_S)
    calls, refused = app.calls["echo"], _dispatched("refused")
    response = _chat(gateway, key)
    assert response.status_code == 429
    assert response.json()["error"]["type"] == "requests"
    # It was dispatched before the refusal came; whether its bytes reached the upstream before
    # the refusal cancelled it races two round trips on loopback (and the upstream may count it
    # after the 429 is out). Either way its answer is dropped and nothing is billed.
    assert _dispatched("refused") == refused + 1
    deadline = time.monotonic() + 1.0
    while app.calls["echo"] == calls and time.monotonic() < deadline:
        time.sleep(0.01)
    sent = app.calls["echo"]
    assert sent in (calls, calls + 1)
    assert usage_events(response.headers["x-request-id"], wait_s=0.3) == []
    # A refusal forgets the key's headroom: the next request waits for its admission.
    assert _chat(gateway, key).status_code == 429
    assert app.calls["echo"] == sent


def test_a_key_near_a_limit_is_admitted_before_it_goes_upstream(
    gateway: str, upstream: tuple[Upstream, str], new_key: Callable[..., tuple[str, str]]
) -> None:
    app, _ = upstream
    key, _ = new_key(rpm_limit=2)
    before, calls = _dispatched("admitted"), app.calls["echo"]
    outcomes = [_chat(gateway, key).status_code for _ in range(3)]
    assert outcomes == [200, 200, 429]
    # Half the minute used after the first: none of them went early; the refused one never
    # reached the upstream.
    assert _dispatched("admitted") == before
    assert app.calls["echo"] == calls + 2


def test_a_request_reserving_more_than_half_the_room_left_waits_for_admission(
    gateway: str, upstream: tuple[Upstream, str], new_key: Callable[..., tuple[str, str]]
) -> None:
    app, _ = upstream
    key, _ = new_key(token_budget=1000, budget_period="month")
    assert _chat(gateway, key).status_code == 200  # 8 of 1000 reserved, 5 billed
    before, calls = _dispatched("admitted"), app.calls["echo"]
    # Reserves 5 + 996 tokens: more than the budget has left; refused before any dispatch.
    refused = _chat(gateway, key, max_tokens=996)
    assert refused.status_code == 429
    assert _dispatched("admitted") == before and app.calls["echo"] == calls


def test_the_headroom_book_trusts_a_recent_light_admission_only() -> None:
    book = HeadroomBook()
    assert not book.allows("k", 10, 0)
    book.record("k", [499, 100, -1])
    assert book.allows("k", 50, 10**9)
    assert not book.allows("k", 51, 0)  # more than half the tokens left
    book.record("k", [500, -1, 100])
    assert not book.allows("k", 1, 0)  # half of a limit used
    book.record("k", [10, -1, 100])
    assert book.allows("k", 1, 50) and not book.allows("k", 1, 51)
    book._keys["k"].at -= MAX_AGE_S + 0.1
    assert not book.allows("k", 1, 0)  # stale
    book.record("k", [10, -1, -1])
    book.forget("k")
    assert not book.allows("k", 1, 0)
    off = HeadroomBook(enabled=False)
    off.record("k", [0, -1, -1])
    assert not off.allows("k", 1, 0)
