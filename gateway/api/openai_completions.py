"""``POST /v1/completions``: OpenAI's legacy text completions, through the canonical model."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, post

from gateway import canonical
from gateway.api.openai_chat import relabel
from gateway.call import Call, admit
from gateway.canonical import Chunk
from gateway.canonical import Response as Answer
from gateway.errors import OpenAIError
from gateway.schemas.completions import (
    CompletionLogprobs,
    CompletionRequest,
    TextChoice,
    TextCompletion,
)
from gateway.schemas.wire import SSE_DONE, UsageOut, decode_body, encode, sse
from gateway.services import authenticate


class CompletionRenderer:
    """Canonical answers as OpenAI text completions; one per request (it tracks offsets)."""

    def __init__(self) -> None:
        self.relaying = False
        self.finished: set[int] = set()
        self.offsets: dict[int, int] = {}
        self.usage_sent = False

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

    def whole(self, call: Call, answer: Answer) -> bytes:
        if answer.raw is not None:
            return encode(relabel(call, answer.raw))
        usage = call.usage
        assert usage is not None
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

    def opening(self, call: Call, first: Chunk) -> bytes:
        self.relaying = first.raw is not None
        return b""

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        if self.relaying:
            return self._relay(call, chunk)
        with_top = bool(call.request.sampling.top_logprobs)
        out = []
        for choice in chunk.choices:
            if choice.text or choice.logprobs:
                logprobs = self._logprobs(choice.index, choice.logprobs, with_top)
                text = TextChoice(choice.index, choice.text, logprobs, None)
                out.append(b"data: " + self._body(call, [text], None) + b"\n\n")
            if choice.finish_reason is not None:
                self.finished.add(choice.index)
                end = TextChoice(choice.index, "", None, choice.finish_reason)
                out.append(b"data: " + self._body(call, [end], None) + b"\n\n")
        return b"".join(out)

    def _relay(self, call: Call, chunk: Chunk) -> bytes:
        raw = chunk.raw
        if raw is None:
            return b""
        if "usage" in raw and not call.request.include_usage:
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
                if i not in self.finished:
                    end = TextChoice(i, "", None, call.finish_reason or "stop")
                    out.append(b"data: " + self._body(call, [end], None) + b"\n\n")
        if call.request.include_usage and not self.usage_sent:
            out.append(b"data: " + self._body(call, [], UsageOut.of(call.billed())) + b"\n\n")
        out.append(SSE_DONE)
        return b"".join(out)

    def error(self, call: Call, error: OpenAIError) -> bytes:
        return b"data: " + encode(error.body()) + b"\n\n"


class CompletionsController(Controller):
    path = "/v1/completions"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/", status_code=200, summary="Create a text completion")
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, document = decode_body(await request.body(), CompletionRequest)
        data.check()
        body = data.canonical(document)
        call = await admit(request, body, operation="text_completion", id_prefix="cmpl-")
        if body.stream:
            return await call.stream(CompletionRenderer())
        return await call.complete(CompletionRenderer())
