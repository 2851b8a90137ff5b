"""Canonical answers rendered as Anthropic Messages replies: the whole ``message`` object, and
the exact stream of events (``message_start``, ``content_block_start`` / ``_delta`` /
``_stop``, ``message_delta``, ``message_stop``, ``ping``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from sluicegate.gateway.canonical import (
    Chunk,
    Message,
    ReasoningPiece,
    Response,
    TextPart,
    ToolCall,
    Usage,
)

STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
    "abort": "end_turn",
}

_encode = msgspec.json.Encoder().encode

Sign = Callable[[str, str], str]
"""The signature of a thinking text, given the backend's own signature of it ("" if none):
sluicegate/gateway/api/anthropic_thinking.py."""


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "stop", "end_turn")


def usage_body(usage: Usage) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart from ``input_tokens``."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - usage.cache_creation_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": usage.cache_creation_tokens,
    }


def tool_input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _pieces(message: Message) -> list[ReasoningPiece]:
    """The blocks of thinking to show: the backend's own, or all of its thinking as one."""
    if message.reasoning_pieces:
        return [p for p in message.reasoning_pieces if p.text or p.signature or p.redacted]
    return [ReasoningPiece(message.reasoning)] if message.reasoning else []


def _thinking_block(piece: ReasoningPiece, sign: Sign) -> dict[str, Any]:
    if piece.redacted is not None:
        # Encrypted by Anthropic, for Anthropic: it checks the block itself when it comes back.
        return {"type": "redacted_thinking", "data": piece.redacted}
    signature = sign(piece.text, piece.signature or "")
    return {"type": "thinking", "thinking": piece.text, "signature": signature}


def message_body(
    message_id: str,
    model: str,
    answer: Response,
    usage: Usage,
    finish_reason: str | None,
    sign: Sign,
) -> dict[str, Any]:
    choice = answer.choices[0] if answer.choices else None
    content: list[dict[str, Any]] = []
    stop_sequence = None
    if choice is not None:
        pieces = list(_pieces(choice.message))
        for k, part in enumerate(choice.message.parts):
            while pieces and pieces[0].at <= k:
                content.append(_thinking_block(pieces.pop(0), sign))
            if isinstance(part, TextPart) and part.text:
                content.append({"type": "text", "text": part.text})
            elif isinstance(part, ToolCall):
                content.append(
                    {
                        "type": "tool_use",
                        "id": part.id,
                        "name": part.name,
                        "input": tool_input(part.arguments),
                    }
                )
        content.extend(_thinking_block(piece, sign) for piece in pieces)
        stop_sequence = choice.stop_sequence
        finish_reason = choice.finish_reason or finish_reason
    if not content:
        content.append({"type": "text", "text": ""})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(finish_reason, stop_sequence),
        "stop_sequence": stop_sequence,
        "usage": usage_body(usage),
    }


def event(name: str, payload: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _encode(payload) + b"\n\n"


class StreamWriter:
    """One stream's events: content blocks opened and closed as the chunks' kinds change, and a
    thinking block also where the backend's signature ends it. A thinking block ends with its
    ``signature_delta``, as Anthropic's do."""

    def __init__(self, sign: Sign) -> None:
        self._sign = sign
        self._index = -1
        self._open: str | None = None
        self._thinking: list[str] = []
        self._upstream_signature = ""
        self.stop_sequence: str | None = None

    def start(self, message_id: str, model: str, prompt_tokens: int) -> bytes:
        message = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return event("message_start", {"type": "message_start", "message": message}) + event(
            "ping", {"type": "ping"}
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":
            signature = self._sign("".join(self._thinking), self._upstream_signature)
            self._thinking.clear()
            self._upstream_signature = ""
            out = self._delta({"type": "signature_delta", "signature": signature})
        self._open = None
        stop = {"type": "content_block_stop", "index": self._index}
        return out + event("content_block_stop", stop)

    def _block(self, kind: str, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        return out + event("content_block_start", start)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": self._index, "delta": delta}
        return event("content_block_delta", payload)

    def chunk(self, chunk: Chunk) -> bytes:
        out = b""
        for choice in chunk.choices[:1]:
            if choice.reasoning or choice.reasoning_signature:
                if self._open != "thinking":
                    out += self._block(
                        "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                    )
                if choice.reasoning:
                    self._thinking.append(choice.reasoning)
                    out += self._delta({"type": "thinking_delta", "thinking": choice.reasoning})
                if choice.reasoning_signature:
                    # The backend's signature ends its block: the next thinking is another
                    # block, with a signature of its own.
                    self._upstream_signature = choice.reasoning_signature
                    out += self._close()
            if choice.reasoning_redacted:
                redacted = {"type": "redacted_thinking", "data": choice.reasoning_redacted}
                out += self._block("redacted_thinking", redacted) + self._close()
            if choice.text:
                if self._open != "text":
                    out += self._block("text", {"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": choice.text})
            for call in choice.tool_calls or ():
                if call.id is not None or self._open != "tool_use":
                    block = {
                        "type": "tool_use",
                        "id": call.id or "",
                        "name": call.name or "",
                        "input": {},
                    }
                    out += self._block("tool_use", block)
                if call.arguments:
                    out += self._delta({"type": "input_json_delta", "partial_json": call.arguments})
            if choice.stop_sequence is not None:
                self.stop_sequence = choice.stop_sequence
        return out

    def end(self, finish_reason: str | None, usage: Usage) -> bytes:
        out = self._close()
        if self._index < 0:
            out += self._block("text", {"type": "text", "text": ""}) + self._close()
        delta = {
            "stop_reason": stop_reason(finish_reason, self.stop_sequence),
            "stop_sequence": self.stop_sequence,
        }
        payload = {"type": "message_delta", "delta": delta, "usage": usage_body(usage)}
        return (
            out + event("message_delta", payload) + event("message_stop", {"type": "message_stop"})
        )
