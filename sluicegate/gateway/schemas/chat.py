"""OpenAI's chat completions request, whole, and its translation into the canonical model.

Every field today's ``openai`` SDK sends is typed here, so a bad value is a 400 naming it and
every value reaches the canonical request. Fields this model does not know are kept in
``ChatRequest.extra`` under their path (an OpenAI-compatible upstream gets them anyway, with
the rest of the body, through ``passthrough``; any other backend answers 400 naming them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from sluicegate.gateway import canonical
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.schemas.bounds import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    MaxTokens,
    Metadata,
    TopLogprobs,
)
from sluicegate.gateway.schemas.sampling import GenerationFields
from sluicegate.gateway.schemas.unknown import unknown_paths

# ---- messages --------------------------------------------------------------------------------


class TextPartIn(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None


class ImagePartIn(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class InputAudio(msgspec.Struct):
    data: str
    format: str


class AudioPartIn(msgspec.Struct, tag="input_audio", tag_field="type"):
    input_audio: InputAudio


class FileIn(msgspec.Struct):
    file_id: str | None = None
    filename: str | None = None
    file_data: str | None = None


class FilePartIn(msgspec.Struct, tag="file", tag_field="type"):
    file: FileIn


class RefusalPartIn(msgspec.Struct, tag="refusal", tag_field="type"):
    refusal: str


ContentPart = TextPartIn | ImagePartIn | AudioPartIn | FilePartIn | RefusalPartIn


class FunctionCallIn(msgspec.Struct):
    name: str
    arguments: str
    parsed_arguments: Any = None
    """The openai SDK's ``parse()`` echo of ``arguments``, decoded: not model input."""


class ToolCallIn(msgspec.Struct):
    id: str
    type: str = "function"
    function: FunctionCallIn | None = None
    custom: dict[str, Any] | None = None


class ChatMessageIn(msgspec.Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | Annotated[list[ContentPart], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None
    audio: dict[str, Any] | None = None
    """A reference to an earlier audio answer (``{"id": ...}``)."""
    function_call: FunctionCallIn | None = None
    """The deprecated form of ``tool_calls``."""
    annotations: list[dict[str, Any]] | None = None
    """Citations of an earlier answer, echoed back by clients; they are not model input."""
    parsed: Any = None
    """The openai SDK's ``parse()`` echo of ``content``, decoded: not model input."""


# ---- tools and formats -----------------------------------------------------------------------


class FunctionDef(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolIn(msgspec.Struct):
    type: str = "function"
    function: FunctionDef | None = None
    custom: dict[str, Any] | None = None


class JsonSchemaIn(msgspec.Struct):
    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormatIn(msgspec.Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None


# ---- the request -----------------------------------------------------------------------------


class ChatCompletionRequest(GenerationFields, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    tools: Annotated[list[ToolIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormatIn | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    metadata: Metadata | None = None
    service_tier: str | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true.", param="top_logprobs")
        for i, message in enumerate(self.messages):
            if message.role in {"system", "developer", "user", "tool"} and message.content is None:
                raise InvalidRequest(
                    f"A {message.role} message needs content.", param=f"messages[{i}].content"
                )
            if message.role == "tool" and not message.tool_call_id:
                raise InvalidRequest(
                    "A tool message needs the tool_call_id it answers.",
                    param=f"messages[{i}].tool_call_id",
                )
        if self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise InvalidRequest(
                    "response_format of type json_schema needs json_schema.",
                    param="response_format.json_schema",
                )
        if self.response_format is not None and self.guided_output() is not None:
            raise InvalidRequest(
                "response_format and guided_* constrain the output twice; send one.",
                param="response_format",
            )

    def canonical(self, document: dict[str, Any]) -> canonical.ChatRequest:
        """The canonical request; ``document`` is this body as plain JSON."""
        extra = unknown_paths(document, ChatCompletionRequest)
        messages = []
        for i, message in enumerate(self.messages):
            messages.append(_message(message))
            # What the canonical model has no place for: audio answers, custom tool calls.
            if message.audio is not None:
                extra[f"messages[{i}].audio"] = message.audio
            for j, call in enumerate(message.tool_calls or ()):
                if call.function is None:
                    extra[f"messages[{i}].tool_calls[{j}]"] = call.custom
        sampling = self.canonical_sampling()
        sampling.logprobs = bool(self.logprobs)
        sampling.top_logprobs = self.top_logprobs
        return canonical.ChatRequest(
            model=self.model,
            messages=messages,
            tools=self._tools(extra),
            tool_choice=self._tool_choice(extra),
            parallel_tool_calls=self.parallel_tool_calls,
            sampling=sampling,
            output=self._output(),
            reasoning_effort=self.reasoning_effort,
            chat_template_kwargs=self.chat_template_kwargs,
            stream=bool(self.stream),
            include_usage=self.include_usage,
            user=self.user,
            metadata=self.metadata,
            service_tier=self.service_tier,
            store=self.store,
            modalities=self.modalities,
            audio=self.audio,
            prediction=self.prediction,
            web_search_options=self.web_search_options,
            verbosity=self.verbosity,
            prompt_cache_key=self.prompt_cache_key,
            safety_identifier=self.safety_identifier,
            max_tokens_param=(
                "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
            ),
            extra=extra,
            passthrough=document,
        )

    def _tools(self, extra: dict[str, Any]) -> list[canonical.Tool] | None:
        if self.tools is None:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.type != "function" or tool.function is None:
                # Custom (free-form) tools: only an upstream that has them can take them.
                extra[f"tools[{i}]"] = tool.custom
                continue
            f = tool.function
            tools.append(canonical.Tool(f.name, f.description, f.parameters, bool(f.strict)))
        return tools

    def _tool_choice(self, extra: dict[str, Any]) -> canonical.ToolChoice | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice in ("none", "auto", "required"):
            return canonical.ToolChoice(choice)  # type: ignore[arg-type]
        if isinstance(choice, str):
            raise InvalidRequest(
                f"tool_choice must be none, auto, required or a function; got {choice!r}.",
                param="tool_choice",
            )
        function = choice.get("function")
        if choice.get("type") == "function" and isinstance(function, dict):
            name = function.get("name")
            if not isinstance(name, str) or not name:
                raise InvalidRequest(
                    "tool_choice.function needs a name.", param="tool_choice.function.name"
                )
            extra.update({f"tool_choice.{k}": v for k, v in choice.items() if k not in _CHOICE})
            extra.update(
                {f"tool_choice.function.{k}": v for k, v in function.items() if k != "name"}
            )
            known = {t.function.name for t in self.tools or () if t.function is not None}
            if name not in known:
                raise InvalidRequest(
                    f"tool_choice names the function {name!r}, which is not in tools.",
                    param="tool_choice.function.name",
                )
            return canonical.ToolChoice("function", name)
        # allowed_tools, custom: only an upstream that has them can take them.
        extra["tool_choice"] = choice
        return None

    def _output(self) -> canonical.OutputFormat | None:
        form = self.response_format
        if form is None:
            return self.guided_output()
        if form.type != "json_schema" or form.json_schema is None:
            return canonical.OutputFormat(form.type)
        spec = form.json_schema
        return canonical.OutputFormat(
            "json_schema",
            schema=spec.schema if spec.schema is not None else {},
            name=spec.name,
            description=spec.description,
            strict=bool(spec.strict),
        )


_CHOICE = frozenset({"type", "function"})

_ROLES: dict[str, canonical.Role] = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}


def _part(part: ContentPart) -> canonical.Part:
    if isinstance(part, TextPartIn):
        return canonical.TextPart(part.text)
    if isinstance(part, ImagePartIn):
        return canonical.ImagePart(part.image_url.url, part.image_url.detail)
    if isinstance(part, AudioPartIn):
        return canonical.AudioPart(part.input_audio.data, part.input_audio.format)
    if isinstance(part, FilePartIn):
        f = part.file
        return canonical.FilePart(f.file_id, f.filename, f.file_data)
    return canonical.TextPart(part.refusal)


def _message(message: ChatMessageIn) -> canonical.Message:
    content = message.content
    if content is None:
        parts: list[canonical.Part] = []
    elif isinstance(content, str):
        parts = [canonical.TextPart(content)]
    else:
        parts = [_part(p) for p in content]
    role = _ROLES[message.role]
    if role == "tool":
        call_id = message.tool_call_id or message.name or ""
        results = [p for p in parts if isinstance(p, canonical.TextPart | canonical.ImagePart)]
        parts = [canonical.ToolResult(call_id, results)]
    if message.refusal and not parts:
        parts = [canonical.TextPart(message.refusal)]
    for call in message.tool_calls or ():
        if call.function is not None:
            parts.append(canonical.ToolCall(call.id, call.function.name, call.function.arguments))
    if message.function_call is not None:
        f = message.function_call
        parts.append(canonical.ToolCall(f.name, f.name, f.arguments))
    return canonical.Message(role, parts, message.name, message.reasoning_content)
