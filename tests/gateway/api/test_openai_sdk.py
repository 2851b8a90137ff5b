"""The official openai SDK, sync and async, streaming and not, against a served gateway."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx
import openai
import pytest

from sluicegate.gateway.settings import Settings

RESET = re.compile(r"^(\d+ms|(\d+m)?[\d.]+s)$")
HELLO = [{"role": "user", "content": "hello world"}]
"""Upstream counts 3 prompt tokens; the gateway estimates ceil(11/3) + 4 = 8."""


def sdk(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)


def async_sdk(gateway: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)


def test_sync_chat_completion_with_usage_headers_and_one_usage_event(
    gateway: str, make_key: Callable[..., str], usage_events: Callable[..., list]
) -> None:
    client = sdk(gateway, make_key(rpm_limit=100, tpm_limit=100_000))
    raw = client.chat.completions.with_raw_response.create(
        model="echo", messages=HELLO, max_tokens=3
    )
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.id == f"chatcmpl-{raw.headers['x-request-id']}"
    assert completion.model == "echo"
    choice = completion.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", "w0 w1 w2 ")
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 3)
    assert completion.usage.total_tokens == 6

    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    assert raw.headers["x-ratelimit-remaining-requests"] == "99"
    assert raw.headers["x-ratelimit-limit-tokens"] == "100000"
    assert raw.headers["x-ratelimit-remaining-tokens"] == str(100_000 - (8 + 3))
    assert RESET.match(raw.headers["x-ratelimit-reset-requests"])
    assert RESET.match(raw.headers["x-ratelimit-reset-tokens"])

    (event,) = usage_events(raw.headers["x-request-id"])
    assert (event.model, event.status, event.finish_reason) == ("echo", "ok", "length")
    assert (event.prompt_tokens, event.completion_tokens) == (3, 3)
    assert event.deployment and event.deployment == "openai:echo"
    assert event.latency_ms >= event.ttft_ms >= 0


def test_sync_streaming_with_include_usage(
    gateway: str, make_key: Callable[..., str], usage_events: Callable[..., list]
) -> None:
    client = sdk(gateway, make_key())
    with client.chat.completions.with_streaming_response.create(
        model="echo-alias",
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
    ) as response:
        request_id = response.headers["x-request-id"]
        chunks = list(response.parse())
    assert {c.id for c in chunks} == {f"chatcmpl-{request_id}"}
    assert len({c.created for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" and c.model == "echo-alias" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "w0 w1 w2 w3 w4 "
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, 5)
    (event,) = usage_events(request_id)
    assert (event.status, event.completion_tokens, event.model) == ("ok", 5, "echo-alias")


async def test_async_sdk_streaming_and_not(
    gateway: str, make_key: Callable[..., str], usage_events: Callable[..., list]
) -> None:
    client = async_sdk(gateway, make_key())
    completion = await client.chat.completions.create(
        model="echo", messages=HELLO, max_completion_tokens=2
    )
    assert completion.choices[0].message.content == "w0 w1 "
    stream = await client.chat.completions.create(model="echo", messages=HELLO, stream=True)
    chunks = [chunk async for chunk in stream]
    assert all(chunk.choices for chunk in chunks), "no usage chunk unless include_usage"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "w0 w1 w2 w3 w4 "
    assert chunks[-1].choices[0].finish_reason == "stop"
    await client.close()
    (event,) = usage_events(completion.id.removeprefix("chatcmpl-"))
    assert event.completion_tokens == 2


def test_text_completions_string_and_token_ids(gateway: str, make_key: Callable[..., str]) -> None:
    client = sdk(gateway, make_key())
    completion = client.completions.create(model="echo", prompt="one two three", max_tokens=2)
    assert completion.object == "text_completion"
    assert completion.id.startswith("cmpl-")
    assert completion.choices[0].text == "w0 w1 "
    assert completion.usage is not None and completion.usage.prompt_tokens == 3
    by_ids = client.completions.create(model="echo", prompt=[1, 2, 3, 4], max_tokens=1)
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == 4
    stream = client.completions.create(
        model="echo", prompt="x", max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "w0 w1 w2 "
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


def test_models_lists_only_what_the_key_may_use(gateway: str, make_key: Callable[..., str]) -> None:
    everything = {m.id for m in sdk(gateway, make_key()).models.list()}
    assert {"echo", "slow", "flaky"} <= everything
    restricted = sdk(gateway, make_key(allowed_models=["echo", "slow"])).models.list()
    assert sorted(m.id for m in restricted) == ["echo", "slow"]


def test_authentication_errors(gateway: str) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        sdk(gateway, "sk-" + "x" * 43).chat.completions.create(model="echo", messages=HELLO)
    assert caught.value.code == "invalid_api_key"
    assert caught.value.response.headers["x-request-id"]
    missing = httpx.post(f"{gateway}/v1/chat/completions", json={})
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "invalid_api_key"


def test_model_not_found_and_permission_denied(gateway: str, make_key: Callable[..., str]) -> None:
    client = sdk(gateway, make_key(allowed_models=["echo"]))
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert not_found.value.code == "model_not_found"
    assert not_found.value.param == "model"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        client.chat.completions.create(model="slow", messages=HELLO)
    assert denied.value.status_code == 403


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "echo", "messages": HELLO, "n": 0}, "n"),
        ({"model": "echo", "messages": HELLO, "seed": 2**70}, "seed"),
        ({"model": "echo", "messages": HELLO, "logit_bias": {"hello": 5}}, "logit_bias"),
        ({"model": "echo", "messages": HELLO, "logit_bias": {"50": 101}}, "logit_bias"),
        ({"model": "echo", "messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        (
            {"model": "echo", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
        ),
        ({"model": "echo", "messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
        (
            {"model": "echo", "messages": HELLO, "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
        (
            {
                "model": "echo",
                "messages": HELLO,
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
            "tool_choice.function.name",
        ),
        (
            {"model": "echo", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
        ),
        ({"model": "echo", "messages": HELLO, "temperature": 5}, "temperature"),
        ({"model": "echo", "messages": HELLO, "max_tokens": "many"}, "max_tokens"),
        ({"model": "echo"}, "messages"),
        ({"model": "echo", "messages": [{"content": "x"}]}, "messages[0].role"),
        ({"model": "echo", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "echo", "messages": []}, "messages"),
    ],
)
def test_invalid_fields_are_400_naming_the_param(
    gateway: str, make_key: Callable[..., str], body: dict, param: str
) -> None:
    key = make_key()
    response = httpx.post(
        f"{gateway}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert set(error) == {"message", "type", "param", "code"}
    assert response.headers["x-request-id"]


def test_json_nested_five_thousand_deep_is_a_400(
    gateway: str, make_key: Callable[..., str]
) -> None:
    deep = b"[" * 5000 + b"]" * 5000
    body = b'{"model": "echo", "messages": [{"role": "user", "content": "x"}], "metadata": '
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        content=body + deep + b"}",
        headers={"authorization": f"Bearer {make_key()}", "content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "metadata")


def test_context_length_exceeded_maps_from_the_upstream(
    gateway: str, make_key: Callable[..., str], usage_events: Callable[..., list]
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(gateway, make_key()).chat.completions.create(model="ctx", messages=HELLO)
    assert caught.value.code == "context_length_exceeded"
    (event,) = usage_events(caught.value.response.headers["x-request-id"])
    assert (event.status, event.prompt_tokens, event.completion_tokens) == ("error", 0, 0)


def test_requests_per_minute_limit(
    gateway: str, make_key: Callable[..., str], api_settings: Settings
) -> None:
    client = sdk(gateway, make_key(rpm_limit=2))
    for _ in range(2):
        client.chat.completions.create(model="echo", messages=HELLO, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="echo", messages=HELLO, max_tokens=1)
    error = caught.value
    assert (error.code, error.body["type"]) == ("rate_limit_exceeded", "requests")  # type: ignore[index]
    assert int(error.response.headers["retry-after"]) >= 1
    assert error.response.headers["x-ratelimit-remaining-requests"] == "0"
    admin = {"authorization": f"Bearer {api_settings.master_key}"}
    metrics = httpx.get(f"{gateway}/metrics", headers=admin).text
    assert 'sluicegate_rejections_total{reason="rate_limit_requests"}' in metrics


def test_tokens_per_minute_reserve_then_settle(gateway: str, make_key: Callable[..., str]) -> None:
    # Each request reserves 5 (estimate of "hi") + 10 and settles to 2 + 5 real tokens:
    # with 30 per minute, 7 + 7 + 7 + 15 > 30 stops the fourth.
    client = sdk(gateway, make_key(tpm_limit=30))
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(3):
        client.chat.completions.create(model="echo", messages=messages, max_tokens=10)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="echo", messages=messages, max_tokens=10)
    assert caught.value.body["type"] == "tokens"  # type: ignore[index]
    assert caught.value.response.headers["x-ratelimit-remaining-tokens"] == str(30 - 21)


def test_budget_exhausted_is_insufficient_quota(gateway: str, make_key: Callable[..., str]) -> None:
    client = sdk(gateway, make_key(token_budget=20, budget_period="day"))
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="echo", messages=messages, max_tokens=10)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="echo", messages=messages, max_tokens=10)
    assert caught.value.code == "insufficient_quota"
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_body_over_the_limit_is_413(gateway: str, make_key: Callable[..., str]) -> None:
    big = "x" * (70 * 1024)
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": big}]},
        headers={"authorization": f"Bearer {make_key()}"},
    )
    assert response.status_code == 413
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.headers["x-request-id"]


def test_every_response_carries_a_request_id(gateway: str) -> None:
    for response in (
        httpx.get(f"{gateway}/nowhere"),
        httpx.get(f"{gateway}/health/live"),
        httpx.get(f"{gateway}/v1/models"),
    ):
        assert re.fullmatch(r"[0-9a-f]{24}", response.headers["x-request-id"])
    assert httpx.get(f"{gateway}/nowhere").json()["error"]["type"] == "invalid_request_error"


def test_openapi_and_metrics(
    gateway: str, make_key: Callable[..., str], api_settings: Settings
) -> None:
    sdk(gateway, make_key()).chat.completions.create(model="echo", messages=HELLO)
    admin = {"authorization": f"Bearer {api_settings.master_key}"}
    schema = httpx.get(f"{gateway}/schema/openapi.json", headers=admin).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models"} <= set(schema["paths"])
    metrics = httpx.get(f"{gateway}/metrics", headers=admin).text
    assert 'sluicegate_requests_total{model="echo",status="ok"}' in metrics
    assert "sluicegate_added_latency_seconds_bucket" in metrics
