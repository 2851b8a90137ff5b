"""``ResponseBuilder``: a provider's stream of chunks folded into the whole answer (for a client
that did not ask to stream from a provider that streams, and for tests); ``collect`` folds one."""

from __future__ import annotations

from typing import Any

from sluicegate.gateway.canonical import (
    ChatRequest,
    Choice,
    ChoiceDelta,
    Chunk,
    FinishReason,
    Message,
    Part,
    ReasoningPiece,
    Response,
    TextPart,
    TokenLogprob,
    ToolCall,
    Usage,
)
from sluicegate.gateway.providers.base import Provider


class ResponseBuilder:
    """Folds a stream of chunks into the whole ``Response`` (tool-call fragments joined)."""

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._reasoning: dict[int, list[str]] = {}
        self._refusal: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, list[str]]] = {}
        self._call_heads: dict[int, dict[int, tuple[str, str]]] = {}
        self._logprobs: dict[int, list[TokenLogprob]] = {}
        self._finish: dict[int, FinishReason] = {}
        self._stop_sequence: dict[int, str] = {}
        self._pieces: dict[int, list[ReasoningPiece]] = {}
        self._open_piece: dict[int, list[str]] = {}
        """The text so far of a choice's last piece, while it takes more (no signature yet)."""
        self.usage: Usage | None = None
        self.num_tokens = 0

    def add(self, chunk: Chunk) -> None:
        self.num_tokens += chunk.num_tokens
        if chunk.usage is not None:
            self.usage = chunk.usage
        for delta in chunk.choices:
            i = delta.index
            self._text.setdefault(i, [])
            if delta.text:
                self._text[i].append(delta.text)
            if delta.reasoning or delta.reasoning_signature or delta.reasoning_redacted:
                self._add_reasoning(i, delta)
            if delta.refusal:
                self._refusal.setdefault(i, []).append(delta.refusal)
            for call in delta.tool_calls or ():
                heads = self._call_heads.setdefault(i, {})
                if call.id is not None or call.index not in heads:
                    heads[call.index] = (call.id or "", call.name or "")
                self._calls.setdefault(i, {}).setdefault(call.index, []).append(call.arguments)
            if delta.logprobs:
                self._logprobs.setdefault(i, []).extend(delta.logprobs)
            if delta.finish_reason is not None:
                self._finish[i] = delta.finish_reason
            if delta.stop_sequence is not None:
                self._stop_sequence[i] = delta.stop_sequence

    def _add_reasoning(self, i: int, delta: ChoiceDelta) -> None:
        pieces = self._pieces.setdefault(i, [])
        # Where the piece stands among the parts built below: the joined text, then the calls.
        calls = len(self._call_heads.get(i, ()))
        at = 1 + calls if calls or self._text[i] else 0
        if delta.reasoning:
            self._reasoning.setdefault(i, []).append(delta.reasoning)
            if i not in self._open_piece:
                pieces.append(ReasoningPiece(at=at))
                self._open_piece[i] = []
            self._open_piece[i].append(delta.reasoning)
        if delta.reasoning_signature:
            if i not in self._open_piece:  # a block whose text was left out (display omitted)
                pieces.append(ReasoningPiece(at=at))
            self._close_piece(i)
            pieces[-1].signature = delta.reasoning_signature
        if delta.reasoning_redacted:
            self._close_piece(i)
            pieces.append(ReasoningPiece(redacted=delta.reasoning_redacted, at=at))

    def _close_piece(self, i: int) -> None:
        fragments = self._open_piece.pop(i, None)
        if fragments is not None:
            self._pieces[i][-1].text = "".join(fragments)

    def build(self, raw: dict[str, Any] | None = None) -> Response:
        choices = []
        for i in list(self._open_piece):
            self._close_piece(i)
        for i in sorted(self._text):
            parts: list[Part] = [TextPart("".join(self._text[i]))]
            heads = self._call_heads.get(i, {})
            for k in sorted(heads):
                call_id, name = heads[k]
                parts.append(ToolCall(call_id, name, "".join(self._calls[i][k])))
            reasoning = "".join(self._reasoning[i]) if i in self._reasoning else None
            refusal = "".join(self._refusal[i]) if i in self._refusal else None
            choices.append(
                Choice(
                    index=i,
                    message=Message(
                        "assistant",
                        parts,
                        reasoning=reasoning,
                        reasoning_pieces=self._pieces.get(i),
                    ),
                    finish_reason=self._finish.get(i, "stop"),
                    refusal=refusal,
                    logprobs=self._logprobs.get(i),
                    stop_sequence=self._stop_sequence.get(i),
                )
            )
        return Response(choices, usage=self.usage, num_tokens=self.num_tokens, raw=raw)


async def collect(provider: Provider, request: ChatRequest) -> Response:
    """Fold a provider's stream into one response."""
    builder = ResponseBuilder()
    chunks = provider.generate(request)
    try:
        async for chunk in chunks:
            builder.add(chunk)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    return builder.build()
