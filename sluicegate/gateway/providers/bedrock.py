"""AWS Bedrock's Converse API as a deployment (``provider: bedrock``).

``POST /model/{modelId}/converse`` and ``/converse-stream``, signed with botocore's SigV4
signer with credentials from the standard AWS chain (environment, shared files, instance
role), resolved and refreshed in a worker thread (aws_credentials.py: the chain's probes would
stall the event loop). ConverseStream answers in AWS's binary event
stream, decoded with botocore's ``EventStreamBuffer``. Turns are split and merged as for
Anthropic (translate/turns.py): system turns to ``system``, tool results to ``user`` turns of
``toolResult``; the blocks are Converse's own. Claude's ``thinking`` parameter travels in
``additionalModelRequestFields``; its reasoning comes back block by block, each with its
signature (or encrypted), and goes back in later assistant turns as it came, as Anthropic's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer, EventStreamError, ParserError
from botocore.session import Session

from sluicegate.gateway.canonical import (
    ChatRequest,
    Choice,
    ChoiceDelta,
    Chunk,
    ImagePart,
    Message,
    Part,
    ReasoningPiece,
    Response,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolResult,
    Usage,
)
from sluicegate.gateway.providers.aws_credentials import AwsCredentials
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.features import data_url, first_unsupported
from sluicegate.gateway.providers.hosted import HostedProvider, Sessions, StreamGuard
from sluicegate.gateway.translate.anthropic_out import thinking_param
from sluicegate.gateway.translate.turns import (
    split_turns,
    tool_input,
    usage_with_cache,
    with_thinking,
)

SUPPORTED = frozenset(
    {
        "top_k",
        "image",
        # Claude's thinking parameter, as Anthropic's (without display, until Bedrock is seen
        # to take it: a 400 naming it meanwhile).
        "thinking",
        # requestMetadata (recorded in the invocation logs, for attribution): the caller's
        # identifiers. Bedrock has no cache-routing key (its cache is keyed by cachePoint
        # blocks), so prompt_cache_key goes without, as the README's provider table documents.
        "user",
        "safety_identifier",
        "prompt_cache_key",
    }
)

FINISH_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "tool_calls",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
    "model_context_window_exceeded": "length",
}
_EXCEPTION_STATUS = {
    "throttlingException": 429,
    "serviceUnavailableException": 503,
    "modelStreamErrorException": 500,
    "internalServerException": 500,
    "validationException": 400,
}


def _block(part: Part) -> dict[str, Any] | None:
    if isinstance(part, TextPart):
        return {"text": part.text} if part.text else None
    if isinstance(part, ImagePart):
        media_type, data = data_url(part.url)
        return {"image": {"format": media_type.split("/")[-1], "source": {"bytes": data}}}
    if isinstance(part, ToolCall):
        return {
            "toolUse": {
                "toolUseId": part.id,
                "name": part.name,
                "input": tool_input(part.arguments),
            }
        }
    if isinstance(part, ToolResult):
        result = {
            "toolUseId": part.tool_call_id,
            "content": [{"text": part.text()}],
            "status": "error" if part.is_error else "success",
        }
        return {"toolResult": result}
    return None


def _reasoning_block(piece: ReasoningPiece) -> dict[str, Any]:
    if piece.redacted is not None:
        return {"reasoningContent": {"redactedContent": piece.redacted}}
    return {
        "reasoningContent": {"reasoningText": {"text": piece.text, "signature": piece.signature}}
    }


def _blocks(message: Message) -> list[dict[str, Any]]:
    return with_thinking(message, _block, _reasoning_block)


def converse_body(request: ChatRequest) -> dict[str, Any]:
    system, turns = split_turns(request.messages or (), _blocks)
    body: dict[str, Any] = {"messages": turns}
    if system:
        body["system"] = [{"text": text} for text in system]
    s = request.sampling
    config = {
        "maxTokens": s.max_tokens,
        "temperature": s.temperature,
        "topP": s.top_p,
        "stopSequences": s.stop,
    }
    inference = {k: v for k, v in config.items() if v is not None}
    if inference:
        body["inferenceConfig"] = inference
    extra: dict[str, Any] = {}
    if s.top_k:
        extra["top_k"] = s.top_k
    if request.thinking is not None and request.thinking.type != "disabled":
        # Claude's own parameter: Converse has none for thinking. A model that does not think
        # this way refuses it (a 400 from Bedrock), rather than thinking being dropped.
        extra["thinking"] = thinking_param(request.thinking)
    if extra:
        body["additionalModelRequestFields"] = extra
    if request.tools:
        tools: dict[str, Any] = {
            "tools": [
                {
                    "toolSpec": {
                        "name": t.name,
                        **({"description": t.description} if t.description else {}),
                        "inputSchema": {"json": t.parameters or {"type": "object"}},
                    }
                }
                for t in request.tools
            ]
        }
        choice = request.tool_choice
        if choice is not None and choice.mode != "auto":
            tools["toolChoice"] = (
                {"any": {}} if choice.mode == "required" else {"tool": {"name": choice.name}}
            )
        body["toolConfig"] = tools
    identifiers = {"user": request.user, "safety_identifier": request.safety_identifier}
    metadata = {k: v for k, v in identifiers.items() if v is not None}
    if metadata:
        body["requestMetadata"] = metadata
    return body


def usage_of(raw: dict[str, Any] | None) -> Usage | None:
    return usage_with_cache(
        raw,
        input="inputTokens",
        output="outputTokens",
        read="cacheReadInputTokens",
        written="cacheWriteInputTokens",
    )


def response_of(body: dict[str, Any]) -> Response:
    parts: list[Part] = []
    reasoning: list[str] = []
    pieces: list[ReasoningPiece] = []
    for block in ((body.get("output") or {}).get("message") or {}).get("content") or ():
        if "text" in block:
            parts.append(TextPart(block["text"]))
        elif "toolUse" in block:
            use = block["toolUse"]
            arguments = json.dumps(use.get("input") or {}, separators=(",", ":"))
            parts.append(ToolCall(use["toolUseId"], use["name"], arguments))
        elif "reasoningContent" in block:
            # Claude signs each block of its reasoning (or returns it encrypted) and wants it
            # back as it was, in its place: kept piece by piece, as Anthropic's.
            content = block["reasoningContent"] or {}
            if "redactedContent" in content:
                pieces.append(ReasoningPiece(redacted=content["redactedContent"], at=len(parts)))
                continue
            text_block = content.get("reasoningText") or {}
            text = text_block.get("text", "")
            reasoning.append(text)
            signature = text_block.get("signature") or None
            pieces.append(ReasoningPiece(text, signature, at=len(parts)))
    stop = body.get("stopReason") or "end_turn"
    message = Message(
        "assistant", parts, reasoning="".join(reasoning) or None, reasoning_pieces=pieces or None
    )
    usage = usage_of(body.get("usage"))
    choice = Choice(0, message, FINISH_REASONS.get(stop, stop))
    return Response([choice], usage=usage, num_tokens=usage.completion_tokens if usage else 0)


class _StreamReader:
    """ConverseStream events (by ``:event-type``) to canonical chunks."""

    def __init__(self) -> None:
        self._calls: dict[int, int] = {}
        self.finish: str | None = None

    def read(self, event_type: str, event: dict[str, Any]) -> Chunk | None:
        if event_type == "contentBlockStart":
            use = (event.get("start") or {}).get("toolUse")
            if use:
                index = self._calls[event.get("contentBlockIndex", 0)] = len(self._calls)
                head = ToolCallDelta(index, id=use.get("toolUseId"), name=use.get("name"))
                return Chunk([ChoiceDelta(tool_calls=[head])])
        elif event_type == "contentBlockDelta":
            delta = event.get("delta") or {}
            if "text" in delta:
                return Chunk([ChoiceDelta(text=delta["text"])], num_tokens=1)
            if "toolUse" in delta:
                index = self._calls.get(event.get("contentBlockIndex", 0), 0)
                piece = ToolCallDelta(index, arguments=delta["toolUse"].get("input", ""))
                return Chunk([ChoiceDelta(tool_calls=[piece])], num_tokens=1)
            if "reasoningContent" in delta:
                content = delta["reasoningContent"] or {}
                if content.get("signature"):  # ends its block of reasoning
                    return Chunk([ChoiceDelta(reasoning_signature=content["signature"])])
                if content.get("redactedContent"):
                    return Chunk([ChoiceDelta(reasoning_redacted=content["redactedContent"])])
                text = content.get("text", "")
                return Chunk([ChoiceDelta(reasoning=text)], num_tokens=1) if text else None
        elif event_type == "messageStop":
            stop = event.get("stopReason") or "end_turn"
            self.finish = FINISH_REASONS.get(stop, stop)
        elif event_type == "metadata":
            return Chunk(
                [ChoiceDelta(finish_reason=self.finish or "stop")],
                usage=usage_of(event.get("usage")),
            )
        return None


class BedrockProvider(HostedProvider):
    def __init__(
        self,
        *,
        name: str,
        model: str,
        sessions: Sessions,
        region: str | None = None,
        base_url: str | None = None,
        read_timeout_s: float = 600.0,
        credentials: Credentials | None = None,
    ) -> None:
        super().__init__(name, model, sessions, read_timeout_s)
        session = Session()
        self._region = region or session.get_config_variable("region") or "us-east-1"
        base = base_url or f"https://bedrock-runtime.{self._region}.amazonaws.com"
        self._base = f"{base.rstrip('/')}/model/{quote(model, safe='')}"
        self._credentials = AwsCredentials(session, credentials)

    async def _signed_headers(self, url: str, body: bytes, accept: str) -> dict[str, str]:
        frozen = await self._credentials.frozen()
        if frozen is None:
            raise ProviderError(f"deployment {self.name} has no AWS credentials", retryable=True)
        request = AWSRequest(
            method="POST",
            url=url,
            data=body,
            headers={"content-type": "application/json", "accept": accept},
        )
        SigV4Auth(frozen, "bedrock", self._region).add_auth(request)
        return dict(request.headers.items())

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        return first_unsupported(request, SUPPORTED, "Bedrock Converse")

    async def complete(self, request: ChatRequest) -> Response:
        url = f"{self._base}/converse"
        body = json.dumps(converse_body(request)).encode()
        headers = await self._signed_headers(url, body, "application/json")
        return await self._answer(request, url, headers, body, response_of)

    async def count_tokens(self, request: ChatRequest) -> int | None:
        """Bedrock's own count of the prompt (``CountTokens``, the Converse body's messages,
        system, tools and model fields); None where the model has no count (Bedrock answers
        a ValidationException), for the router to measure the prompt another way."""
        converse = converse_body(request)
        converse.pop("inferenceConfig", None)
        url = f"{self._base}/count-tokens"
        body = json.dumps({"input": {"converse": converse}}).encode()
        headers = await self._signed_headers(url, body, "application/json")
        try:
            return await self._answer(
                request, url, headers, body, lambda answer: int(answer["inputTokens"])
            )
        except ProviderError as exc:
            if exc.status_code == 400 and not exc.retryable:
                return None
            raise

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        url = f"{self._base}/converse-stream"
        body = json.dumps(converse_body(request)).encode()
        headers = await self._signed_headers(url, body, "application/vnd.amazon.eventstream")
        reader = _StreamReader()
        # ParserError: a frame whose checksum or lengths are wrong (not a ValueError).
        guard = StreamGuard(self.name, decode_errors=(EventStreamError, ParserError, ValueError))
        buffer = EventStreamBuffer()
        async with self._http.stream(url, headers, body, deadline=request.deadline) as resp:
            with guard.reading():
                async for data in resp.aiter_bytes():
                    buffer.add_data(data)
                    for message in buffer:
                        chunk = _read(reader, message.headers, message.payload, guard)
                        if chunk is not None:
                            yield guard.saw(chunk)
                            if chunk.finish_reason() is not None:
                                return
        raise guard.ended_early()


def _read(
    reader: _StreamReader, headers: dict[str, Any], payload: bytes, guard: StreamGuard
) -> Chunk | None:
    event = json.loads(payload) if payload else {}
    if headers.get(":message-type") == "exception":
        kind = str(headers.get(":exception-type", ""))
        status = _EXCEPTION_STATUS.get(kind, 500)
        raise guard.upstream_error(status, str(event.get("message", kind)))
    return reader.read(str(headers.get(":event-type", "")), event)
