"""A fake Anthropic Messages API (``POST /v1/messages``), streamed and not, per its docs.

Requires ``x-api-key: ant-test-key`` and an ``anthropic-version`` header. Answers by the
shared fake model (fake_common.py); a ``thinking`` request gets a thinking block first; usage
reports 2 cache-read and 1 cache-write tokens besides ``input_tokens``. Errors use Anthropic's
``{"type": "error", "error": {...}}`` shape: ``limited`` 429 rate_limit_error, ``down`` 529
overloaded_error, ``bad`` 400 invalid_request_error; ``once-limited`` answers every other call
429 with ``retry-after-ms: 300``; ``short-context`` refuses prompts over 3 words as too long;
``opens-overloaded`` streams ``message_start`` and a ``ping``, then an ``overloaded_error``
event, as Anthropic does when it runs out of capacity after opening a stream (whole: 529).
``POST /v1/messages/count_tokens`` answers ``{"input_tokens": N}``: the words of the messages
and the system prompt, plus each tool's name and description words; like Anthropic's, it
refuses the fields it does not take (``max_tokens``, sampling, ``stream``, ...). With thinking
on, an assistant turn that called a tool must start with the thinking block the fake issued,
signature and all, as Anthropic's must. Model ``interleaved`` thinks in several blocks, as
Claude does with interleaved thinking: a signed block, a ``redacted_thinking`` one, the text,
another signed block, then the tool call; an assistant turn holding any of its thinking must
hold all of it, in its place, exactly as issued (the text between may differ).
"""

from __future__ import annotations

import json
from typing import Any

from .fake_common import (
    TOOL_ARGUMENTS,
    FakeServer,
    count_words,
    plan,
    send_bytes,
    send_json,
    sse,
    start_stream,
)

API_KEY = "ant-test-key"
THINKING = "let me think"
SIGNATURE = "EqQBCkYIBxgCKkD-fake-signature+/="
"""Shaped like Anthropic's (base64 with '+', '/', '=')."""
INTERLEAVED_TEXT = "Let me check."
INTERLEAVED: list[dict[str, Any]] = [
    {"type": "thinking", "thinking": "first the city", "signature": "EqQBCkYIBxgCKkD-first+/="},
    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT+/="},
    {"type": "text", "text": INTERLEAVED_TEXT},
    {"type": "thinking", "thinking": "then its weather", "signature": "EqQBCkYIBxgCKkD-then+/="},
]
"""What model ``interleaved`` answers before its tool call, with thinking on."""
_COUNTED_FIELDS = {
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "output_config",
    "cache_control",
}
_ERRORS = {
    "limited": (429, "rate_limit_error", "Number of request tokens has exceeded your limit."),
    "down": (529, "overloaded_error", "Overloaded"),
    "bad": (400, "invalid_request_error", "messages: roles must alternate"),
}


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


class FakeAnthropic(FakeServer):
    async def handle(
        self, scope: dict[str, Any], headers: dict[str, str], raw: bytes, body: Any, send: Any
    ) -> None:
        if scope["path"] not in {"/v1/messages", "/v1/messages/count_tokens"}:
            return await send_json(send, 404, _error("not_found_error", "Not found"))
        if headers.get("x-api-key") != API_KEY:
            return await send_json(send, 401, _error("authentication_error", "invalid x-api-key"))
        if not headers.get("anthropic-version"):
            return await send_json(
                send, 400, _error("invalid_request_error", "anthropic-version header is required")
            )
        if scope["path"].endswith("/count_tokens"):
            return await _count_tokens(body, send)
        unsigned = _unsigned_tool_turn(body)
        if unsigned is not None:
            return await send_json(send, 400, _error("invalid_request_error", unsigned))
        model = body["model"]
        self.calls[model] += 1
        if model == "once-limited" and self.calls[model] % 2 == 1:
            error = _error("rate_limit_error", "Slow down.")
            return await send_json(send, 429, error, {"retry-after-ms": "300"})
        if model == "short-context" and count_words(body["messages"]) > 3:
            error = _error("invalid_request_error", "prompt is too long: 4 tokens > 3 maximum")
            return await send_json(send, 400, error)
        if model in _ERRORS or (model == "opens-overloaded" and not body.get("stream")):
            status, kind, message = _ERRORS.get(model, _ERRORS["down"])
            extra = {"retry-after": "0"} if status == 429 else {}
            return await send_json(send, status, _error(kind, message), extra)
        tools = [t["name"] for t in body.get("tools") or ()]
        choice = body.get("tool_choice") or {}
        forced = {"any": "", "tool": choice.get("name")}.get(choice.get("type", "auto"))
        last_user = next(
            (json.dumps(m["content"]) for m in reversed(body["messages"]) if m["role"] == "user"),
            "",
        )
        answer = plan(body["max_tokens"], tools, forced, last_user, body.get("stop_sequences"))
        blocks: list[dict[str, Any]] = []
        if model == "interleaved" and answer.tool:
            blocks += INTERLEAVED
        elif (body.get("thinking") or {}).get("type") in {"enabled", "adaptive"}:
            blocks.append({"type": "thinking", "thinking": THINKING, "signature": SIGNATURE})
        if answer.tool:
            call = {
                "type": "tool_use",
                "id": "toolu_01",
                "name": answer.tool,
                "input": TOOL_ARGUMENTS,
            }
            blocks.append(call)
            stop_reason = "tool_use"
        else:
            blocks.append({"type": "text", "text": "".join(answer.words)})
            stop_reason = "max_tokens" if answer.length_cut else "end_turn"
        if answer.stopped_by:
            stop_reason = "stop_sequence"
        output_tokens = len(answer.words) or 7
        usage = {
            "input_tokens": count_words(body.get("messages")) + count_words(body.get("system")),
            "output_tokens": output_tokens,
            "cache_read_input_tokens": 2,
            "cache_creation_input_tokens": 1,
        }
        message = {
            "id": "msg_fake01",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": blocks,
            "stop_reason": stop_reason,
            "stop_sequence": answer.stopped_by,
            "usage": usage,
        }
        if not body.get("stream"):
            return await send_json(send, 200, message)
        await start_stream(send)
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {**usage, "output_tokens": 1}
        await send_bytes(send, sse({"type": "message_start", "message": start}, "message_start"))
        await send_bytes(send, sse({"type": "ping"}, "ping"))
        if model == "opens-overloaded":
            overloaded = _error(*_ERRORS["down"][1:])
            return await send_bytes(send, sse(overloaded, "error"), more=False)
        for index, block in enumerate(blocks):
            for event in _block_events(index, block):
                await send_bytes(send, sse(event, event["type"]))
        delta = {"stop_reason": stop_reason, "stop_sequence": answer.stopped_by}
        end = {"type": "message_delta", "delta": delta, "usage": {"output_tokens": output_tokens}}
        await send_bytes(send, sse(end, "message_delta"))
        await send_bytes(send, sse({"type": "message_stop"}, "message_stop"), more=False)


def _unsigned_tool_turn(body: dict[str, Any]) -> str | None:
    if (body.get("thinking") or {}).get("type") not in {"enabled", "adaptive"}:
        return None
    for i, message in enumerate(body["messages"]):
        content = message["content"]
        if message["role"] != "assistant" or isinstance(content, str):
            continue
        if body["model"] == "interleaved":
            if _thinking_shape(content[: len(INTERLEAVED)]) != _thinking_shape(INTERLEAVED):
                return (
                    f"messages.{i}.content: thinking or redacted_thinking blocks in the latest "
                    "assistant message cannot be modified"
                )
            continue
        if not any(block["type"] == "tool_use" for block in content):
            continue
        first = content[0]
        if first.get("type") != "thinking" or (first.get("thinking"), first.get("signature")) != (
            THINKING,
            SIGNATURE,
        ):
            return (
                f"messages.{i}.content.0: when thinking is enabled, an assistant message with "
                "tool use must start with its thinking block, as it was returned"
            )
    return None


def _thinking_shape(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks, with each text's own words left out (streamed text comes back spaced)."""
    return [{"type": "text"} if b["type"] == "text" else b for b in blocks]


async def _count_tokens(body: dict[str, Any], send: Any) -> None:
    extra = sorted(set(body) - _COUNTED_FIELDS)
    if extra:
        error = _error("invalid_request_error", f"{extra[0]}: Extra inputs are not permitted")
        return await send_json(send, 400, error)
    tools = sum(1 + len((t.get("description") or "").split()) for t in body.get("tools") or ())
    tokens = count_words(body.get("messages")) + count_words(body.get("system")) + tools
    await send_json(send, 200, {"input_tokens": tokens})


def _block_events(index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
    kind = block["type"]
    events: list[dict[str, Any]] = []
    if kind == "text":
        events.append({"index": index, "content_block": {"type": "text", "text": ""}})
        for word in block["text"].split(" "):
            if word:
                delta = {"type": "text_delta", "text": word + " "}
                events.append({"type": "content_block_delta", "index": index, "delta": delta})
    elif kind == "redacted_thinking":
        events.append({"index": index, "content_block": block})
    elif kind == "thinking":
        events.append({"index": index, "content_block": {"type": "thinking", "thinking": ""}})
        delta = {"type": "thinking_delta", "thinking": block["thinking"]}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        signature = {"type": "signature_delta", "signature": block["signature"]}
        events.append({"type": "content_block_delta", "index": index, "delta": signature})
    else:
        head = {**block, "input": {}}
        events.append({"index": index, "content_block": head})
        text = json.dumps(block["input"])
        for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
            delta = {"type": "input_json_delta", "partial_json": piece}
            events.append({"type": "content_block_delta", "index": index, "delta": delta})
    events[0]["type"] = "content_block_start"
    events.append({"type": "content_block_stop", "index": index})
    return events
