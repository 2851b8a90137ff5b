"""Anthropic's Messages API requests in: the wire shapes, and their canonical translation.

Unknown fields are refused (msgspec names them; the controller answers a 400 naming the
field), so nothing a client sends is dropped unnoticed. ``cache_control`` is accepted wherever
Anthropic allows it: automatic prefix caching already reuses any repeated prefix, so the hint
changes nothing here. A user turn's ``tool_result`` blocks become a canonical ``tool`` turn,
placed before the rest of that user turn, as the Messages API puts results first.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sluicegate.gateway.canonical import (
    ChatRequest,
    ImagePart,
    Message,
    OutputFormat,
    Part,
    ReasoningEffort,
    ReasoningPiece,
    Sampling,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
    ToolResult,
)
from sluicegate.gateway.schemas.bounds import (
    MAX_ANTHROPIC_MESSAGES,
    MAX_CONTENT_PARTS,
    MAX_TOOLS,
    AnthropicTemperature,
    AnthropicTopK,
    MaxTokens,
    StopSequences,
    ThinkingBudget,
    TopP,
    UserId,
)


class _Wire(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    pass


class CacheControl(_Wire):
    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class TextBlock(_Wire, tag="text", tag_field="type"):
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None
    """Accepted and not forwarded. Citations are what Claude returned on an earlier answer's
    text, pointing into document (or search result) blocks of that request; an SDK sends the
    answer back as history with them on. They are not prompt text (Anthropic's citations guide:
    ``cited_text`` sent back in later turns does not count as input tokens), and the documents
    they point into cannot be here: this API refuses document blocks. So the text is the whole
    of what the model reads, and every backend gets that."""


class Base64Source(_Wire, tag="base64", tag_field="type"):
    media_type: str
    data: str


class UrlSource(_Wire, tag="url", tag_field="type"):
    url: str


class ImageBlock(_Wire, tag="image", tag_field="type"):
    source: Base64Source | UrlSource
    cache_control: CacheControl | None = None

    def part(self) -> ImagePart:
        source = self.source
        if isinstance(source, Base64Source):
            return ImagePart(f"data:{source.media_type};base64,{source.data}")
        return ImagePart(source.url)


class DirectCaller(_Wire, tag="direct", tag_field="type"):
    """The model itself called the tool (the only caller outside Anthropic's server tools)."""


class ToolUseBlock(_Wire, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    toolset_name: None = None


class ToolResultBlock(_Wire, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: (
        str | Annotated[list[TextBlock | ImageBlock], Meta(max_length=MAX_CONTENT_PARTS)] | None
    ) = None
    is_error: bool = False
    cache_control: CacheControl | None = None
    toolset_name: None = None

    def result(self) -> ToolResult:
        if self.content is None:
            parts: list[TextPart | ImagePart] = []
        elif isinstance(self.content, str):
            parts = [TextPart(self.content)]
        else:
            parts = [
                b.part() if isinstance(b, ImageBlock) else TextPart(b.text) for b in self.content
            ]
        return ToolResult(self.tool_use_id, parts, self.is_error)


class ThinkingBlock(_Wire, tag="thinking", tag_field="type"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Wire, tag="redacted_thinking", tag_field="type"):
    data: str


Block = (
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class MessageParam(_Wire):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Meta(max_length=MAX_CONTENT_PARTS)]


class ToolParam(_Wire):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None


class ToolChoiceParam(_Wire):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(_Wire):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: ThinkingBudget | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(_Wire):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(_Wire):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class MetadataParam(_Wire):
    user_id: UserId | None = None


class _Prompt(_Wire):
    model: str
    messages: Annotated[list[MessageParam], Meta(max_length=MAX_ANTHROPIC_MESSAGES)]
    system: str | Annotated[list[TextBlock], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[ToolParam], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None


class CountTokensRequest(_Prompt):
    """Anthropic's count_tokens body: the prompt fields, and ``speed``. ``speed`` picks how fast
    the tokens are generated (Anthropic's fast mode), not which tokens the prompt is, so it
    cannot change the count: it is accepted (the SDK sends it when the caller passes it) and
    not forwarded, as Anthropic's own count endpoint needs a beta header with it on some
    models."""

    speed: Literal["standard", "fast"] | None = None


class MessagesRequest(_Prompt, kw_only=True):
    max_tokens: MaxTokens
    stop_sequences: StopSequences | None = None
    stream: bool = False
    temperature: AnthropicTemperature | None = None
    top_p: TopP | None = None
    top_k: AnthropicTopK | None = None
    metadata: MetadataParam | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


_EFFORT: dict[str, ReasoningEffort] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


def _messages(body: _Prompt) -> list[Message]:
    out: list[Message] = []
    if body.system:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        out.append(Message("system", [TextPart(system)]))
    for param in body.messages:
        if isinstance(param.content, str):
            out.append(Message(param.role, [TextPart(param.content)]))
            continue
        results: list[Part] = []
        parts: list[Part] = []
        pieces: list[ReasoningPiece] = []
        for block in param.content:
            if isinstance(block, TextBlock):
                parts.append(TextPart(block.text))
            elif isinstance(block, ImageBlock):
                parts.append(block.part())
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, separators=(",", ":"))
                parts.append(ToolCall(block.id, block.name, arguments))
            elif isinstance(block, ToolResultBlock):
                results.append(block.result())
            elif isinstance(block, ThinkingBlock):
                # Its signature is the issuer's own by now, or None (the controller checked
                # ours and left the issuer's in place), for the backend that issued it.
                pieces.append(ReasoningPiece(block.thinking, block.signature, at=len(parts)))
            elif isinstance(block, RedactedThinkingBlock):
                # Encrypted thinking: an Anthropic deployment gets it back as it was. Any other
                # backend cannot read it and goes without it, as Anthropic documents for its own
                # models: a model that cannot read a thinking or redacted_thinking block sent
                # back drops it without an error ("Preserved thinking", switching models
                # mid-conversation), and those blocks may be omitted from earlier assistant
                # turns ("Extended thinking", preserving thinking blocks).
                pieces.append(ReasoningPiece(redacted=block.data, at=len(parts)))
        if results:
            out.append(Message("tool", results))
        if parts or pieces or not results:
            readable = [p.text for p in pieces if p.redacted is None]
            message = Message(param.role, parts, reasoning="".join(readable) or None)
            message.reasoning_pieces = pieces or None
            out.append(message)
    return out


def _tools(body: _Prompt) -> tuple[list[Tool] | None, ToolChoice | None, bool | None]:
    tools = None
    if body.tools:
        tools = [Tool(t.name, t.description, t.input_schema, bool(t.strict)) for t in body.tools]
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    mode = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[choice.type]
    parallel = False if choice.disable_parallel_tool_use else None
    return tools, ToolChoice(mode, choice.name), parallel  # type: ignore[arg-type]


def canonical(body: _Prompt) -> ChatRequest:
    """``body`` as a canonical request (a count_tokens body: with no output limit)."""
    tools, tool_choice, parallel = _tools(body)
    request = ChatRequest(
        model=body.model,
        messages=_messages(body),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
    )
    config = body.output_config
    if config is not None and config.format is not None:
        request.output = OutputFormat("json_schema", schema=config.format.schema, strict=True)
    if config is not None and config.effort is not None:
        request.reasoning_effort = _EFFORT[config.effort]
    if body.thinking is not None:
        thinking = body.thinking
        request.thinking = Thinking(thinking.type, thinking.budget_tokens, thinking.display)
    if isinstance(body, MessagesRequest):
        request.sampling = Sampling(
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            # 0 restricts nothing: sent on as unset (an engine takes only -1 or >= 1).
            top_k=body.top_k or None,
            stop=body.stop_sequences,
        )
        request.stream = body.stream
        request.include_usage = body.stream
        request.user = body.metadata.user_id if body.metadata else None
        # "auto" is what every backend does anyway; only "standard_only" asks for something.
        if body.service_tier == "standard_only":
            request.service_tier = body.service_tier
    return request
