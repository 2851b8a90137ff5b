"""``POST /v1/chat/completions``: OpenAI's chat API in, the canonical model through ``call``.

The controller only translates: the body into a canonical ``ChatRequest``, and the canonical
answer back into OpenAI's ``chat.completion`` object or ``chat.completion.chunk`` events.
"""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.params import JSONBody

from gateway.call import Call, Services, admit, authenticate
from gateway.canonical import Chunk
from gateway.canonical import Response as Answer
from gateway.errors import OpenAIError
from gateway.schemas import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    UsageOut,
    encode,
    sse,
)


class ChatRenderer:
    """Canonical answers as OpenAI chat completions."""

    def whole(self, call: Call, answer: Answer) -> bytes:
        usage = call.usage
        assert usage is not None
        return encode(
            ChatCompletion(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[
                    ChatChoice(
                        0,
                        AssistantMessage("assistant", answer.text()),
                        None,
                        call.finish_reason or "stop",
                    )
                ],
                usage=UsageOut.of(usage.prompt_tokens, usage.completion_tokens),
            )
        )

    def _event(self, call: Call, delta: ChunkDelta, finish: str | None) -> bytes:
        return sse(
            ChatCompletionChunk(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[ChunkChoice(0, delta, None, finish)],
            )
        )

    def opening(self, call: Call) -> bytes:
        return self._event(call, ChunkDelta(role="assistant", content=""), None)

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        text = "".join(choice.text for choice in chunk.choices)
        return self._event(call, ChunkDelta(content=text), None) if text else b""

    def closing(self, call: Call) -> bytes:
        end = self._event(call, ChunkDelta(), call.finish_reason)
        if call.request.include_usage:
            usage = call.billed()
            end += sse(
                ChatCompletionChunk(
                    id=call.response_id,
                    created=call.created,
                    model=call.public_model,
                    choices=[],
                    usage=UsageOut.of(usage.prompt_tokens, usage.completion_tokens),
                )
            )
        return end + SSE_DONE

    def error(self, call: Call, error: OpenAIError) -> bytes:
        return b"data: " + encode(error.body()) + b"\n\n"


RENDERER = ChatRenderer()


class ChatCompletionsController(Controller):
    path = "/v1/chat/completions"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/", status_code=200, summary="Create a chat completion")
    async def create(
        self, request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]
    ) -> Response[Any]:
        data.check()
        body = data.canonical()
        services: Services = request.app.state.services
        body.sampling.max_tokens = body.sampling.max_tokens or services.settings.default_max_tokens
        call = await admit(request, body, operation="chat", id_prefix="chatcmpl-")
        if body.stream:
            return await call.stream(RENDERER)
        return await call.complete(RENDERER)
