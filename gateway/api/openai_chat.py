"""``POST /v1/chat/completions``: OpenAI's chat API in, the canonical model through ``call``.

The controller only translates: the body into a canonical ``ChatRequest``, and the canonical
answer back into OpenAI's ``chat.completion`` object or ``chat.completion.chunk`` events. An
answer that arrives in OpenAI's own shape (``raw``, from an OpenAI-compatible upstream that
got the client's body) goes back as the upstream wrote it, only ``id`` and ``model`` rewritten.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post

from gateway.call import Call, admit
from gateway.canonical import Chunk
from gateway.canonical import Response as Answer
from gateway.errors import OpenAIError
from gateway.schemas.chat import ChatCompletionRequest
from gateway.schemas.chat_out import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    choice_out,
    delta_out,
    logprobs_out,
)
from gateway.schemas.wire import SSE_DONE, UsageOut, decode_body, encode, sse
from gateway.services import authenticate


def relabel(call: Call, raw: dict[str, Any]) -> dict[str, Any]:
    """An upstream's own object with our id and the model name the client used."""
    return {**raw, "id": call.response_id, "model": call.public_model}


class ChatRenderer:
    """Canonical answers as OpenAI chat completions; one per request (it tracks the stream)."""

    def __init__(self) -> None:
        self.relaying = False
        """The upstream speaks OpenAI's chat wire: its chunks go out as they came."""
        self.opened: set[int] = set()
        self.finished: set[int] = set()
        self.usage_sent = False

    def whole(self, call: Call, answer: Answer) -> bytes:
        if answer.raw is not None:
            return encode(relabel(call, answer.raw))
        usage = call.usage
        assert usage is not None
        return encode(
            ChatCompletion(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[choice_out(choice) for choice in answer.choices],
                usage=UsageOut.of(usage),
            )
        )

    def _event(self, call: Call, choice: ChunkChoice) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[choice],
            )
        )

    def opening(self, call: Call, first: Chunk) -> bytes:
        self.relaying = first.raw is not None
        return b""

    def _role(self, call: Call, index: int, text: bool) -> bytes:
        """A choice's first event names the role; its content starts as ``""`` for a text
        answer and stays ``null`` for tool calls, as in the non-streamed message."""
        self.opened.add(index)
        role = ChunkDelta(role="assistant", content="" if text else None)
        return self._event(call, ChunkChoice(index, role, None, None))

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        if self.relaying:
            return self._relay(call, chunk)
        out = []
        for choice in chunk.choices:
            if choice.index not in self.opened:
                out.append(self._role(call, choice.index, bool(choice.text)))
            if choice.has_output() or choice.logprobs:
                delta = delta_out(choice)
                logprobs = logprobs_out(choice.logprobs)
                out.append(self._event(call, ChunkChoice(choice.index, delta, logprobs, None)))
            if choice.finish_reason is not None:
                self.finished.add(choice.index)
                end = ChunkChoice(choice.index, ChunkDelta(), None, choice.finish_reason)
                out.append(self._event(call, end))
        return b"".join(out)

    def _relay(self, call: Call, chunk: Chunk) -> bytes:
        raw = chunk.raw
        if raw is None:
            return b""
        if "usage" in raw and not call.request.include_usage:
            # Usage was asked of the upstream for our accounting, not by this client.
            if not raw.get("choices"):
                return b""
            raw = {k: v for k, v in raw.items() if k != "usage"}
        elif raw.get("usage"):
            self.usage_sent = True
        return sse(relabel(call, raw))

    def closing(self, call: Call) -> bytes:
        out = []
        if not self.relaying:
            for i in range(call.request.sampling.n):
                if i not in self.opened:
                    out.append(self._role(call, i, True))
                if i not in self.finished:
                    end = ChunkChoice(i, ChunkDelta(), None, call.finish_reason or "stop")
                    out.append(self._event(call, end))
        if call.request.include_usage and not self.usage_sent:
            out.append(
                sse(
                    ChatCompletionChunk(
                        id=call.response_id,
                        created=call.created,
                        model=call.public_model,
                        choices=[],
                        usage=UsageOut.of(call.billed()),
                    )
                )
            )
        out.append(SSE_DONE)
        return b"".join(out)

    def error(self, call: Call, error: OpenAIError) -> bytes:
        return b"data: " + encode(error.body()) + b"\n\n"


class ChatCompletionsController(Controller):
    path = "/v1/chat/completions"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/", status_code=200, summary="Create a chat completion")
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, document = decode_body(await request.body(), ChatCompletionRequest)
        data.check()
        body = data.canonical(document)
        call = await admit(request, body, operation="chat", id_prefix="chatcmpl-")
        if body.stream:
            return await call.stream(ChatRenderer())
        return await call.complete(ChatRenderer())
