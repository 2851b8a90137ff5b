"""``POST /v1/completions``: OpenAI's legacy text completions, through the canonical model."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post
from litestar.params import JSONBody

from gateway.call import TEXT_COMPLETION_MAX_TOKENS, Call, admit, authenticate
from gateway.canonical import Chunk
from gateway.canonical import Response as Answer
from gateway.errors import OpenAIError
from gateway.schemas import (
    SSE_DONE,
    CompletionRequest,
    TextChoice,
    TextCompletion,
    UsageOut,
    encode,
    sse,
)


class CompletionRenderer:
    """Canonical answers as OpenAI text completions."""

    def _body(self, call: Call, choices: list[TextChoice], usage: UsageOut | None) -> bytes:
        return encode(
            TextCompletion(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=choices,
                usage=usage,
            )
        )

    def whole(self, call: Call, answer: Answer) -> bytes:
        usage = call.usage
        assert usage is not None
        choice = TextChoice(0, answer.text(), None, call.finish_reason or "stop")
        return self._body(call, [choice], UsageOut.of(usage.prompt_tokens, usage.completion_tokens))

    def opening(self, call: Call) -> bytes:
        return b""

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        text = "".join(choice.text for choice in chunk.choices)
        if not text:
            return b""
        return b"data: " + self._body(call, [TextChoice(0, text, None, None)], None) + b"\n\n"

    def closing(self, call: Call) -> bytes:
        end = sse(
            TextCompletion(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[TextChoice(0, "", None, call.finish_reason)],
            )
        )
        if call.request.include_usage:
            usage = call.billed()
            out = UsageOut.of(usage.prompt_tokens, usage.completion_tokens)
            end += b"data: " + self._body(call, [], out) + b"\n\n"
        return end + SSE_DONE

    def error(self, call: Call, error: OpenAIError) -> bytes:
        return b"data: " + encode(error.body()) + b"\n\n"


RENDERER = CompletionRenderer()


class CompletionsController(Controller):
    path = "/v1/completions"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/", status_code=200, summary="Create a text completion")
    async def create(
        self, request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
    ) -> Response[Any]:
        data.check()
        body = data.canonical()
        body.sampling.max_tokens = body.sampling.max_tokens or TEXT_COMPLETION_MAX_TOKENS
        call = await admit(request, body, operation="text_completion", id_prefix="cmpl-")
        if body.stream:
            return await call.stream(RENDERER)
        return await call.complete(RENDERER)
