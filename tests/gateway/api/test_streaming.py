"""SSE exactly as OpenAI sends it; errors after the first byte; client disconnects."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
import openai
import pytest

from .servers import Upstream

HELLO = [{"role": "user", "content": "hello world"}]


def _events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line]


def test_sse_wire_format(gateway: str, make_key: Callable[..., str]) -> None:
    body = {
        "model": "echo",
        "messages": HELLO,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"authorization": f"Bearer {make_key(rpm_limit=50)}"}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-ratelimit-limit-requests"] == "50"
        assert r.headers["x-request-id"]
        raw = r.read().decode()
    blocks = raw.split("\n\n")
    assert blocks[-1] == "" and all(b.startswith("data: ") for b in blocks[:-1])
    events = [b.removeprefix("data: ") for b in blocks[:-1]]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert len({(c["id"], c["created"], c["object"]) for c in chunks}) == 1


def test_error_after_streaming_began_is_an_error_event(
    gateway: str, make_key: Callable[..., str], usage_events: Callable[..., list]
) -> None:
    headers = {"authorization": f"Bearer {make_key()}"}
    body = {"model": "breaks", "messages": HELLO, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        events = _events(r)
        request_id = r.headers["x-request-id"]
    contents = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert contents == ["", "w0 ", "w1 "]
    error = json.loads(events[-1])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    (event,) = usage_events(request_id)
    assert (event.status, event.completion_tokens) == ("error", 2)

    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=headers["authorization"][7:])
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="breaks", messages=HELLO, stream=True))


def test_client_disconnect_cancels_upstream_and_bills_delivered_tokens(
    gateway: str,
    make_key: Callable[..., str],
    usage_events: Callable[..., list],
    upstream: tuple[Upstream, str],
) -> None:
    app, _ = upstream
    before = app.disconnected
    key = make_key(max_parallel_requests=1)
    headers = {"authorization": f"Bearer {key}"}
    body = {"model": "slow", "messages": HELLO, "stream": True, "max_tokens": 20}
    received = 0
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"w' in line:
                received += 1
                if received == 3:
                    break
    (event,) = usage_events(request_id, wait_s=5)
    assert event.status == "cancelled"
    # A chunk or two may have been in flight when the client hung up; never all 20.
    assert 3 <= event.completion_tokens <= 5
    assert event.prompt_tokens > 0
    deadline = time.monotonic() + 5
    while app.disconnected == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert app.disconnected == before + 1, "the upstream call was not cancelled"
    # The concurrency slot came back: the key (1 parallel request) can be used again.
    again = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "echo", "messages": HELLO},
        headers=headers,
    )
    assert again.status_code == 200, again.text
