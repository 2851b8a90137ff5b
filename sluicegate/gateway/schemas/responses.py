"""OpenAI's Responses API request body: its wire shapes, and the 400s for what the gateway
cannot honour (``ResponsesRequest.check``).

``conversation`` and ``background`` are refused, as is any field or tool type no backend here
can honour; unknown fields are refused by msgspec (named in the 400).

What no backend behind the gateway can honour is a 400 naming it too: reasoning summaries
(``reasoning.summary``: the gateway returns a model's reasoning as it is, never a summary of
it, as OpenAI itself refuses the field for models without a summarizer), encrypted reasoning
(``encrypted_content``: only the OpenAI deployment that issued it can read it, and the
gateway never issues it), tools loaded on demand (``defer_loading``: that needs OpenAI's
hosted tool search) and images by ``file_id`` (the gateway has no file store).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.schemas.bounds import (
    MAX_CONTENT_PARTS,
    MAX_INCLUDE,
    MAX_INPUT_ITEMS,
    MAX_TOOLS,
    MaxTokens,
    Metadata,
    OpenAITemperature,
    TopLogprobs,
    TopP,
)


class _Wire(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    pass


class InputText(_Wire, tag="input_text", tag_field="type"):
    text: str


class OutputText(_Wire, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Wire, tag="refusal", tag_field="type"):
    refusal: str


class InputImage(_Wire, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None


MessagePart = InputText | OutputText | Refusal | InputImage


class MessageItem(_Wire, tag="message", tag_field="type"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | Annotated[list[MessagePart], Meta(max_length=MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    """Accepted and not forwarded: it labels an earlier answer of an OpenAI model (gpt-5.3-codex
    and later, which want it back), and no backend here is one by the Responses API (Azure is
    reached by Chat Completions, which has no such label); the text is what a model reads."""


class FunctionCallItem(_Wire, tag="function_call", tag_field="type"):
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None


class FunctionCallOutputItem(_Wire, tag="function_call_output", tag_field="type"):
    call_id: str
    output: str | Annotated[list[InputText | InputImage], Meta(max_length=MAX_CONTENT_PARTS)]
    id: str | None = None
    status: str | None = None


class SummaryText(_Wire, tag="summary_text", tag_field="type"):
    text: str


class ReasoningText(_Wire, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(_Wire, tag="reasoning", tag_field="type"):
    summary: Annotated[list[SummaryText], Meta(max_length=MAX_CONTENT_PARTS)] = msgspec.field(
        default_factory=list
    )
    content: Annotated[list[ReasoningText], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    id: str | None = None
    encrypted_content: str | None = None
    status: str | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Wire, tag="function", tag_field="type"):
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class FunctionChoice(_Wire, tag="function", tag_field="type"):
    name: str


class TextFormatText(_Wire, tag="text", tag_field="type"):
    pass


class TextFormatJsonObject(_Wire, tag="json_object", tag_field="type"):
    pass


class TextFormatJsonSchema(_Wire, tag="json_schema", tag_field="type"):
    name: str
    schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Wire):
    format: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Wire):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class StreamOptions(_Wire):
    include_obfuscation: bool | None = None


class ResponsesRequest(_Wire):
    model: str
    input: str | Annotated[list[dict[str, Any]], Meta(max_length=MAX_INPUT_ITEMS)]
    """Items are read by ``items()``: a message item may leave out its ``type``."""
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: OpenAITemperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: Annotated[list[str], Meta(max_length=MAX_INCLUDE)] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    max_tool_calls: int | None = None

    def items(self) -> list[Item]:
        return parse_items(self.input if isinstance(self.input, list) else [])

    def check(self) -> None:
        """The 400 for what the gateway, or every backend behind it, cannot honour."""
        refused = {
            "conversation": self.conversation is not None,
            "background": self.background is True,
            "truncation": self.truncation == "auto",
            "max_tool_calls": self.max_tool_calls is not None,
        }
        for name, used in refused.items():
            if used:
                raise InvalidRequest(
                    f"'{name}' is not supported: this gateway runs each response in one "
                    "pass, continued only by previous_response_id.",
                    param=name,
                )
        for i, item in enumerate(self.include or ()):
            if item != "message.output_text.logprobs":
                raise InvalidRequest(
                    f"include value '{item}' is not supported", param=f"include[{i}]"
                )
        reasoning = self.reasoning
        for name in ("summary", "generate_summary"):
            if reasoning is not None and getattr(reasoning, name) is not None:
                raise InvalidRequest(
                    f"'reasoning.{name}' is not supported: the models behind this gateway "
                    "return their reasoning as it is (reasoning_text content), not a summary "
                    "of it. Leave the field out to receive that reasoning.",
                    param=f"reasoning.{name}",
                )
        for i, tool in enumerate(self.tools or ()):
            if tool.defer_loading:
                raise InvalidRequest(
                    "'defer_loading' is not supported: a deferred tool is loaded by OpenAI's "
                    "hosted tool search, which this gateway does not offer. Send the tool "
                    "without it.",
                    param=f"tools[{i}].defer_loading",
                )


def parse_items(raw_items: list[dict[str, Any]], param: str = "input") -> list[Item]:
    """Items as the wire sends them (a message item may leave out its ``type``); a bad one is
    a 400 naming it under ``param``."""
    out: list[Item] = []
    for i, raw in enumerate(raw_items):
        try:
            out.append(msgspec.convert({"type": "message", **raw}, Item))  # type: ignore[arg-type]
        except msgspec.ValidationError as exc:
            path = str(exc).rpartition(" - at `$")[2].rstrip("`")
            message = str(exc).partition(" - at ")[0]
            raise InvalidRequest(
                f"Invalid value for '{param}[{i}]{path}': {message}", param=f"{param}[{i}]{path}"
            ) from None
    return out
