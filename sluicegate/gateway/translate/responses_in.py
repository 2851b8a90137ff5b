"""OpenAI's Responses API requests in: their canonical translation.

``input`` is a string or items: messages (``input_text`` / ``input_image`` / ``output_text``
parts), ``function_call`` and ``function_call_output`` items, and ``reasoning`` items (their
text becomes the reasoning of the assistant output item right after them). The body's shapes,
and the 400s for what no backend can honour, are in ``sluicegate.gateway.schemas.responses``.

``previous_response_id`` continues a stored response: the controller reads back the items the
model read for it and its output (``sluicegate.gateway.stored``), and they translate here ahead
of the request's own ``input``, exactly as if the client had sent them again. ``instructions``
are the request's own: OpenAI does not carry them over from the earlier response either.
"""

from __future__ import annotations

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
from sluicegate.gateway.schemas.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    InputImage,
    InputText,
    Item,
    MessageItem,
    OutputText,
    ReasoningItem,
    Refusal,
    ResponsesRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
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


def _content(item: MessageItem, where: str) -> list[Part]:
    if isinstance(item.content, str):
        return [TextPart(item.content)]
    parts: list[Part] = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputText | OutputText):
            parts.append(TextPart(part.text))
        elif isinstance(part, Refusal):
            parts.append(TextPart(part.refusal))
        else:
            parts.append(_image(part, f"{where}.content[{j}]"))
    return parts


def _tool_output(item: FunctionCallOutputItem, where: str) -> list[TextPart | ImagePart]:
    if isinstance(item.output, str):
        return [TextPart(item.output)]
    return [
        TextPart(p.text) if isinstance(p, InputText) else _image(p, f"{where}.output[{j}]")
        for j, p in enumerate(item.output)
    ]


def _reasoning(item: ReasoningItem, where: str) -> list[str]:
    if item.encrypted_content is not None:
        raise InvalidRequest(
            "encrypted reasoning is not supported: only the OpenAI deployment that issued it "
            "can read it, and this gateway never issues it. Leave encrypted_content out (the "
            "item's summary and content are read).",
            param=f"{where}.encrypted_content",
        )
    return [s.text for s in item.summary] + [c.text for c in item.content or ()]


def _orphan(where: str) -> InvalidRequest:
    return InvalidRequest(
        "a reasoning item must come right before the assistant output it led to (an "
        "assistant message or a function_call item); nothing here can carry it. Leave it out.",
        param=where,
    )


def _items(body: ResponsesRequest, history: list[Item]) -> list[tuple[str, Item]]:
    """Every item the model reads, each with the field an error about it names: a stored
    one's is ``previous_response_id`` (it was the client's own input or the model's output)."""
    own: list[Item] = (
        [MessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else body.items()
    )
    return [("previous_response_id", item) for item in history] + [
        (f"input[{i}]", item) for i, item in enumerate(own)
    ]


def _messages(body: ResponsesRequest, history: list[Item]) -> list[Message]:
    out: list[Message] = []
    if body.instructions:
        # A system turn: every chat template knows that role (not all know "developer").
        out.append(Message("system", [TextPart(body.instructions)]))
    reasoning: list[str] = []
    first_reasoning = ""
    for where, item in _items(body, history):
        if isinstance(item, ReasoningItem):
            first_reasoning = where if not reasoning else first_reasoning
            reasoning += _reasoning(item, where) or [""]
            continue
        if isinstance(item, MessageItem):
            message = Message(item.role, _content(item, where))
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
            message = Message("tool", [ToolResult(item.call_id, _tool_output(item, where))])
        if reasoning:
            if message.role != "assistant":
                raise _orphan(first_reasoning)
            message.reasoning = "".join(reasoning) or None
            reasoning = []
        out.append(message)
    if reasoning:
        raise _orphan(first_reasoning)
    return out


def canonical(body: ResponsesRequest, history: list[Item] | None = None) -> ChatRequest:
    """``history``: the items of the response ``previous_response_id`` continues."""
    body.check()
    request = ChatRequest(
        model=body.model,
        messages=_messages(body, history or []),
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
