"""``/v1/messages/count_tokens`` on backends other than Anthropic: Gemini's ``countTokens`` and
Bedrock's ``CountTokens`` answer it with nothing generated and nothing billed; a model with no
count is measured by a one-token generation, without ``thinking`` (a budget must stay below
``max_tokens``), and billed to the key like any request."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
import redis

from sluicegate.gateway.usage.stream import EVENT_FIELD

from .claude_inputs import SAY, THINK, WEATHER


def billed(redis_url: str, request_id: str) -> tuple[int, int]:
    """(prompt, completion) tokens of the usage event the gateway recorded for a request."""
    client = redis.Redis.from_url(redis_url)
    try:
        for stream in client.scan_iter("sg:usage:hosted:*", _type="stream"):
            for _, fields in client.xrange(stream):
                event = json.loads(fields[EVENT_FIELD])
                if event["request_id"] == request_id:
                    return event.get("prompt_tokens", 0), event.get("completion_tokens", 0)
    finally:
        client.close()
    raise AssertionError(f"no usage event for {request_id}")


def count(claude: anthropic.Anthropic, **fields: Any) -> tuple[int, str]:
    """The count, and the gateway's request id."""
    raw = claude.messages.with_raw_response.count_tokens(**fields)
    return raw.parse().input_tokens, raw.headers["x-request-id"]


@pytest.mark.parametrize("kind", ["gemini", "bedrock"])
def test_the_backends_own_count_generates_and_bills_nothing(
    claude: anthropic.Anthropic,
    redis_url: str,
    fakes: dict[str, tuple[Any, str]],
    kind: str,
) -> None:
    fake = fakes[kind][0]
    calls = dict(fake.calls)
    counted, request_id = count(
        claude,
        model=f"{kind}-plain",
        system="be brief",
        tools=[WEATHER],
        messages=SAY,
        thinking=THINK,
    )
    # The fakes' count: 3 words of messages, 2 of system, the tool's name and its 5 words.
    assert counted == 3 + 2 + 1 + 5
    assert fake.calls == calls, "nothing was generated"
    assert billed(redis_url, request_id) == (0, 0)


def test_a_model_without_a_count_is_measured_by_a_billed_generation_without_thinking(
    claude: anthropic.Anthropic,
    redis_url: str,
    fakes: dict[str, tuple[Any, str]],
) -> None:
    fake = fakes["bedrock"][0]
    counted, request_id = count(
        claude, model="bedrock-nocount", system="be brief", messages=SAY, thinking=THINK
    )
    probe = fake.bodies[-1]
    assert probe["inferenceConfig"]["maxTokens"] == 1
    assert "thinking" not in (probe.get("additionalModelRequestFields") or {})
    message = claude.messages.create(
        model="bedrock-nocount", max_tokens=2048, system="be brief", messages=SAY, thinking=THINK
    )
    usage = message.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted == prompt
    assert billed(redis_url, request_id) == (prompt, 1), "the probe: its prompt and 1 token"
