"""Canonical requests as OpenAI chat/completions bodies, and OpenAI's answers as canonical ones,
for backends that speak OpenAI's wire format under another address (Azure OpenAI). The
messages and tool choice are written the same way for OpenAI-compatible upstreams
(providers/openai_wire.py).

A request that came in by OpenAI's own API carries the client's body (``passthrough``): that
goes upstream field for field, ``model`` rewritten and usage asked for in streams. Requests
from other APIs are built from the canonical model.
"""

from __future__ import annotations

from typing import Any

from sluicegate.gateway.canonical import (
    AudioPart,
    ChatRequest,
    Choice,
    ChoiceDelta,
    Chunk,
    FilePart,
    ImagePart,
    Message,
    Part,
    Response,
    Sampling,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolResult,
    Usage,
)


def _part(part: Part) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, ImagePart):
        image = {"url": part.url, **({"detail": part.detail} if part.detail else {})}
        return {"type": "image_url", "image_url": image}
    if isinstance(part, AudioPart):
        return {"type": "input_audio", "input_audio": {"data": part.data, "format": part.format}}
    if isinstance(part, FilePart):
        pairs = (("file_id", part.file_id), ("filename", part.filename), ("file_data", part.data))
        return {"type": "file", "file": {k: v for k, v in pairs if v}}
    raise TypeError(f"{type(part).__name__} is not a content part")


def openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Canonical turns as OpenAI chat messages: a tool turn becomes one ``tool`` message per
    result; text-only content is a string; an assistant turn of only tool calls has no
    content (``null``), as OpenAI sends it."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            for result in message.parts:
                if isinstance(result, ToolResult):
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": result.tool_call_id,
                            "content": result.text(),
                        }
                    )
            continue
        parts = [p for p in message.parts if not isinstance(p, ToolCall | ToolResult)]
        entry: dict[str, Any] = {"role": message.role}
        if all(isinstance(p, TextPart) for p in parts):
            entry["content"] = "".join(p.text for p in parts if isinstance(p, TextPart))
        else:
            entry["content"] = [_part(p) for p in parts]
        calls = message.tool_calls()
        if calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
            if not entry["content"]:
                entry["content"] = None
        if message.name:
            entry["name"] = message.name
        out.append(entry)
    return out


def openai_sampling(s: Sampling, max_key: str = "max_completion_tokens") -> dict[str, Any]:
    """OpenAI's sampling fields (``None`` where unset); ``max_key`` names the length limit
    (``max_tokens`` for text completions)."""
    return {
        max_key: s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "n": s.n if s.n > 1 else None,
        "seed": s.seed,
        "stop": s.stop,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "logit_bias": {str(k): v for k, v in s.logit_bias.items()} if s.logit_bias else None,
        "logprobs": True if s.logprobs else None,
        "top_logprobs": s.top_logprobs,
    }


def openai_tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.mode == "function":
        return {"type": "function", "function": {"name": choice.name}}
    return choice.mode


def chat_body(request: ChatRequest, model: str | None, stream: bool) -> dict[str, Any]:
    if request.passthrough is not None:
        body = dict(request.passthrough)
    else:
        body = _built(request)
    if model is not None:
        body["model"] = model
    else:
        body.pop("model", None)
    if stream:
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    else:
        body.pop("stream", None)
        body.pop("stream_options", None)
    return body


def _built(request: ChatRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": openai_messages(request.messages or [])}
    optional: dict[str, Any] = {
        **openai_sampling(request.sampling),
        "parallel_tool_calls": request.parallel_tool_calls,
        "reasoning_effort": request.reasoning_effort,
        "user": request.user,
        "safety_identifier": request.safety_identifier,
        "prompt_cache_key": request.prompt_cache_key,
        "metadata": request.metadata,
        "service_tier": request.service_tier,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if request.tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    **({"parameters": t.parameters} if t.parameters else {}),
                    **({"strict": True} if t.strict else {}),
                },
            }
            for t in request.tools
        ]
    if request.tool_choice is not None:
        body["tool_choice"] = openai_tool_choice(request.tool_choice)
    output = request.output
    if output is not None and output.kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif output is not None and output.kind == "json_schema":
        schema = {"name": output.name or "response", "schema": output.schema or {}}
        if output.strict:
            schema["strict"] = True
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    return body


def usage_of(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    cached = ((raw.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    reasoning = ((raw.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0
    return Usage(
        int(raw.get("prompt_tokens") or 0),
        int(raw.get("completion_tokens") or 0),
        cached_tokens=int(cached),
        reasoning_tokens=int(reasoning),
    )


def response_of(body: dict[str, Any]) -> Response:
    choices = []
    for position, raw in enumerate(body.get("choices") or ()):
        message = raw.get("message") or {}
        parts: list[Part] = [TextPart(message.get("content") or "")]
        for call in message.get("tool_calls") or ():
            function = call.get("function") or {}
            parts.append(
                ToolCall(
                    call.get("id", ""), function.get("name", ""), function.get("arguments", "")
                )
            )
        choices.append(
            Choice(
                int(raw.get("index", position)),
                Message("assistant", parts, reasoning=message.get("reasoning_content")),
                raw.get("finish_reason") or "stop",
                refusal=message.get("refusal"),
            )
        )
    usage = usage_of(body.get("usage"))
    return Response(
        choices, usage=usage, num_tokens=usage.completion_tokens if usage else 0, raw=body
    )


def chunk_of(body: dict[str, Any]) -> Chunk:
    deltas = []
    for position, raw in enumerate(body.get("choices") or ()):
        delta = raw.get("delta") or {}
        calls = [
            ToolCallDelta(
                int(c.get("index", 0)),
                id=c.get("id"),
                name=(c.get("function") or {}).get("name"),
                arguments=(c.get("function") or {}).get("arguments") or "",
            )
            for c in delta.get("tool_calls") or ()
        ]
        deltas.append(
            ChoiceDelta(
                index=int(raw.get("index", position)),
                text=delta.get("content") or "",
                reasoning=delta.get("reasoning_content") or "",
                refusal=delta.get("refusal") or "",
                tool_calls=calls or None,
                finish_reason=raw.get("finish_reason"),
            )
        )
    chunk = Chunk(deltas, usage=usage_of(body.get("usage")), raw=body)
    chunk.num_tokens = 1 if chunk.has_output() else 0
    return chunk
