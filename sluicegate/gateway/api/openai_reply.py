"""What OpenAI's chat and text completion endpoints share once the body is parsed.

``reply`` admits the call and answers it streamed or whole. ``OpenAIRenderer`` does what both
wire shapes do alike: an answer that arrives in OpenAI's own shape (``raw``, from an
OpenAI-compatible upstream that got the client's body) goes back as the upstream wrote it,
only ``id`` and ``model`` rewritten; a stream ends with a usage event only when the client
asked for one and none went out yet, then ``[DONE]``. Subclasses render our own canonical
answers: the whole body, a chunk's events, and the closing events of choices still open.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from litestar import Request, Response

from sluicegate.gateway.admission.admit import admit
from sluicegate.gateway.call.call import Call, Renderer
from sluicegate.gateway.call.stream import stream
from sluicegate.gateway.canonical import ChatRequest, Chunk, Usage
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.schemas.wire import SSE_DONE, UsageOut, encode, sse


async def reply(
    request: Request[Any, Any, Any],
    body: ChatRequest,
    renderer: Renderer,
    *,
    operation: str,
    id_prefix: str,
) -> Response[Any]:
    """Admit the parsed request and answer it: a stream of events or one JSON body."""
    early = None if body.stream else request.app.state.services.router.complete
    call = await admit(request, body, operation=operation, id_prefix=id_prefix, early=early)
    if body.stream:
        return await stream(call, renderer)
    return await call.complete(renderer)


def relabel(call: Call, raw: dict[str, Any]) -> dict[str, Any]:
    """An upstream's own object with our id and the model name the client used."""
    return {**raw, "id": call.response_id, "model": call.public_model}


class OpenAIRenderer(ABC):
    """One per request: it tracks which choices of the stream have ended."""

    def __init__(self) -> None:
        self.relaying = False
        """The upstream speaks OpenAI's wire: its chunks go out as they came."""
        self.finished: set[int] = set()
        self.usage_sent = False

    @abstractmethod
    def render_whole(self, call: Call, answer: Answer, usage: Usage) -> bytes:
        """A canonical answer's body."""

    @abstractmethod
    def render_chunk(self, call: Call, chunk: Chunk) -> bytes:
        """A canonical chunk's events (adding ended choices to ``finished``)."""

    @abstractmethod
    def close_choices(self, call: Call) -> list[bytes]:
        """The events that end the choices a canonical stream left open."""

    @abstractmethod
    def usage_event(self, call: Call, usage: UsageOut) -> bytes:
        """The stream's usage event."""

    def whole(self, call: Call, answer: Answer) -> bytes:
        if answer.raw is not None:
            return encode(relabel(call, answer.raw))
        assert call.usage is not None
        return self.render_whole(call, answer, call.usage)

    def opening(self, call: Call, first: Chunk) -> bytes:
        self.relaying = first.raw is not None
        return b""

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        if self.relaying:
            return self._relay(call, chunk)
        return self.render_chunk(call, chunk)

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
        out = [] if self.relaying else self.close_choices(call)
        if call.request.include_usage and not self.usage_sent:
            out.append(self.usage_event(call, UsageOut.of(call.billed())))
        out.append(SSE_DONE)
        return b"".join(out)

    def error(self, call: Call, error: OpenAIError) -> bytes:
        return b"data: " + encode(error.body()) + b"\n\n"
