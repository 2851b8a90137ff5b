"""The sampler's per-request settings table: each request it serves has a slot, its
sampling settings stored as entries of host arrays, so a step gathers a column per setting
instead of reading objects per row. Also the seed of a request's further choices."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sluicegate.engine.sample.params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


class SampledSequence(Protocol):
    """What the sampler reads from a sequence (``sluicegate.engine.core.sequence.Sequence`` satisfies it)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int


def derived_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed`` (choice 0 keeps it)."""
    return seed if index == 0 else (seed + index * _SEED_MIX) & _SEED_MASK


@dataclass(frozen=True)
class BatchRows:
    """Where a step's sampling sequences sit in the persistent batch: their rows, the rows'
    generations (new when a row gets a new occupant) and the index in each sequence's
    tokens of the token being sampled. The sampler keys its per-request state by row, so a
    step needs no pass over its sequences: only rows with a new generation are read."""

    rows: np.ndarray
    generations: np.ndarray
    positions: np.ndarray


class SlotParams:
    """Each request the sampler serves gets a slot: its sampling settings as entries of host
    arrays, so a step gathers a column per setting instead of reading objects per row.
    Slots ``[0, reserved)`` are the persistent batch's rows (``BatchRows``); sequences given
    without a row (forked choices' first draw, direct callers) get slots above, keyed by
    identity and freed once their sequence has finished."""

    _FIELDS = (
        ("temperature", np.float32), ("top_k", np.int64), ("top_p", np.float32),
        ("min_p", np.float32), ("seed", np.int64), ("seeded", bool), ("greedy", bool),
        ("presence", np.float32), ("frequency", np.float32), ("repetition", np.float32),
        ("penalized", bool), ("logprobs", np.int64), ("biased", bool),
        ("prompt", np.int64), ("generation", np.int64),
    )  # fmt: skip

    def __init__(self, vocab: int, reserved: int = 0, capacity: int = 64) -> None:
        self.vocab = vocab
        capacity += reserved
        self.columns = {name: np.zeros(capacity, dtype) for name, dtype in self._FIELDS}
        self.bias: dict[int, tuple[list[int], list[float]]] = {}
        self.seqs: dict[int, tuple[SampledSequence, int]] = {}
        self.free: list[int] = list(range(capacity - 1, reserved - 1, -1))
        # Each penalized request's row of the penalty counts (-1: none); rows of requests
        # whose slot got a new occupant are handed back through ``released``.
        self.penalty_row = np.full(capacity, -1, dtype=np.int64)
        self.released: list[int] = []

    @property
    def capacity(self) -> int:
        return len(self.columns["temperature"])

    def slot_for(self, seq: SampledSequence, step: SequenceOf[SampledSequence]) -> tuple[int, bool]:
        """The sequence's slot, and whether it was new (``step``: this step's sequences,
        whose slots are never reclaimed under them)."""
        entry = self.seqs.get(id(seq))
        if entry is not None and entry[0] is seq:
            return entry[1], False
        if not self.free:
            # Reclaimed only when needed, not every step: a pass over every slot.
            self.release_finished({id(s) for s in step})
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.seqs[id(seq)] = (seq, slot)
        self.load(slot, seq)
        return slot, True

    def load(self, slot: int, seq: SampledSequence) -> None:
        """Write ``seq``'s settings into ``slot``."""
        p, c = seq.params, self.columns
        if self.penalty_row[slot] >= 0:
            self.released.append(int(self.penalty_row[slot]))
            self.penalty_row[slot] = -1
        c["prompt"][slot] = seq.num_prompt_tokens
        c["temperature"][slot] = 1.0 if p.greedy else p.temperature
        c["top_k"][slot] = p.top_k if p.top_k > 0 else self.vocab
        c["top_p"][slot], c["min_p"][slot] = p.top_p, p.min_p
        c["seed"][slot] = (p.seed & _SEED_MASK) if p.seed is not None else 0
        c["seeded"][slot], c["greedy"][slot] = p.seed is not None, p.greedy
        c["presence"][slot], c["frequency"][slot] = p.presence_penalty, p.frequency_penalty
        c["repetition"][slot], c["penalized"][slot] = p.repetition_penalty, p.has_penalties
        c["logprobs"][slot] = -1 if p.logprobs is None else p.logprobs
        c["biased"][slot] = bool(p.logit_bias)
        self.bias.pop(slot, None)
        if p.logit_bias:
            self.bias[slot] = (list(p.logit_bias), list(p.logit_bias.values()))

    def release_finished(self, keep: set[int]) -> None:
        """Free the slots of finished sequences not in the current step."""
        for key in self.seqs.keys() - keep:
            seq, slot = self.seqs[key]
            if getattr(seq, "is_finished", False):
                del self.seqs[key]
                self.free.append(slot)

    def _grow(self) -> None:
        old = self.capacity
        for name, column in self.columns.items():
            self.columns[name] = np.concatenate([column, np.zeros_like(column)])
        self.penalty_row = np.concatenate([self.penalty_row, np.full(old, -1, dtype=np.int64)])
        self.free.extend(range(2 * old - 1, old - 1, -1))
