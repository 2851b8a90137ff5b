"""``POST /v1/completions``: OpenAI's legacy text completions, through the canonical model."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response

from sluicegate.gateway import canonical
from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.api.openai_reply import OpenAIRenderer, reply
from sluicegate.gateway.api.openapi_body import body_operation
from sluicegate.gateway.call.call import Call
from sluicegate.gateway.canonical import Chunk, Usage
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.schemas.completions import (
    CompletionLogprobs,
    CompletionRequest,
    TextChoice,
    TextCompletion,
)
from sluicegate.gateway.schemas.wire import UsageOut, decode_body, encode
from sluicegate.gateway.services import authenticate


class CompletionRenderer(OpenAIRenderer):
    """Canonical answers as OpenAI text completions; one per request (it tracks offsets)."""

    def __init__(self) -> None:
        super().__init__()
        self.offsets: dict[int, int] = {}

    def _logprobs(
        self, index: int, logprobs: list[canonical.TokenLogprob] | None, with_top: bool
    ) -> CompletionLogprobs | None:
        if logprobs is None:
            return None
        offset = self.offsets.get(index, 0)
        offsets = []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.token)
        self.offsets[index] = offset
        return CompletionLogprobs(
            tokens=[lp.token for lp in logprobs],
            token_logprobs=[lp.logprob for lp in logprobs],
            top_logprobs=[{t.token: t.logprob for t in lp.top} for lp in logprobs]
            if with_top
            else None,
            text_offset=offsets,
        )

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

    def _event(self, call: Call, choices: list[TextChoice], usage: UsageOut | None = None) -> bytes:
        return b"data: " + self._body(call, choices, usage) + b"\n\n"

    def render_whole(self, call: Call, answer: Answer, usage: Usage) -> bytes:
        with_top = bool(call.request.sampling.top_logprobs)
        choices = [
            TextChoice(
                c.index,
                c.message.text(),
                self._logprobs(c.index, c.logprobs, with_top),
                c.finish_reason,
            )
            for c in answer.choices
        ]
        return self._body(call, choices, UsageOut.of(usage))

    def render_chunk(self, call: Call, chunk: Chunk) -> bytes:
        with_top = bool(call.request.sampling.top_logprobs)
        out = []
        for choice in chunk.choices:
            if choice.text or choice.logprobs:
                logprobs = self._logprobs(choice.index, choice.logprobs, with_top)
                text = TextChoice(choice.index, choice.text, logprobs, None)
                out.append(self._event(call, [text]))
            if choice.finish_reason is not None:
                self.finished.add(choice.index)
                end = TextChoice(choice.index, "", None, choice.finish_reason)
                out.append(self._event(call, [end]))
        return b"".join(out)

    def close_choices(self, call: Call) -> list[bytes]:
        reason = call.finish_reason or "stop"
        return [
            self._event(call, [TextChoice(i, "", None, reason)])
            for i in range(call.request.sampling.n)
            if i not in self.finished
        ]

    def usage_event(self, call: Call, usage: UsageOut) -> bytes:
        return self._event(call, [], usage)


class CompletionsController(Controller):
    path = "/v1/completions"
    guards = (authenticate,)
    tags = ("openai",)

    @inference_post(
        "/",
        status_code=200,
        summary="Create a text completion",
        operation_class=body_operation(CompletionRequest),
    )
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, document = decode_body(await request.body(), CompletionRequest)
        data.check()
        body = data.canonical(document)
        return await reply(
            request, body, CompletionRenderer(), operation="text_completion", id_prefix="cmpl-"
        )
