"""Per-sequence grammar matchers and the one batched token bitmask of a step.

Only rows whose sequence has an active matcher are filled and masked; a step without any
pays nothing (no bitmask, not even the xgrammar import).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GrammarGuide:
    """One sequence's matcher. ``active`` is False while a thinking model is still reasoning:
    the grammar governs the answer only. ``thinking_token`` (a thinking model whose output may
    open with ``<think>``) is allowed as the first token besides what the grammar allows."""

    def __init__(
        self, compiled: Any, active: bool = True, thinking_token: int | None = None
    ) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.active = active
        self.thinking_token = thinking_token if active else None

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar refuses it."""
        if self.thinking_token is not None:
            opened_thinking = token_id == self.thinking_token
            self.thinking_token = None
            if opened_thinking:
                self.active = False  # back on once the answer begins
                return True
        if not self.active:
            return True
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return self.active and self.matcher.is_terminated()


class TokenBitmask:
    """A reusable bitmask for up to ``max_rows`` rows, filled and applied once per step."""

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self._bitmask: torch.Tensor | None = None
        self._batch_matcher: Any = None

    def apply(self, logits: torch.Tensor, guides: list[GrammarGuide | None]) -> None:
        """Mask (to -inf) every token each guided row's grammar forbids, in place."""
        rows = [row for row, guide in enumerate(guides) if guide is not None and guide.active]
        if not rows:
            return
        import xgrammar

        if self._bitmask is None or self._bitmask.shape[0] < len(guides):
            size = max(self.max_rows, len(guides))
            self._bitmask = xgrammar.allocate_token_bitmask(size, self.vocab_size)
            self._batch_matcher = xgrammar.BatchGrammarMatcher()
        bitmask = self._bitmask[: len(guides)]
        matchers = [guides[row].matcher for row in rows]  # type: ignore[union-attr]
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        for row in rows:
            token = guides[row].thinking_token  # type: ignore[union-attr]
            if token is not None:
                word, bit = divmod(token, 32)
                bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgrammar.apply_token_bitmask_inplace(
            logits, bitmask, vocab_size=self.vocab_size, indices=rows
        )

    def apply_to_drafts(
        self, logits: torch.Tensor, chains: list[tuple[int, GrammarGuide, list[int]]]
    ) -> None:
        """Mask the rows a speculative step verifies, in place. Each chain is a guided
        sequence's first row, its guide and its draft tokens: row ``first + j`` gets the mask
        of the grammar's state after the first ``j`` drafts (so a draft the grammar refuses is
        rejected where it stands, and the token after the last draft obeys the grammar as if
        every draft were accepted). The guides end where they began."""
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(logits.shape[0], self.vocab_size)
        indices: list[int] = []
        for first, guide, drafts in chains:
            matcher = guide.matcher
            accepted = 0
            refused = False
            for position in range(len(drafts) + 1):
                # Past a refused draft the chain stops; its rows keep the refusing state's mask.
                # Past an accepted stop token the output ends: its rows are never read.
                if matcher.is_terminated():
                    bitmask[first + position] = bitmask[first + position - 1]
                else:
                    matcher.fill_next_token_bitmask(bitmask, first + position)
                indices.append(first + position)
                if position < len(drafts) and not refused:
                    refused = not matcher.accept_token(drafts[position])
                    accepted += not refused
            if accepted:
                matcher.rollback(accepted)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        with torch.inference_mode():
            xgrammar.apply_token_bitmask_inplace(
                logits, bitmask, vocab_size=self.vocab_size, indices=indices
            )
