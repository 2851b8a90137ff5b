"""Google AI's Gemini API as a deployment (``provider: gemini``).

``POST {base}/v1beta/models/{model}:generateContent`` and ``:streamGenerateContent?alt=sse``
with ``x-goog-api-key``. System turns become ``systemInstruction``, tools
``functionDeclarations``, assistant calls ``functionCall`` parts and tool results
``functionResponse`` parts (Gemini names the function, not the call, so the name is found from
the call id in an earlier turn). Usage comes from ``usageMetadata``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from sluicegate.gateway.canonical import (
    ChatRequest,
    Choice,
    ChoiceDelta,
    Chunk,
    ImagePart,
    Message,
    Part,
    Response,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolResult,
    Usage,
)
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.features import data_url, first_unsupported
from sluicegate.gateway.providers.hosted import (
    HostedProvider,
    Sessions,
    StreamGuard,
    json_headers,
    sse_events,
)
from sluicegate.gateway.translate.turns import split_turns, tool_input

DEFAULT_BASE_URL = "https://generativelanguage.googleapis.com"

SUPPORTED = frozenset(
    {
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "thinking",
        # Gemini returns thought summaries (includeThoughts) or no thoughts at all.
        "thinking_display",
        "reasoning_effort",
        "response_format:json_object",
        "response_format:json_schema",
        "tool_choice:none",
        "image",
        # The Gemini API has no per-request field for an end user or a cache-routing key
        # (labels exist only on Vertex AI, for billing); these identifiers never change the
        # answer, so they go without, as the README's provider table documents.
        "user",
        "safety_identifier",
        "prompt_cache_key",
    }
)

FINISH_REASONS = {
    "STOP": "stop",
    "MAX_TOKENS": "length",
    "SAFETY": "content_filter",
    "RECITATION": "content_filter",
    "BLOCKLIST": "content_filter",
    "PROHIBITED_CONTENT": "content_filter",
    "SPII": "content_filter",
}
_REFUSING_STATUSES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED", "FAILED_PRECONDITION"})
"""Google's error statuses that fault the deployment: its credentials, or its project (Gemini
answers FAILED_PRECONDITION where the free tier is not offered and billing is off)."""
_REFUSING_REASONS = frozenset(
    {
        "SERVICE_DISABLED",
        "BILLING_DISABLED",
        "CONSUMER_INVALID",
        "CONSUMER_SUSPENDED",
        "ACCESS_TOKEN_EXPIRED",
        "ACCESS_TOKEN_SCOPE_INSUFFICIENT",
    }
)
"""``google.rpc.ErrorInfo`` reasons that fault the deployment, besides every ``API_KEY_*``."""
_EFFORT_BUDGET = {"none": 0, "minimal": 512, "low": 1024, "medium": 8192, "high": 24576}


def _parts(message: Message, call_names: dict[str, str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in message.parts:
        if isinstance(part, TextPart):
            if part.text:
                out.append({"text": part.text})
        elif isinstance(part, ImagePart):
            mime, data = data_url(part.url)
            out.append({"inlineData": {"mimeType": mime, "data": data}})
        elif isinstance(part, ToolCall):
            call_names[part.id] = part.name
            out.append({"functionCall": {"name": part.name, "args": tool_input(part.arguments)}})
        elif isinstance(part, ToolResult):
            key = "error" if part.is_error else "output"
            response = {"name": call_names.get(part.tool_call_id, part.tool_call_id)}
            out.append({"functionResponse": {**response, "response": {key: part.text()}}})
    return out


def generate_body(request: ChatRequest) -> dict[str, Any]:
    call_names: dict[str, str] = {}
    system, contents = split_turns(
        request.messages or (),
        lambda message: _parts(message, call_names),
        assistant="model",
        key="parts",
    )
    body: dict[str, Any] = {"contents": contents}
    if system:
        body["systemInstruction"] = {"parts": [{"text": "\n\n".join(system)}]}
    s = request.sampling
    config = {
        "maxOutputTokens": s.max_tokens,
        "temperature": s.temperature,
        "topP": s.top_p,
        "topK": s.top_k,
        "stopSequences": s.stop,
        "candidateCount": s.n if s.n > 1 else None,
        "seed": s.seed,
        "presencePenalty": s.presence_penalty,
        "frequencyPenalty": s.frequency_penalty,
    }
    generation: dict[str, Any] = {k: v for k, v in config.items() if v is not None}
    output = request.output
    if output is not None and output.kind in {"json_object", "json_schema"}:
        generation["responseMimeType"] = "application/json"
        if output.kind == "json_schema":
            generation["responseJsonSchema"] = output.schema or {}
    thinking = request.thinking
    if thinking is not None or request.reasoning_effort is not None:
        if thinking is not None and thinking.type == "disabled":
            budget = 0
        elif thinking is not None and thinking.type == "enabled" and thinking.budget_tokens:
            budget = thinking.budget_tokens
        elif request.reasoning_effort is not None:
            budget = _EFFORT_BUDGET[request.reasoning_effort]
        else:
            budget = -1  # adaptive: the model decides
        shown = budget != 0 and (thinking is None or thinking.display != "omitted")
        generation["thinkingConfig"] = {"thinkingBudget": budget, "includeThoughts": shown}
    if generation:
        body["generationConfig"] = generation
    if request.tools:
        declarations = [
            {
                "name": t.name,
                **({"description": t.description} if t.description else {}),
                **({"parametersJsonSchema": t.parameters} if t.parameters else {}),
            }
            for t in request.tools
        ]
        body["tools"] = [{"functionDeclarations": declarations}]
    if request.tool_choice is not None:
        mode = request.tool_choice.mode
        calling: dict[str, Any] = {
            "mode": {"auto": "AUTO", "none": "NONE", "required": "ANY", "function": "ANY"}[mode]
        }
        if mode == "function" and request.tool_choice.name:
            calling["allowedFunctionNames"] = [request.tool_choice.name]
        body["toolConfig"] = {"functionCallingConfig": calling}
    return body


def usage_of(raw: dict[str, Any] | None) -> Usage | None:
    if not raw:
        return None
    thoughts = int(raw.get("thoughtsTokenCount") or 0)
    return Usage(
        prompt_tokens=int(raw.get("promptTokenCount") or 0),
        completion_tokens=int(raw.get("candidatesTokenCount") or 0) + thoughts,
        cached_tokens=int(raw.get("cachedContentTokenCount") or 0),
        reasoning_tokens=thoughts,
    )


def refused(status: int, raw: bytes) -> bool:
    """Whether Google refused the deployment rather than the request. A bad key is not a 401:
    it is ``400 INVALID_ARGUMENT`` whose ``details`` hold an ``ErrorInfo`` with reason
    ``API_KEY_INVALID`` (Google's error model: ``{"error": {code, message, status, details}}``)."""
    try:
        error = json.loads(raw)
    except ValueError:
        return False
    if isinstance(error, list) and error:
        error = error[0]
    error = error.get("error") if isinstance(error, dict) else None
    if not isinstance(error, dict):
        return False
    if error.get("status") in _REFUSING_STATUSES:
        return True
    for detail in error.get("details") or ():
        reason = detail.get("reason") if isinstance(detail, dict) else None
        if isinstance(reason, str) and (
            reason.startswith("API_KEY_") or reason in _REFUSING_REASONS
        ):
            return True
    return False


class _Calls:
    """Gemini's function calls carry no id (or an optional one): number them per choice."""

    def __init__(self, response_id: str) -> None:
        self._prefix = f"call_{response_id[:16]}"
        self.count: dict[int, int] = {}

    def next(self, choice: int, given: str | None) -> tuple[int, str]:
        index = self.count.get(choice, 0)
        self.count[choice] = index + 1
        return index, given or f"{self._prefix}_{choice}_{index}"


def _candidate_deltas(body: dict[str, Any], calls: _Calls) -> list[ChoiceDelta]:
    deltas = []
    for position, candidate in enumerate(body.get("candidates") or ()):
        index = int(candidate.get("index", position))
        delta = ChoiceDelta(index=index)
        tool_calls = []
        for part in (candidate.get("content") or {}).get("parts") or ():
            if "text" in part:
                if part.get("thought"):
                    delta.reasoning += part["text"]
                else:
                    delta.text += part["text"]
            elif "functionCall" in part:
                call = part["functionCall"]
                k, call_id = calls.next(index, call.get("id"))
                arguments = json.dumps(call.get("args") or {}, separators=(",", ":"))
                tool_calls.append(
                    ToolCallDelta(k, id=call_id, name=call["name"], arguments=arguments)
                )
        if tool_calls:
            delta.tool_calls = tool_calls
        reason = candidate.get("finishReason")
        if reason:
            finish = FINISH_REASONS.get(reason, reason.lower())
            delta.finish_reason = (
                "tool_calls" if calls.count.get(index) and finish == "stop" else finish
            )
        deltas.append(delta)
    return deltas


class GeminiProvider(HostedProvider):
    def __init__(
        self,
        *,
        name: str,
        model: str,
        sessions: Sessions,
        api_key: str | None,
        base_url: str = DEFAULT_BASE_URL,
        read_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(name, model, sessions, read_timeout_s, refusal=refused)
        self._base = f"{base_url.rstrip('/')}/v1beta/models/{model}"
        self._headers = json_headers("x-goog-api-key", api_key)

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        return first_unsupported(request, SUPPORTED, "Gemini models")

    async def complete(self, request: ChatRequest) -> Response:
        body = json.dumps(generate_body(request)).encode()
        calls = _Calls(request.request_id or "gemini")
        answer, deltas = await self._answer(
            request,
            f"{self._base}:generateContent",
            self._headers,
            body,
            lambda answer: (answer, _candidate_deltas(answer, calls)),
        )
        if not deltas:
            raise ProviderError(f"deployment {self.name} answered no candidates", retryable=True)
        choices = []
        for d in deltas:
            parts: list[Part] = [TextPart(d.text)]
            parts += [ToolCall(c.id or "", c.name or "", c.arguments) for c in d.tool_calls or ()]
            message = Message("assistant", parts, reasoning=d.reasoning or None)
            choices.append(Choice(d.index, message, d.finish_reason or "stop"))
        usage = usage_of(answer.get("usageMetadata"))
        return Response(choices, usage=usage, num_tokens=usage.completion_tokens if usage else 0)

    async def count_tokens(self, request: ChatRequest) -> int:
        """Gemini's own count of the prompt (``models/{model}:countTokens``), given as the
        ``generateContentRequest`` it would serve, so system instruction and tools count too;
        without ``generationConfig``, which says how to generate, not what is read."""
        prompt = generate_body(request)
        prompt.pop("generationConfig", None)
        body = json.dumps({"generateContentRequest": {"model": f"models/{self.model}", **prompt}})
        return await self._answer(
            request,
            f"{self._base}:countTokens",
            self._headers,
            body.encode(),
            lambda answer: int(answer.get("totalTokens") or 0),
        )

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        body = json.dumps(generate_body(request)).encode()
        url = f"{self._base}:streamGenerateContent?alt=sse"
        calls = _Calls(request.request_id or "gemini")
        usage: Usage | None = None
        guard = StreamGuard(self.name)
        finished: list[ChoiceDelta] = []
        async with self._http.stream(url, self._headers, body, deadline=request.deadline) as resp:
            with guard.reading():
                async for _, data in sse_events(resp):
                    event = json.loads(data)
                    if "error" in event:
                        message = (event["error"] or {}).get("message", "")
                        raise ProviderError(
                            f"deployment {self.name} failed: {message}",
                            retryable=not guard.started,
                        )
                    usage = usage_of(event.get("usageMetadata")) or usage
                    deltas = _candidate_deltas(event, calls)
                    # Finish reasons wait for the last event, which carries the final usage.
                    for d in deltas:
                        if d.finish_reason is not None:
                            finished.append(
                                ChoiceDelta(index=d.index, finish_reason=d.finish_reason)
                            )
                            d.finish_reason = None
                    output = [d for d in deltas if d.has_output()]
                    if output:
                        yield guard.saw(Chunk(output, num_tokens=1))
        if not finished:
            raise guard.ended_early()
        yield Chunk(finished, usage=usage)
