"""One request as the scheduler sees it: its tokens, its progress and its block table."""

from __future__ import annotations

import time
from collections.abc import Iterable
from enum import Enum, auto
from typing import Protocol


class AdapterKey(Protocol):
    """What the scheduler needs of a request's LoRA adapter (``sluicegate.engine.lora``): an
    identity (compared by ``is``) and the seed of its prefix-cache hash chain."""

    @property
    def hash_seed(self) -> int: ...


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class StoppingParams(Protocol):
    """The part of ``SamplingParams`` the scheduler needs to decide when a request ends."""

    max_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int] | None


class Sequence:
    """A request's token ids (prompt then outputs) and how much of them is in the KV cache.

    ``num_computed_tokens`` counts the leading tokens whose K/V sit in the blocks of
    ``block_table``; the remaining tokens are what the next steps must compute. A preempted
    sequence keeps ``token_ids`` (outputs included) and restarts from zero computed tokens,
    so recomputation reproduces exactly the state it lost.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        params: StoppingParams,
        eos_token_ids: Iterable[int] = (),
        arrival_time: float | None = None,
        output_token_ids: Iterable[int] = (),
        priority: int = 0,
        lora: AdapterKey | None = None,
    ) -> None:
        self.request_id = request_id
        self.priority = priority
        """Lower runs first: the scheduler's order of admission and (reversed) of preemption."""
        # The LoRA adapter this request runs (None: the base model). Its blocks hash from
        # the adapter's seed, so no prefix is shared across adapters.
        self.lora = lora
        self.hash_seed: int | None = lora.hash_seed if lora is not None else None
        self.token_ids: list[int] = list(prompt_token_ids)
        if not self.token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        self.num_prompt_tokens = len(self.token_ids)
        # Outputs an earlier attempt produced (a resumed request): computed like a preempted
        # sequence's, and counted as outputs for max_tokens, penalties and seeded positions.
        self.token_ids.extend(output_token_ids)
        self.params = params
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.stop_token_ids: set[int] = set(params.stop_token_ids or ())
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # Monotonic times of the first admission and first output token, and how often the
        # sequence lost its blocks: what a request's queue/prefill/decode spans are made of.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.num_preemptions = 0
        # The persistent batch row the scheduler gave this sequence while it runs (-1: none)
        # and that row's generation then (sluicegate.engine.runner.input_batch keys per-row state by both).
        self.batch_row = -1
        self.batch_generation = 0
        self.block_table: list[int] = []
        # Chained hashes of the leading full blocks of block_table already known to the
        # prefix cache, so each block is hashed once however long the sequence grows.
        self.block_hashes: list[int] = []

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
