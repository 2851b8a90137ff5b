"""The canonical model on the engine's wire (protocol v3), and what our engines cannot honour.

Our engines serve text-only checkpoints: images, audio and files in a prompt, audio output,
predicted outputs, web search, stored completions and the other hosted-only options are a 400
naming the field rather than being dropped. Fields that only identify the caller (``user``,
``safety_identifier``, ``metadata``) or hint at caching (``prompt_cache_key``: prefix caching
is automatic) change nothing about the answer and are accepted.
"""

from __future__ import annotations

import msgspec

from sluicegate.engine import protocol
from sluicegate.gateway import canonical
from sluicegate.gateway.providers.base import ProviderError, unsupported_field

VLLM_EXTRAS = frozenset(
    {
        "top_k",
        "min_p",
        "repetition_penalty",
        "ignore_eos",
        "stop_token_ids",
        "guided_json",
        "guided_choice",
        "guided_regex",
        "guided_grammar",
        "chat_template_kwargs",
    }
)
"""vLLM's extra request fields the engine honours (typed in the request schemas)."""

_SERVICE_TIERS = {"auto", "default"}
_THINKING_OFF = {"none", "minimal"}


def unsupported(request: canonical.ChatRequest) -> ProviderError | None:
    """The 400 for the first field of ``request`` an engine cannot honour, if any."""
    for i, message in enumerate(request.messages or ()):
        for j, part in enumerate(message.parts):
            if isinstance(part, canonical.ToolResult):
                if any(not isinstance(p, canonical.TextPart) for p in part.content):
                    return unsupported_field(
                        f"messages[{i}].content",
                        "This model reads text only; a tool result may not hold images.",
                    )
            elif not isinstance(part, canonical.TextPart | canonical.ToolCall):
                kind = {
                    canonical.ImagePart: "images",
                    canonical.AudioPart: "audio",
                    canonical.FilePart: "files",
                }[type(part)]
                return unsupported_field(
                    f"messages[{i}].content[{j}]",
                    f"This model reads text only; it cannot take {kind}.",
                )
    if request.extra:
        name = next(iter(request.extra))
        return unsupported_field(
            name,
            f"Unrecognized request argument supplied: {name}. Engine models take OpenAI's "
            f"fields and vLLM's extras ({', '.join(sorted(VLLM_EXTRAS))}).",
        )
    if request.modalities and any(m != "text" for m in request.modalities):
        return unsupported_field("modalities", "This model answers with text only.")
    hosted_only = {
        "audio": request.audio,
        "prediction": request.prediction,
        "web_search_options": request.web_search_options,
        "verbosity": request.verbosity,
    }
    for name, value in hosted_only.items():
        if value is not None:
            return unsupported_field(name, f"{name} is not available on engine models.")
    if request.store:
        return unsupported_field("store", "Engine models do not store completions.")
    thinking = request.thinking
    if thinking is not None and thinking.type != "disabled" and thinking.display is not None:
        return unsupported_field(
            "thinking.display",
            "Engine models return their thinking as written, neither summarized nor left out; "
            "leave out 'thinking.display'.",
        )
    if request.service_tier is not None and request.service_tier not in _SERVICE_TIERS:
        return unsupported_field(
            "service_tier", "Engine models have one service tier: auto (or default)."
        )
    if request.prompt is not None and request.tools:
        return unsupported_field("tools", "Tools need a chat request.")
    return None


def wire_request(
    request: canonical.ChatRequest,
    model: str,
    deadline: float,
    reply_to: str,
    default_max_tokens: int,
) -> protocol.Request:
    prompt = request.prompt
    choice = request.tool_choice or canonical.ToolChoice()
    return protocol.Request(
        request_id=request.request_id,
        model=model,
        sampling=_sampling(request.sampling, default_max_tokens),
        prompt=prompt if isinstance(prompt, str) else None,
        prompt_token_ids=list(prompt) if isinstance(prompt, list) else None,
        messages=_messages(request.messages),
        deadline=deadline,
        traceparent=request.traceparent,
        reply_to=reply_to,
        n=request.sampling.n,
        tools=[protocol.Tool(t.name, t.description, t.parameters, t.strict) for t in request.tools]
        if request.tools
        else None,
        tool_choice=choice.mode,
        tool_choice_name=choice.name,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        structured=_structured(request.output),
        chat_template_kwargs=_template_kwargs(request),
        lora=request.lora,
    )


def _sampling(s: canonical.Sampling, default_max_tokens: int) -> protocol.Sampling:
    return protocol.Sampling(
        max_tokens=s.max_tokens or default_max_tokens,
        temperature=1.0 if s.temperature is None else s.temperature,
        top_p=1.0 if s.top_p is None else s.top_p,
        top_k=-1 if s.top_k is None else s.top_k,
        min_p=s.min_p or 0.0,
        seed=s.seed,
        stop=s.stop or None,
        stop_token_ids=s.stop_token_ids or None,
        ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        repetition_penalty=s.repetition_penalty or 1.0,
        logprobs=(s.top_logprobs or 0) if s.logprobs else None,
        logit_bias=s.logit_bias or None,
    )


def _messages(messages: list[canonical.Message] | None) -> list[protocol.ChatMessage] | None:
    if messages is None:
        return None
    out = []
    for m in messages:
        if m.role == "tool":
            for part in m.parts:
                if isinstance(part, canonical.ToolResult):
                    out.append(
                        protocol.ChatMessage(
                            "tool", part.text(), m.name, tool_call_id=part.tool_call_id
                        )
                    )
            continue
        calls = [protocol.ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls()]
        out.append(
            protocol.ChatMessage(
                m.role,
                m.text(),
                m.name,
                tool_calls=calls or None,
                reasoning_content=m.reasoning,
            )
        )
    return out


def _structured(output: canonical.OutputFormat | None) -> protocol.Structured | None:
    if output is None or output.kind == "text":
        return None
    if output.kind == "json_schema":
        schema = msgspec.json.encode(output.schema or {}).decode()
        return protocol.Structured("json_schema", json_schema=schema, strict=output.strict)
    return protocol.Structured(
        output.kind, regex=output.regex, choices=output.choices, grammar=output.grammar
    )


def _template_kwargs(request: canonical.ChatRequest) -> dict[str, object] | None:
    kwargs = dict(request.chat_template_kwargs or {})
    if request.thinking is not None:
        # Anthropic's thinking switch: the checkpoint's own thinking mode.
        kwargs.setdefault("enable_thinking", request.thinking.type != "disabled")
    if request.reasoning_effort is not None:
        # Thinking checkpoints (Qwen3) have an on/off switch, not levels.
        kwargs.setdefault("enable_thinking", request.reasoning_effort not in _THINKING_OFF)
    return kwargs or None


def choice_delta(delta: protocol.Delta) -> canonical.ChoiceDelta:
    return canonical.ChoiceDelta(
        index=delta.index,
        text=delta.text,
        reasoning=delta.reasoning_text,
        tool_calls=[
            canonical.ToolCallDelta(c.index, c.id, c.name, c.arguments) for c in delta.tool_calls
        ]
        or None,
        logprobs=[
            canonical.TokenLogprob(
                lp.token,
                lp.logprob,
                lp.bytes,
                [canonical.TopLogprob(t.token, t.logprob, t.bytes) for t in lp.top],
            )
            for lp in delta.logprobs
        ]
        or None,
        finish_reason=delta.finish_reason,
        stop_sequence=delta.stop_sequence,
    )
