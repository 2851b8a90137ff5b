"""What one ``Scheduler.schedule()`` call decides: the sequences a step computes and how far,
the sequences it preempted, and the same as int64 columns for the step's input preparation."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sluicegate.engine.core.sequence import Sequence


@dataclass
class ScheduledSequence:
    """This step computes positions ``[start, start + num_new_tokens)`` of ``seq.token_ids``."""

    seq: Sequence
    num_new_tokens: int
    # How many of those tokens are draft tokens to verify (the last ones; speculative
    # decoding): the step then needs logits at each of the last num_drafts + 1 positions.
    num_drafts: int = 0
    start: int = field(init=False)
    # True when the step reaches the sequence's last token, so its logits give the next token.
    samples: bool = field(init=False)
    # Where the token this step samples goes in ``seq.token_ids`` (set by ``advance``).
    token_index: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class ScheduledArrays:
    """The scheduled items as int64 columns, built in the scheduler's own pass, so the step's
    input preparation reads no sequence objects: each request's batch row and its
    generation (new whenever the row gets a new occupant), first position computed, tokens
    computed, blocks held and tokens known."""

    rows: np.ndarray
    generations: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    table_lens: np.ndarray
    num_tokens: np.ndarray


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    arrays: ScheduledArrays | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
