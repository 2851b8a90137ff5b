"""Hostile values: no token count, list, map or string a client sends gets past its bound
(``sluicegate.gateway.schemas.bounds``), and no budget can be bypassed with one.

A negative output cap used to book a negative reservation (a credit of a million tokens on the
key's budget); an upstream's negative usage left the counters negative. Every inbound API now
answers such a value with a 400 in its own shape naming the field, before admission books
anything, and the key's budget still refuses what it cannot pay for afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis
import yaml
from redis.asyncio import Redis as AsyncRedis

from sluicegate.gateway.admission.keys import budget_period_id
from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.canonical import Usage
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.schemas import bounds
from sluicegate.gateway.schemas.chat import ChatCompletionRequest
from sluicegate.gateway.schemas.completions import CompletionRequest
from sluicegate.gateway.schemas.responses import ResponsesRequest
from sluicegate.gateway.schemas.wire import decode_body
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.translate.anthropic_in import MessagesRequest
from sluicegate.gateway.ui.common import FormError, page_number
from tests.gateway.key_records import key_record

from .servers import ServerThread, read_body, serve_lifespan

HI = [{"role": "user", "content": "hi"}]
LONG = [{"role": "user", "content": "word " * 40}]
"""Reserves ceil(200/3) + 4 = 71 prompt tokens; the upstream bills 41 (plus up to 5 out)."""
BUDGET = 100
"""A key's token budget: one LONG request fits (71 + 5 reserved, ~46 billed), two do not."""

# ---- helpers ---------------------------------------------------------------------------------


def _post(gateway: str, path: str, key: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    if path == "/v1/messages":
        headers = {"x-api-key": key, "content-type": "application/json"}
    # Compact JSON: the long lists below must fit the test gateway's 64 KiB body limit.
    raw = json.dumps(body, separators=(",", ":"))
    return httpx.post(f"{gateway}{path}", content=raw, headers=headers, timeout=30)


def _param_of(response: httpx.Response, path: str) -> str:
    """The field a 400 names: OpenAI's ``param``; for Anthropic, the path its message opens
    with (Anthropic's error has no ``param``; the gateway names the field in the message)."""
    assert response.status_code == 400, response.text
    body = response.json()
    if path == "/v1/messages":
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
        found = re.search(r"Invalid value for '([^']+)'", message)
        return found.group(1) if found else message.partition(":")[0]
    assert body["error"]["type"] == "invalid_request_error"
    return str(body["error"]["param"])


def _counter(settings: Settings, key_id: str) -> int:
    """The key's token budget counter in Redis (0 while admission never booked on it)."""
    period, _ = budget_period_id("month", time.time())
    client = redis.Redis.from_url(settings.redis_url)
    try:
        return int(client.get(f"sg:rl:{{{key_id}}}:b:{period}") or 0)
    finally:
        client.close()


# ---- point 1: no budget bypass ---------------------------------------------------------------

APIS: dict[str, tuple[str, dict[str, Any], str]] = {
    "chat": ("/v1/chat/completions", {"model": "echo", "messages": LONG}, "max_tokens"),
    "completions": ("/v1/completions", {"model": "echo", "prompt": "word " * 40}, "max_tokens"),
    "responses": ("/v1/responses", {"model": "echo", "input": LONG}, "max_output_tokens"),
    "anthropic": ("/v1/messages", {"model": "echo", "messages": LONG}, "max_tokens"),
}
"""Per inbound API: its path, a body reserving about 70 prompt tokens, its output-cap field."""

HOSTILE_CAPS = [-1_000_000, -1, 0, 2**62, bounds.MAX_OUTPUT_TOKENS + 1]


@pytest.mark.parametrize("api", list(APIS))
def test_a_hostile_output_cap_is_a_400_and_the_budget_still_holds(
    gateway: str,
    make_key_record: Callable[..., dict[str, Any]],
    api_settings: Settings,
    api: str,
) -> None:
    path, body, field = APIS[api]
    record = make_key_record(token_budget=BUDGET, budget_period="month")
    key, key_id = record["key"], record["id"]
    for cap in HOSTILE_CAPS:
        hostile = _post(gateway, path, key, {**body, field: cap})
        assert _param_of(hostile, path) == field, (cap, hostile.text)
    if api == "chat":
        # max_tokens of 2**62 with n 128 (the overflow of the issue), max_completion_tokens.
        huge = _post(gateway, path, key, {**body, "max_tokens": 2**62, "n": 128})
        assert _param_of(huge, path) == "max_tokens"
        for cap in (-1_000_000, 0):
            refused = _post(gateway, path, key, {**body, "max_completion_tokens": cap})
            assert _param_of(refused, path) == "max_completion_tokens"
    assert _counter(api_settings, key_id) == 0, "a refused request booked nothing"

    # The budget holds: 71 + 5 reserved fits 100 once; what it billed (~46) plus the next
    # reservation does not. With the bypass, the counter read -1000001 and all of these passed.
    outcomes = []
    for _ in range(5):
        response = _post(gateway, path, key, {**body, field: 5})
        outcomes.append(response.status_code)
        if response.status_code == 429:
            if path == "/v1/messages":
                assert response.json()["error"]["type"] == "rate_limit_error"
            else:
                assert response.json()["error"]["code"] == "insufficient_quota"
    assert outcomes[0] == 200, outcomes
    assert 429 in outcomes, outcomes
    assert outcomes == [200] * outcomes.index(429) + [429] * (5 - outcomes.index(429))
    assert 0 < _counter(api_settings, key_id) <= BUDGET


async def test_the_limiter_books_no_negative_reservation_and_settles_no_negative_count(
    api_settings: Settings,
) -> None:
    """Defence in depth: whatever let a negative count through, the limiter neither books it
    nor lets a settle push a counter below zero."""
    client = AsyncRedis.from_url(api_settings.redis_url)
    limiter = RateLimiter(client, slot_ttl_s=60)
    key = key_record(token_budget=BUDGET, tpm_limit=1_000)
    try:
        with pytest.raises(InvalidRequest):
            await limiter.admit(key, uuid.uuid4().hex, -1_000_000)
        assert (await limiter.counters("key", key, None))[0] == 0
        admission = await limiter.admit(key, uuid.uuid4().hex, 17, prompt_tokens=5)
        await limiter.settle(admission, -1_000_000, -5)
        assert await limiter.counters("key", key, None) == (0, 0)
    finally:
        names = [name async for name in client.scan_iter(f"sg:rl:{{{key.id}}}*")]
        if names:
            await client.delete(*names)
        await client.aclose()


# ---- upstream usage is clamped ---------------------------------------------------------------


def test_usage_is_clamped_into_its_bounds() -> None:
    assert Usage(-1_000_000, -5, -1, -2, -3) == Usage(0, 0)
    assert Usage(2**70, 3).prompt_tokens == bounds.MAX_USAGE_TOKENS
    decoded = msgspec.json.decode(b'{"prompt_tokens":-7,"completion_tokens":4}', type=Usage)
    assert decoded == Usage(0, 4)
    assert Usage(3, 4, 1) == Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1)


NEGATIVE_USAGE = {"prompt_tokens": -1_000_000, "completion_tokens": -5, "total_tokens": -1_000_005}


class NegativeUsageUpstream:
    """An OpenAI-compatible upstream whose every answer reports a negative usage."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        body = json.loads(await read_body(receive))
        head = {"id": "up-1", "created": int(time.time()), "model": body["model"]}
        if not body.get("stream"):
            message = {"role": "assistant", "content": "w0 "}
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            answer = {**head, "object": "chat.completion", "choices": [choice]}
            data = json.dumps({**answer, "usage": NEGATIVE_USAGE}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": data})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        chunk = {**head, "object": "chat.completion.chunk"}
        delta = {"index": 0, "delta": {"role": "assistant", "content": "w0 "}, "logprobs": None}
        events = [
            {**chunk, "choices": [{**delta, "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {**chunk, "choices": [], "usage": NEGATIVE_USAGE},
        ]
        for event in events:
            data = b"data: " + json.dumps(event).encode() + b"\n\n"
            await send({"type": "http.response.body", "body": data, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


WINDOW = 64
"""The declared context window of the ``windowed`` model."""


@pytest.fixture(scope="module")
def own_gateway(
    api_settings: Settings,
    upstream: tuple[Any, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A gateway replica (same database and Redis) with two models of its own: ``liar``,
    whose upstream reports negative usage, and ``windowed``, the echo upstream behind a
    deployment that declares a context window of ``WINDOW`` tokens."""
    liar = ServerThread(NegativeUsageUpstream()).start()
    config = Path(tmp_path_factory.mktemp("own")) / "models.yaml"
    models = [
        {
            "name": "liar",
            "deployments": [{"provider": "openai", "base_url": liar.url + "/v1", "model": "liar"}],
        },
        {
            "name": "windowed",
            "deployments": [
                {
                    "provider": "openai",
                    "base_url": upstream[1],
                    "model": "echo",
                    "context_window": WINDOW,
                }
            ],
        },
    ]
    config.write_text(yaml.safe_dump({"models": models}))
    settings = dataclasses.replace(api_settings, config=str(config))
    gateway = ServerThread(create_asgi_app(settings)).start()
    yield gateway.url
    gateway.stop()
    liar.stop()


@pytest.mark.parametrize("api", list(APIS))
def test_an_output_cap_past_the_context_window_is_a_400(
    own_gateway: str, make_key: Callable[..., str], api: str
) -> None:
    path, _, field = APIS[api]
    body = {**APIS[api][1], "model": "windowed"}
    body = {**body, "messages": HI} if "messages" in body else body
    body = {**body, "input": HI} if "input" in body else body
    body = {**body, "prompt": "hi"} if "prompt" in body else body
    key = make_key()
    refused = _post(own_gateway, path, key, {**body, field: WINDOW + 1})
    assert _param_of(refused, path) == field
    served = _post(own_gateway, path, key, {**body, field: 5})
    assert served.status_code == 200, served.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_negative_upstream_usage_leaves_the_counters_non_negative(
    own_gateway: str,
    make_key_record: Callable[..., dict[str, Any]],
    api_settings: Settings,
    usage_events: Callable[..., list[Any]],
    stream: bool,
) -> None:
    record = make_key_record(token_budget=BUDGET, budget_period="month")
    body: dict[str, Any] = {"model": "liar", "messages": HI, "max_tokens": 10}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    for _ in range(3):
        response = _post(own_gateway, "/v1/chat/completions", record["key"], body)
        assert response.status_code == 200, response.text
        request_id = response.headers["x-request-id"]
        (event,) = usage_events(request_id)
        assert event.prompt_tokens >= 0 and event.completion_tokens >= 0
        assert event.cost_micros >= 0
    assert _counter(api_settings, record["id"]) >= 0
    # The budget still refuses a reservation above it (the counter was not pushed below 0).
    over = _post(own_gateway, "/v1/chat/completions", record["key"], {**body, "max_tokens": BUDGET})
    assert over.status_code == 429, over.text


# ---- point 2: every list, map and string is bounded ------------------------------------------

_TEXT_PART = {"type": "text", "text": ""}
_FUNCTION = {"type": "function", "function": {"name": "f"}}

CHAT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"stop": ["x"] * (bounds.MAX_STOP + 1)}, "stop"),
    ({"stop": "x" * (bounds.MAX_STOP_CHARS + 1)}, "stop"),
    ({"metadata": {f"k{i}": "v" for i in range(bounds.MAX_METADATA_PAIRS + 1)}}, "metadata"),
    ({"metadata": {"k" * (bounds.MAX_METADATA_KEY + 1): "v"}}, "metadata"),
    ({"metadata": {"k": "v" * (bounds.MAX_METADATA_VALUE + 1)}}, "metadata"),
    ({"logit_bias": {str(i): 1 for i in range(bounds.MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": bounds.MAX_TOP_K + 1}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": bounds.MAX_N + 1}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [1] * (bounds.MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
    ({"guided_choice": ["a"] * (bounds.MAX_GUIDED_CHOICES + 1)}, "guided_choice"),
    ({"guided_choice": []}, "guided_choice"),
    ({"messages": [{"role": "user", "content": ""}] * (bounds.MAX_MESSAGES + 1)}, "messages"),
    (
        {"messages": [{"role": "user", "content": [_TEXT_PART] * (bounds.MAX_CONTENT_PARTS + 1)}]},
        "messages[0].content",
    ),
    ({"tools": [_FUNCTION] * (bounds.MAX_TOOLS + 1)}, "tools"),
]

COMPLETION_CASES: list[tuple[dict[str, Any], str]] = [
    ({"stop": ["x"] * (bounds.MAX_STOP + 1)}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": 3}, "temperature"),
    ({"top_k": -7}, "top_k"),
    ({"n": 129}, "n"),
    ({"logit_bias": {"5": -101}}, "logit_bias"),
    ({"guided_choice": ["a"] * (bounds.MAX_GUIDED_CHOICES + 1)}, "guided_choice"),
]

RESPONSES_CASES: list[tuple[dict[str, Any], str]] = [
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.5}, "top_p"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"metadata": {f"k{i}": "v" for i in range(bounds.MAX_METADATA_PAIRS + 1)}}, "metadata"),
    ({"metadata": {"k" * (bounds.MAX_METADATA_KEY + 1): "v"}}, "metadata"),
    ({"metadata": {"k": "v" * (bounds.MAX_METADATA_VALUE + 1)}}, "metadata"),
    ({"tools": [{"type": "function", "name": "f"}] * (bounds.MAX_TOOLS + 1)}, "tools"),
    ({"include": ["message.output_text.logprobs"] * (bounds.MAX_INCLUDE + 1)}, "include"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": ""}] * 1025}]},
        "input[0].content",
    ),
]

ANTHROPIC_CASES: list[tuple[dict[str, Any], str]] = [
    ({"temperature": 99}, "temperature"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -7}, "top_k"),
    ({"stop_sequences": ["x"] * (bounds.MAX_STOP_SEQUENCES + 1)}, "stop_sequences"),
    ({"stop_sequences": ["x" * (bounds.MAX_STOP_CHARS + 1)]}, "stop_sequences[0]"),
    ({"metadata": {"user_id": "u" * (bounds.MAX_USER_ID + 1)}}, "metadata.user_id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens"),
    (
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}] * (bounds.MAX_TOOLS + 1)},
        "tools",
    ),
    (
        {"messages": [{"role": "user", "content": [_TEXT_PART] * (bounds.MAX_CONTENT_PARTS + 1)}]},
        "messages[0].content",
    ),
    ({"system": [_TEXT_PART] * (bounds.MAX_CONTENT_PARTS + 1)}, "system"),
]

FAMILIES: dict[str, tuple[str, dict[str, Any], list[tuple[dict[str, Any], str]]]] = {
    "chat": ("/v1/chat/completions", {"model": "echo", "messages": HI}, CHAT_CASES),
    "completions": ("/v1/completions", {"model": "echo", "prompt": "hi"}, COMPLETION_CASES),
    "responses": ("/v1/responses", {"model": "echo", "input": "hi"}, RESPONSES_CASES),
    "anthropic": (
        "/v1/messages",
        {"model": "echo", "messages": HI, "max_tokens": 5},
        ANTHROPIC_CASES,
    ),
}
CASES = [
    pytest.param(family, change, param, id=f"{family}-{param}-{i}")
    for family, (_, _, cases) in FAMILIES.items()
    for i, (change, param) in enumerate(cases)
]


@pytest.fixture(scope="module")
def key(make_key: Callable[..., str]) -> str:
    return make_key()


@pytest.mark.parametrize(("family", "change", "param"), CASES)
def test_a_value_past_its_bound_is_a_400_naming_the_field(
    gateway: str, key: str, family: str, change: dict[str, Any], param: str
) -> None:
    path, body, _ = FAMILIES[family]
    response = _post(gateway, path, key, {**body, **change})
    assert _param_of(response, path) == param, response.text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_values_at_their_bounds_are_served(gateway: str, key: str, family: str) -> None:
    """The bounds refuse only what is past them: the documented extremes still pass."""
    path, body, _ = FAMILIES[family]
    extremes: dict[str, dict[str, Any]] = {
        "chat": {
            "stop": ["x"] * bounds.MAX_STOP,
            "metadata": {f"k{i}": "v" * 512 for i in range(bounds.MAX_METADATA_PAIRS)},
            "temperature": 2,
            "top_p": 1,
            "presence_penalty": -2,
            "frequency_penalty": 2,
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": 5,
        },
        "completions": {"stop": ["x"] * bounds.MAX_STOP, "temperature": 0, "max_tokens": 5},
        "responses": {"temperature": 2, "top_p": 0, "max_output_tokens": 5},
        "anthropic": {
            "temperature": 1,
            "top_p": 1,
            "top_k": 0,
            "stop_sequences": ["zz"] * bounds.MAX_STOP_SEQUENCES,
            "metadata": {"user_id": "u" * bounds.MAX_USER_ID},
        },
    }
    response = _post(gateway, path, key, {**body, **extremes[family]})
    assert response.status_code == 200, response.text


GRAMMAR = "a" * (bounds.MAX_GRAMMAR_CHARS + 1)


@pytest.mark.parametrize(
    ("model", "document", "param"),
    [
        (
            ResponsesRequest,
            {"model": "m", "input": [{"role": "user", "content": ""}] * 10_001},
            "input",
        ),
        (
            MessagesRequest,
            {
                "model": "m",
                "max_tokens": 5,
                "messages": [{"role": "user", "content": ""}] * 100_001,
            },
            "messages",
        ),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": HI, "guided_regex": GRAMMAR},
            "guided_regex",
        ),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": HI, "guided_grammar": GRAMMAR},
            "guided_grammar",
        ),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": HI, "guided_json": GRAMMAR},
            "guided_json",
        ),
        (
            CompletionRequest,
            {"model": "m", "prompt": "hi", "guided_grammar": GRAMMAR},
            "guided_grammar",
        ),
    ],
    ids=[
        "responses-input-items",
        "anthropic-messages",
        "chat-guided_regex",
        "chat-guided_grammar",
        "chat-guided_json",
        "completions-guided_grammar",
    ],
)
def test_values_too_long_for_the_test_body_limit_are_bounded_too(
    model: type, document: dict[str, Any], param: str
) -> None:
    """Past the test gateway's 64 KiB body: the decoder's own 400 (as the endpoints answer it)."""
    with pytest.raises(InvalidRequest) as caught:
        decode_body(json.dumps(document).encode(), model)
    assert caught.value.param == param


# ---- the admin UI's paging -------------------------------------------------------------------


def test_a_huge_ui_page_number_is_a_400(gateway: str, api_settings: Settings) -> None:
    assert page_number("3") == 3 and page_number("x") == 1 and page_number("-4") == 1
    with pytest.raises(FormError):
        page_number(str(bounds.MAX_PAGE + 1))
    with httpx.Client(base_url=gateway, timeout=10) as client:
        page = client.get("/ui")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert token is not None
        signed_in = client.post(
            "/ui/sign-in",
            data={"csrf_token": token.group(1), "key": api_settings.master_key},
            follow_redirects=False,
        )
        assert signed_in.status_code == 303, signed_in.text
        assert client.get("/ui/keys?page=2").status_code == 200
        for path in ("/ui/keys", "/ui/audit"):
            huge = client.get(f"{path}?page=999999999999999999999")
            assert huge.status_code == 400, (path, huge.text[:300])
            assert "page must be at most" in huge.text.lower()
