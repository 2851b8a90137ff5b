"""OpenAI's chat/completions wire format on the provider side: canonical → request body, and
an upstream's reply (whole or streamed) → canonical.

A request that came in as OpenAI's own API carries the client's body (``passthrough``): it goes
upstream field for field, unknown fields included; only ``model`` is rewritten, and a stream
asks for usage (``stream_options.include_usage``) so the gateway can bill it. Any other inbound
API's request is written from the canonical model.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sluicegate.gateway import canonical
from sluicegate.gateway.translate.openai_out import (
    openai_messages,
    openai_sampling,
    openai_tool_choice,
)


def request_body(request: canonical.ChatRequest, model: str, stream: bool) -> dict[str, Any]:
    if request.passthrough is not None:
        body = dict(request.passthrough)
        body["model"] = model
        if stream:
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        return body
    return _written(request, model, stream)


def _written(request: canonical.ChatRequest, model: str, stream: bool) -> dict[str, Any]:
    s = request.sampling
    body: dict[str, Any] = {"model": model}
    if request.messages is not None:
        body["messages"] = openai_messages(request.messages)
    else:
        body["prompt"] = request.prompt
    if request.tools is not None:
        body["tools"] = [
            {"type": "function", "function": _without_nones(msgspec.structs.asdict(t))}
            for t in request.tools
        ]
    if request.tool_choice is not None:
        body["tool_choice"] = openai_tool_choice(request.tool_choice)
    if request.output is not None:
        body.update(_output(request.output))
    max_key = "max_completion_tokens" if request.messages is not None else "max_tokens"
    sampling = {
        **openai_sampling(s, max_key),
        # vLLM's sampling fields, which OpenAI-compatible servers of open models take.
        "top_k": s.top_k,
        "min_p": s.min_p,
        "repetition_penalty": s.repetition_penalty,
        "ignore_eos": s.ignore_eos or None,
        "stop_token_ids": s.stop_token_ids,
    }
    options = {
        "parallel_tool_calls": request.parallel_tool_calls,
        "reasoning_effort": request.reasoning_effort,
        "chat_template_kwargs": _template_kwargs(request),
        "user": request.user,
        "metadata": request.metadata,
        "service_tier": request.service_tier,
        "store": request.store,
        "modalities": request.modalities,
        "audio": request.audio,
        "prediction": request.prediction,
        "web_search_options": request.web_search_options,
        "verbosity": request.verbosity,
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
    }
    body.update(_without_nones(sampling))
    body.update(_without_nones(options))
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _template_kwargs(request: canonical.ChatRequest) -> dict[str, Any] | None:
    """Anthropic's ``thinking`` switch as OpenAI-compatible servers of open models take it
    (vLLM, SGLang): the chat template's ``enable_thinking``, their answer's reasoning coming
    back as ``reasoning_content``. What the client put in the template's kwargs itself wins."""
    if request.thinking is None:
        return request.chat_template_kwargs
    enabled = request.thinking.type != "disabled"
    return {"enable_thinking": enabled, **(request.chat_template_kwargs or {})}


def _without_nones(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _output(output: canonical.OutputFormat) -> dict[str, Any]:
    if output.kind in ("text", "json_object"):
        return {"response_format": {"type": output.kind}}
    if output.kind == "json_schema":
        spec = {"name": output.name or "output", "schema": output.schema or {}}
        spec.update(_without_nones({"description": output.description}))
        if output.strict:
            spec["strict"] = True
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    # regex / choice / grammar: vLLM's guided decoding fields.
    field = {"regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    value = {"regex": output.regex, "choice": output.choices, "grammar": output.grammar}
    return {field[output.kind]: value[output.kind]}


# ---- replies ---------------------------------------------------------------------------------


class _Function(msgspec.Struct):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct):
    index: int = 0
    id: str | None = None
    function: _Function | None = None


class _Message(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Top(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class _TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[_Top] = msgspec.field(default_factory=list)


class _Logprobs(msgspec.Struct):
    content: list[_TokenLogprob] | None = None
    # text completions
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Message | None = None
    message: _Message | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprobs: _Logprobs | None = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = 0


class _CompletionDetails(msgspec.Struct):
    reasoning_tokens: int | None = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _PromptDetails | None = None
    completion_tokens_details: _CompletionDetails | None = None


class ErrorBody(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | int | None = None


class Reply(msgspec.Struct):
    """A completion, a stream chunk or an error: every shape we read from an upstream."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: ErrorBody | None = None

    def canonical_usage(self) -> canonical.Usage | None:
        u = self.usage
        if u is None:
            return None
        cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
        reasoning = (
            u.completion_tokens_details.reasoning_tokens if u.completion_tokens_details else 0
        )
        return canonical.Usage(u.prompt_tokens, u.completion_tokens, cached or 0, reasoning or 0)


reply_decoder = msgspec.json.Decoder(Reply)


def _logprobs(logprobs: _Logprobs | None) -> list[canonical.TokenLogprob] | None:
    if logprobs is None:
        return None
    if logprobs.content is not None:
        return [
            canonical.TokenLogprob(
                lp.token,
                lp.logprob,
                lp.bytes,
                [canonical.TopLogprob(t.token, t.logprob, t.bytes) for t in lp.top_logprobs],
            )
            for lp in logprobs.content
        ]
    if logprobs.tokens is None:
        return None
    values = logprobs.token_logprobs or []
    tops = logprobs.top_logprobs or []
    return [
        canonical.TokenLogprob(
            token,
            values[i] if i < len(values) and values[i] is not None else 0.0,
            None,
            [
                canonical.TopLogprob(t, lp)
                for t, lp in ((tops[i] or {}).items() if i < len(tops) else ())
            ],
        )
        for i, token in enumerate(logprobs.tokens)
    ]


def choice_delta(choice: _Choice) -> canonical.ChoiceDelta:
    part = choice.delta or choice.message
    if part is None:
        return canonical.ChoiceDelta(
            index=choice.index,
            text=choice.text or "",
            logprobs=_logprobs(choice.logprobs),
            finish_reason=choice.finish_reason,
        )
    calls = None
    if part.tool_calls:
        calls = [
            canonical.ToolCallDelta(
                call.index,
                call.id,
                call.function.name if call.function else None,
                (call.function.arguments if call.function else None) or "",
            )
            for call in part.tool_calls
        ]
    return canonical.ChoiceDelta(
        index=choice.index,
        text=part.content or "",
        reasoning=part.reasoning_content or "",
        refusal=part.refusal or "",
        tool_calls=calls,
        logprobs=_logprobs(choice.logprobs),
        finish_reason=choice.finish_reason,
    )


def _choice(choice: _Choice) -> canonical.Choice:
    message = choice.message
    if message is None:
        parts: list[canonical.Part] = [canonical.TextPart(choice.text or "")]
        reasoning = refusal = None
    else:
        parts = [canonical.TextPart(message.content or "")]
        for call in message.tool_calls or ():
            f = call.function or _Function()
            parts.append(canonical.ToolCall(call.id or "", f.name or "", f.arguments or ""))
        reasoning, refusal = message.reasoning_content, message.refusal
    return canonical.Choice(
        index=choice.index,
        message=canonical.Message("assistant", parts, reasoning=reasoning),
        finish_reason=choice.finish_reason or "stop",
        refusal=refusal,
        logprobs=_logprobs(choice.logprobs),
    )


def response(reply: Reply, raw: dict[str, Any] | None) -> canonical.Response:
    """A whole upstream answer as canonical."""
    return canonical.Response(
        [_choice(c) for c in reply.choices], usage=reply.canonical_usage(), raw=raw
    )
