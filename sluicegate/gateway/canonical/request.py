"""The canonical request: messages and their parts, tools, output constraints, sampling and
the ``ChatRequest`` that carries them."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from sluicegate.engine.protocol import LoraAdapter

# ---- content parts ---------------------------------------------------------------------------


class TextPart(msgspec.Struct, tag="text", omit_defaults=True):
    text: str


class ImagePart(msgspec.Struct, tag="image", omit_defaults=True):
    url: str
    """An ``http(s)://`` URL or a ``data:<media type>;base64,...`` URL."""
    detail: str | None = None


class AudioPart(msgspec.Struct, tag="audio", omit_defaults=True):
    data: str
    """Base64 audio."""
    format: str


class FilePart(msgspec.Struct, tag="file", omit_defaults=True):
    file_id: str | None = None
    filename: str | None = None
    data: str | None = None
    """Base64 content (or a data URL) when sent inline."""


class ToolCall(msgspec.Struct, tag="tool_call", omit_defaults=True):
    """A function call made by the assistant (in an earlier turn, or in a response)."""

    id: str
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI carries them."""


class ToolResult(msgspec.Struct, tag="tool_result", omit_defaults=True):
    """What a tool returned for the call ``tool_call_id``."""

    tool_call_id: str
    content: list[TextPart | ImagePart] = msgspec.field(default_factory=list)
    is_error: bool = False

    def text(self) -> str:
        return "".join(p.text for p in self.content if isinstance(p, TextPart))


Part = TextPart | ImagePart | AudioPart | FilePart | ToolCall | ToolResult

Role = Literal["system", "developer", "user", "assistant", "tool"]


class ReasoningPiece(msgspec.Struct, omit_defaults=True):
    """One block of an assistant turn's thinking, as its backend issued it. Anthropic (and
    Claude on Bedrock) signs each thinking block on its own and wants every one back, signed,
    in its place among the turn's other blocks (a tool loop with interleaved thinking has one
    per step)."""

    text: str = ""
    signature: str | None = None
    """The backend's own signature of ``text``."""
    redacted: str | None = None
    """Thinking the backend returned encrypted (Anthropic's ``redacted_thinking`` data), which
    only that backend can read; ``text`` is then empty."""
    at: int = 0
    """Where it stands: the number of the message's parts before it."""


class Message(msgspec.Struct, omit_defaults=True):
    """One turn. Assistant turns hold ``TextPart`` and ``ToolCall`` parts; a ``tool`` turn holds
    ``ToolResult`` parts (one or more); ``reasoning`` is an assistant turn's earlier thinking."""

    role: Role
    parts: list[Part] = msgspec.field(default_factory=list)
    name: str | None = None
    reasoning: str | None = None
    """All of the turn's readable thinking, joined (what a backend without pieces takes)."""
    reasoning_pieces: list[ReasoningPiece] | None = None
    """The same thinking block by block, each with its backend's signature, plus any redacted
    blocks, when the turn came as blocks (Anthropic's) or from a backend that signs them."""

    def text(self) -> str:
        """The text parts joined (the tool results' text for a ``tool`` turn)."""
        out = []
        for part in self.parts:
            if isinstance(part, TextPart):
                out.append(part.text)
            elif isinstance(part, ToolResult):
                out.append(part.text())
        return "".join(out)

    def tool_calls(self) -> list[ToolCall]:
        return [p for p in self.parts if isinstance(p, ToolCall)]


# ---- tools and output constraints ------------------------------------------------------------


class Tool(msgspec.Struct, omit_defaults=True):
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool = False


class ToolChoice(msgspec.Struct, omit_defaults=True):
    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None
    """The function that must be called, with mode ``function``."""


class OutputFormat(msgspec.Struct, omit_defaults=True):
    """What the answer must look like: OpenAI's ``response_format`` and vLLM's ``guided_*``."""

    kind: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]
    schema: dict[str, Any] | None = None
    """The JSON Schema (kind ``json_schema``)."""
    name: str | None = None
    description: str | None = None
    strict: bool = False
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    """EBNF (kind ``grammar``)."""


# ---- sampling --------------------------------------------------------------------------------


class Sampling(msgspec.Struct, omit_defaults=True):
    """How to pick tokens. ``None`` means the client did not say (a provider applies its own
    default, or omits the field upstream)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class Thinking(msgspec.Struct, omit_defaults=True):
    """Anthropic's ``thinking`` switch: the model's thinking mode, where it has one."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None
    """Whether the thinking comes back summarized or left out (its signature still does);
    ``None``: the model's default."""


class ChatRequest(msgspec.Struct, kw_only=True):
    """One generation request, whichever API it came in by.

    Exactly one of ``messages`` (chat) and ``prompt`` (text completion) is set. The fields after
    ``chat_template_kwargs`` are OpenAI's request options that only some backends honour; a
    provider that cannot honour one that is set answers 400 naming it.
    """

    model: str
    """The public model name the client asked for."""
    messages: list[Message] | None = None
    prompt: str | list[int] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    output: OutputFormat | None = None
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    stream: bool = False
    include_usage: bool = False
    """The client asked for a usage chunk at the end of its stream."""
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    """Requested audio output (voice, format)."""
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    thinking: Thinking | None = None
    max_tokens_param: str = "max_tokens"
    """The inbound field that set ``sampling.max_tokens``, named by a 400 about it
    (``max_completion_tokens``, ``max_output_tokens``)."""
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    """Fields outside this model, keyed by their path in the inbound request."""
    passthrough: dict[str, Any] | None = None
    """The client's OpenAI body as sent, when it came in by an OpenAI API: an OpenAI-compatible
    upstream gets exactly this (its ``model`` rewritten)."""
    # Set by the gateway, not the client:
    request_id: str = ""
    deadline: float = 0.0
    """Unix time by which the whole answer must be done; 0 = none."""
    traceparent: str | None = None
    priority: int = 0
    """The engine's scheduling priority (lower first): ``BATCH_PRIORITY`` for Batch API lines."""
    lora: LoraAdapter | None = None
    """The LoRA adapter the called model name stands for (``sluicegate.gateway.routing.adapters``):
    only engine deployments get such a request."""
