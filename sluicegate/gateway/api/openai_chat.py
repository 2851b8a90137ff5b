"""``POST /v1/chat/completions``: OpenAI's chat API in, the canonical model through ``call``.

The controller only translates: the body into a canonical ``ChatRequest``, and the canonical
answer back into OpenAI's ``chat.completion`` object or ``chat.completion.chunk`` events (an
answer in OpenAI's own shape is relayed by ``OpenAIRenderer``, see openai_reply.py).
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response

from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.api.openai_reply import OpenAIRenderer, reply
from sluicegate.gateway.api.openapi_body import body_operation
from sluicegate.gateway.call.call import Call
from sluicegate.gateway.canonical import Chunk, Usage
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.schemas.chat import ChatCompletionRequest
from sluicegate.gateway.schemas.chat_out import (
    ChatCompletion,
    ChatCompletionChunk,
    ChunkChoice,
    ChunkDelta,
    choice_out,
    delta_out,
    logprobs_out,
)
from sluicegate.gateway.schemas.wire import UsageOut, decode_body, encode, sse
from sluicegate.gateway.services import authenticate


class ChatRenderer(OpenAIRenderer):
    """Canonical answers as OpenAI chat completions; one per request (it tracks the stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: set[int] = set()

    def render_whole(self, call: Call, answer: Answer, usage: Usage) -> bytes:
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

    def _role(self, call: Call, index: int, text: bool) -> bytes:
        """A choice's first event names the role; its content starts as ``""`` for a text
        answer and stays ``null`` for tool calls, as in the non-streamed message."""
        self.opened.add(index)
        role = ChunkDelta(role="assistant", content="" if text else None)
        return self._event(call, ChunkChoice(index, role, None, None))

    def render_chunk(self, call: Call, chunk: Chunk) -> bytes:
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

    def close_choices(self, call: Call) -> list[bytes]:
        out = []
        for i in range(call.request.sampling.n):
            if i not in self.opened:
                out.append(self._role(call, i, True))
            if i not in self.finished:
                end = ChunkChoice(i, ChunkDelta(), None, call.finish_reason or "stop")
                out.append(self._event(call, end))
        return out

    def usage_event(self, call: Call, usage: UsageOut) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[],
                usage=usage,
            )
        )


class ChatCompletionsController(Controller):
    path = "/v1/chat/completions"
    guards = (authenticate,)
    tags = ("openai",)

    @inference_post(
        "/",
        status_code=200,
        summary="Create a chat completion",
        operation_class=body_operation(ChatCompletionRequest),
    )
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, document = decode_body(await request.body(), ChatCompletionRequest)
        data.check()
        body = data.canonical(document)
        return await reply(request, body, ChatRenderer(), operation="chat", id_prefix="chatcmpl-")
