"""Canonical requests as Anthropic Messages bodies, and Anthropic's answers as canonical ones.

Used by the ``anthropic`` provider. System and developer turns become ``system``; ``tool`` turns
become ``user`` turns of ``tool_result`` blocks; consecutive turns of one role are merged, as the
Messages API wants alternating roles (translate/turns.py, shared with Bedrock and Gemini).
"""

from __future__ import annotations

import json
from typing import Any

from sluicegate.gateway.canonical import (
    ChatRequest,
    Choice,
    ChoiceDelta,
    Chunk,
    ImagePart,
    Message,
    Part,
    ReasoningPiece,
    Response,
    TextPart,
    Thinking,
    ToolCall,
    ToolCallDelta,
    ToolResult,
    Usage,
)
from sluicegate.gateway.providers.features import data_url
from sluicegate.gateway.translate.turns import (
    split_turns,
    tool_input,
    usage_with_cache,
    with_thinking,
)

DEFAULT_MAX_TOKENS = 4096
"""Anthropic requires ``max_tokens``; used when the client set none."""

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "pause_turn": "stop",
    "refusal": "content_filter",
    "model_context_window_exceeded": "length",
}


def image_block(part: ImagePart) -> dict[str, Any]:
    if part.url.startswith("data:"):
        media_type, data = data_url(part.url)
        source = {"type": "base64", "media_type": media_type, "data": data}
    else:
        source = {"type": "url", "url": part.url}
    return {"type": "image", "source": source}


def _block(part: Part) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, ImagePart):
        return image_block(part)
    if isinstance(part, ToolCall):
        return {
            "type": "tool_use",
            "id": part.id,
            "name": part.name,
            "input": tool_input(part.arguments),
        }
    if isinstance(part, ToolResult):
        content = [_block(p) for p in part.content]
        block: dict[str, Any] = {"type": "tool_result", "tool_use_id": part.tool_call_id}
        if content:
            block["content"] = content
        if part.is_error:
            block["is_error"] = True
        return block
    raise TypeError(f"no Anthropic block for {type(part).__name__}")


def _thinking_block(piece: ReasoningPiece) -> dict[str, Any]:
    if piece.redacted is not None:
        return {"type": "redacted_thinking", "data": piece.redacted}
    return {"type": "thinking", "thinking": piece.text, "signature": piece.signature}


def _blocks(message: Message) -> list[dict[str, Any]]:
    def block_of(part: Part) -> dict[str, Any] | None:
        return None if isinstance(part, TextPart) and not part.text else _block(part)

    return with_thinking(message, block_of, _thinking_block)


def thinking_param(thinking: Thinking) -> dict[str, Any]:
    """Claude's ``thinking`` parameter (Anthropic's API and Bedrock's take the same)."""
    param: dict[str, Any] = {"type": thinking.type}
    if thinking.type == "enabled":
        param["budget_tokens"] = thinking.budget_tokens or 1024
    if thinking.display is not None and thinking.type != "disabled":
        param["display"] = thinking.display
    return param


def messages_body(request: ChatRequest, model: str) -> dict[str, Any]:
    """The Messages API body for ``request`` (features already checked by the provider)."""
    system, turns = split_turns(request.messages or (), _blocks)
    s = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": s.max_tokens or DEFAULT_MAX_TOKENS,
        "messages": turns,
    }
    if system:
        body["system"] = "\n\n".join(system)
    optional = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "stop_sequences": s.stop,
        "service_tier": request.service_tier,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    # Anthropic's user_id is OpenAI's safety_identifier (an opaque id of the end user, for
    # abuse detection), and OpenAI's older user field served the same end: one of them goes.
    user = request.safety_identifier or request.user
    if user:
        body["metadata"] = {"user_id": user}
    if request.tools:
        body["tools"] = [
            {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                "input_schema": t.parameters or {"type": "object", "properties": {}},
                **({"strict": True} if t.strict else {}),
            }
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None or request.parallel_tool_calls is False:
        mode = choice.mode if choice else "auto"
        tool_choice: dict[str, Any] = {
            "auto": {"type": "auto"},
            "required": {"type": "any"},
            "none": {"type": "none"},
            "function": {"type": "tool", "name": choice.name if choice else ""},
        }[mode]
        if request.parallel_tool_calls is False and mode != "none":
            tool_choice["disable_parallel_tool_use"] = True
        body["tool_choice"] = tool_choice
    output_config: dict[str, Any] = {}
    if request.output is not None and request.output.kind == "json_schema":
        output_config["format"] = {"type": "json_schema", "schema": request.output.schema or {}}
    if request.reasoning_effort is not None:
        output_config["effort"] = {"minimal": "low", "none": "low"}.get(
            request.reasoning_effort, request.reasoning_effort
        )
    if output_config:
        body["output_config"] = output_config
    if request.thinking is not None:
        body["thinking"] = thinking_param(request.thinking)
    return body


def usage_of(raw: dict[str, Any] | None) -> Usage | None:
    """Anthropic counts cached prompt tokens apart from ``input_tokens``; ours include them."""
    return usage_with_cache(
        raw,
        input="input_tokens",
        output="output_tokens",
        read="cache_read_input_tokens",
        written="cache_creation_input_tokens",
    )


def response_of(body: dict[str, Any]) -> Response:
    parts: list[Part] = []
    reasoning: list[str] = []
    pieces: list[ReasoningPiece] = []
    for block in body.get("content") or ():
        kind = block.get("type")
        if kind == "text":
            parts.append(TextPart(block.get("text", "")))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {}, separators=(",", ":"))
            parts.append(ToolCall(block["id"], block["name"], arguments))
        elif kind == "thinking":
            # Each block keeps its own signature: a signature covers its own block's text.
            text = block.get("thinking", "")
            reasoning.append(text)
            pieces.append(ReasoningPiece(text, block.get("signature") or None, at=len(parts)))
        elif kind == "redacted_thinking":
            pieces.append(ReasoningPiece(redacted=block.get("data", ""), at=len(parts)))
    stop_reason = body.get("stop_reason") or "end_turn"
    message = Message(
        "assistant",
        parts,
        reasoning="".join(reasoning) if reasoning else None,
        reasoning_pieces=pieces or None,
    )
    choice = Choice(
        0,
        message,
        FINISH_REASONS.get(stop_reason, stop_reason),
        stop_sequence=body.get("stop_sequence"),
    )
    usage = usage_of(body.get("usage"))
    return Response([choice], usage=usage, num_tokens=usage.completion_tokens if usage else 0)


class StreamReader:
    """Anthropic's stream events in, canonical chunks out (tool calls numbered per message)."""

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}
        """Content-block index -> tool-call index."""
        self._input: dict[str, Any] = {}
        self.usage: dict[str, Any] = {}

    def read(self, event: dict[str, Any]) -> Chunk | None:
        kind = event.get("type")
        if kind == "message_start":
            self.usage.update((event.get("message") or {}).get("usage") or {})
            prompt = usage_of(self.usage)
            return Chunk(prompt_tokens=prompt.prompt_tokens if prompt else 0)
        if kind == "content_block_start":
            block = event.get("content_block") or {}
            if block.get("type") == "tool_use":
                index = self._calls[event["index"]] = len(self._calls)
                head = ToolCallDelta(index, id=block.get("id"), name=block.get("name"))
                return Chunk([ChoiceDelta(tool_calls=[head])])
            if block.get("type") == "redacted_thinking":
                return Chunk([ChoiceDelta(reasoning_redacted=block.get("data", ""))])
            if block.get("type") == "text" and block.get("text"):
                return Chunk([ChoiceDelta(text=block["text"])], num_tokens=1)
            return None
        if kind == "content_block_delta":
            delta = event.get("delta") or {}
            dtype = delta.get("type")
            if dtype == "text_delta":
                return Chunk([ChoiceDelta(text=delta.get("text", ""))], num_tokens=1)
            if dtype == "thinking_delta":
                return Chunk([ChoiceDelta(reasoning=delta.get("thinking", ""))], num_tokens=1)
            if dtype == "signature_delta" and delta.get("signature"):
                return Chunk([ChoiceDelta(reasoning_signature=delta["signature"])])
            if dtype == "input_json_delta":
                piece = ToolCallDelta(
                    self._calls.get(event.get("index", 0), 0),
                    arguments=delta.get("partial_json", ""),
                )
                return Chunk([ChoiceDelta(tool_calls=[piece])], num_tokens=1)
            return None
        if kind == "message_delta":
            self.usage.update(event.get("usage") or {})
            delta = event.get("delta") or {}
            stop_reason = delta.get("stop_reason") or "end_turn"
            finish = ChoiceDelta(
                finish_reason=FINISH_REASONS.get(stop_reason, stop_reason),
                stop_sequence=delta.get("stop_sequence"),
            )
            return Chunk([finish], usage=usage_of(self.usage))
        return None
