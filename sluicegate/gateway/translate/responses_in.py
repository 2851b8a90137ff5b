"""OpenAI's Responses API requests in: the wire shapes, and their canonical translation.

Stateless: nothing is stored, so ``store: true``, ``previous_response_id``, ``conversation``
and ``background`` are a 400 naming the field, as is any field or tool type the gateway
cannot honour; unknown fields are refused by msgspec (named in the 400). ``input`` is a string
or items: messages (``input_text`` / ``input_image`` / ``output_text`` parts),
``function_call`` and ``function_call_output`` items, and ``reasoning`` items (their text
becomes the reasoning of the assistant output item right after them).

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

from sluicegate.gateway.canonical import (
    ChatRequest,
    ImagePart,
    Message,
    OutputFormat,
    Part,
    ReasoningEffort,
    Sampling,
    TextPart,
    Tool,
    ToolCall,
    ToolChoice,
    ToolResult,
)
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
        out: list[Item] = []
        for i, raw in enumerate(self.input if isinstance(self.input, list) else ()):
            try:
                out.append(msgspec.convert({"type": "message", **raw}, Item))  # type: ignore[arg-type]
            except msgspec.ValidationError as exc:
                path = str(exc).rpartition(" - at `$")[2].rstrip("`")
                message = str(exc).partition(" - at ")[0]
                raise InvalidRequest(
                    f"Invalid value for 'input[{i}]{path}': {message}", param=f"input[{i}]{path}"
                ) from None
        return out

    def check(self) -> None:
        """The 400 for what a stateless gateway, or every backend behind it, cannot honour."""
        if self.previous_response_id is not None:
            raise InvalidRequest(
                "previous_response_id is not supported: this gateway stores no responses "
                "(store is false). Send the whole conversation in 'input' instead.",
                param="previous_response_id",
            )
        refused = {
            "store": self.store is True,
            "conversation": self.conversation is not None,
            "background": self.background is True,
            "truncation": self.truncation == "auto",
            "max_tool_calls": self.max_tool_calls is not None,
        }
        for name, used in refused.items():
            if used:
                raise InvalidRequest(
                    f"'{name}' is not supported: this gateway is stateless and runs each "
                    "response in one pass.",
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


_EFFORT: dict[str, ReasoningEffort] = {
    "none": "none",
    "minimal": "minimal",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
}


def _image(part: InputImage, param: str) -> ImagePart:
    if part.image_url is None:
        raise InvalidRequest("images by file_id are not supported (send image_url)", param=param)
    if part.file_id is not None:
        raise InvalidRequest(
            "an image takes image_url or file_id, not both (file_id is not supported)",
            param=f"{param}.file_id",
        )
    # Every detail, "original" included, goes on as sent: an OpenAI-compatible backend reads
    # it (or refuses a value it does not know, naming it).
    return ImagePart(part.image_url, part.detail)


def _content(item: MessageItem, index: int) -> list[Part]:
    if isinstance(item.content, str):
        return [TextPart(item.content)]
    parts: list[Part] = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputText | OutputText):
            parts.append(TextPart(part.text))
        elif isinstance(part, Refusal):
            parts.append(TextPart(part.refusal))
        else:
            parts.append(_image(part, f"input[{index}].content[{j}]"))
    return parts


def _tool_output(item: FunctionCallOutputItem, index: int) -> list[TextPart | ImagePart]:
    if isinstance(item.output, str):
        return [TextPart(item.output)]
    return [
        TextPart(p.text) if isinstance(p, InputText) else _image(p, f"input[{index}].output[{j}]")
        for j, p in enumerate(item.output)
    ]


def _reasoning(item: ReasoningItem, index: int) -> list[str]:
    if item.encrypted_content is not None:
        raise InvalidRequest(
            "encrypted reasoning is not supported: only the OpenAI deployment that issued it "
            "can read it, and this gateway never issues it. Leave encrypted_content out (the "
            "item's summary and content are read).",
            param=f"input[{index}].encrypted_content",
        )
    return [s.text for s in item.summary] + [c.text for c in item.content or ()]


def _orphan(index: int) -> InvalidRequest:
    return InvalidRequest(
        "a reasoning item must come right before the assistant output it led to (an "
        "assistant message or a function_call item); nothing here can carry it. Leave it out.",
        param=f"input[{index}]",
    )


def _messages(body: ResponsesRequest) -> list[Message]:
    out: list[Message] = []
    if body.instructions:
        # A system turn: every chat template knows that role (not all know "developer").
        out.append(Message("system", [TextPart(body.instructions)]))
    if isinstance(body.input, str):
        out.append(Message("user", [TextPart(body.input)]))
        return out
    reasoning: list[str] = []
    first_reasoning = 0
    for i, item in enumerate(body.items()):
        if isinstance(item, ReasoningItem):
            first_reasoning = i if not reasoning else first_reasoning
            reasoning += _reasoning(item, i) or [""]
            continue
        if isinstance(item, MessageItem):
            message = Message(item.role, _content(item, i))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(item.call_id, item.name, item.arguments)
            last = out[-1] if out else None
            # Parallel calls arrive as consecutive items: one assistant turn holds them all
            # (a reasoning item between two calls starts the next turn instead).
            if (
                last is not None
                and last.role == "assistant"
                and last.tool_calls()
                and not reasoning
            ):
                last.parts.append(call)
                continue
            message = Message("assistant", [call])
        else:
            message = Message("tool", [ToolResult(item.call_id, _tool_output(item, i))])
        if reasoning:
            if message.role != "assistant":
                raise _orphan(first_reasoning)
            message.reasoning = "".join(reasoning) or None
            reasoning = []
        out.append(message)
    if reasoning:
        raise _orphan(first_reasoning)
    return out


def canonical(body: ResponsesRequest) -> ChatRequest:
    body.check()
    request = ChatRequest(
        model=body.model,
        messages=_messages(body),
        parallel_tool_calls=body.parallel_tool_calls,
        sampling=Sampling(
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            logprobs=body.top_logprobs is not None or bool(body.include),
            top_logprobs=body.top_logprobs,
        ),
        stream=bool(body.stream),
        include_usage=True,
        user=body.user,
        metadata=body.metadata,
        safety_identifier=body.safety_identifier,
        prompt_cache_key=body.prompt_cache_key,
        store=False,
        max_tokens_param="max_output_tokens",
    )
    if body.service_tier not in (None, "auto", "default"):
        request.service_tier = body.service_tier
    if body.tools:
        request.tools = [
            Tool(t.name, t.description, t.parameters, bool(t.strict)) for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        request.tool_choice = ToolChoice("function", choice.name)
    elif choice is not None:
        request.tool_choice = ToolChoice(choice)
    text = body.text
    if text is not None:
        if isinstance(text.format, TextFormatJsonObject):
            request.output = OutputFormat("json_object")
        elif isinstance(text.format, TextFormatJsonSchema):
            request.output = OutputFormat(
                "json_schema",
                schema=text.format.schema,
                name=text.format.name,
                description=text.format.description,
                strict=bool(text.format.strict),
            )
        request.verbosity = text.verbosity
    if body.reasoning is not None and body.reasoning.effort is not None:
        request.reasoning_effort = _EFFORT[body.reasoning.effort]
    return request
