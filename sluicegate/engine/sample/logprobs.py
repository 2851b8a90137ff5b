"""Logprob entries as the wire carries them: each token's text and exact bytes."""

from __future__ import annotations

from sluicegate.engine import protocol
from sluicegate.engine.sample.output import TokenLogprobs
from sluicegate.engine.text.tokenizer import Tokenizer


def wire_logprobs(
    entries: list[TokenLogprobs], tokenizer: Tokenizer
) -> list[protocol.TokenLogprob]:
    def top_entry(token_id: int, logprob: float) -> protocol.TopLogprob:
        raw = tokenizer.token_bytes(token_id)
        return protocol.TopLogprob(raw.decode("utf-8", errors="replace"), logprob, list(raw))

    wire = []
    for entry in entries:
        raw = tokenizer.token_bytes(entry.token_id)
        top = [top_entry(token_id, logprob) for token_id, logprob in entry.top]
        text = raw.decode("utf-8", errors="replace")
        wire.append(protocol.TokenLogprob(text, entry.logprob, list(raw), top))
    return wire
