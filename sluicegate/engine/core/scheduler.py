"""Continuous batching: every step re-forms the batch from one token budget.

Each ``schedule()`` call hands out ``max_num_batched_tokens`` tokens:

1. decodes of running sequences (one token each), oldest admission first;
2. the next chunk of the running sequence still prefilling, if any (a long prompt, or a
   recompute after preemption);
3. new admissions from the FCFS waiting queue, each with a chunk as large as the remaining
   budget allows, while blocks and ``max_num_seqs`` allow.

When a running sequence needs blocks that are not free, the most recently admitted running
sequence is preempted: its blocks are freed and it goes back to the front of the waiting
queue, keeping its generated tokens, to be recomputed later. Older sequences therefore always
progress, and a sequence that fits in the cache on its own (checked by :meth:`Scheduler.add`)
always finishes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from sluicegate.engine.core.block_manager import BlockManager, blocks_for
from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler_output import (
    ScheduledArrays,
    ScheduledSequence,
    SchedulerOutput,
)
from sluicegate.engine.core.scheduler_stats import scheduler_stats
from sluicegate.engine.core.sequence import Sequence, SequenceStatus
from sluicegate.engine.core.waiting_queue import WaitingQueue

# Stands in ``Sequence.token_ids`` for a token sampled by a step still running on the device
# (between ``Scheduler.advance`` and ``Scheduler.record``).
PLACEHOLDER = -1


class RequestRejected(ValueError):
    """The request can never run here (too long for the model or the cache) or no room to queue."""


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(
            config.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.waiting = WaitingQueue(config.block_size)
        # Admission order, oldest first: the preemption victim is always the last one.
        self.running: list[Sequence] = []
        self._live: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.peak_kv_utilization = 0.0
        # Each running sequence holds one row of the persistent batch (sluicegate.engine.runner.input_batch)
        # from admission until it leaves running; a row's generation counts its occupants.
        self._free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self._row_generation = [0] * config.max_num_seqs

    # -- intake -----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queue a request, or raise :class:`RequestRejected` if it could never complete."""
        config = self.config
        max_tokens = seq.params.max_tokens
        if max_tokens < 1:
            raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}")
        total = seq.num_prompt_tokens + max_tokens
        if total > config.max_model_len:
            raise RequestRejected(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{total} exceeds the model's maximum context length of "
                f"{config.max_model_len} tokens"
            )
        # The final sampled token is never fed back, so the cache holds at most total - 1.
        needed = blocks_for(total - 1, config.block_size)
        if needed > config.num_kv_blocks:
            raise RequestRejected(
                f"prompt + max_tokens needs {needed} KV blocks of {config.block_size} tokens "
                f"but the whole cache has {config.num_kv_blocks}; it could never run"
            )
        if seq.request_id in self._live:
            raise RequestRejected(f"request id {seq.request_id!r} is already in flight")
        if not self.can_accept():
            raise RequestRejected(f"waiting queue is full ({config.max_waiting} requests)")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._live[seq.request_id] = seq

    def can_accept(self) -> bool:
        """Whether the waiting queue has room (a worker pulls new work only while it does)."""
        limit = self.config.max_waiting
        return limit is None or len(self.waiting) < limit

    # -- one step ---------------------------------------------------------------------------

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """``drafts``: proposed next tokens by request id (speculative decoding), verified
        in this step by sequences in decode where the budget and free blocks allow: they
        are appended to the sequence's tokens until ``accept_drafts`` keeps the accepted."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        yielded = self._yield_to_urgent()
        preempted: list[Sequence] = []
        columns: list[tuple[int, int, int, int, int, int]] = []

        # Running sequences in admission order. A chunk stops short only when it spends the
        # whole budget, so nothing is admitted behind a sequence still prefilling: at most one
        # running sequence is mid-prefill and it is the last one. This order therefore serves
        # every decode before the prefill chunk, and every preemption victim (the last one) is
        # a sequence not yet scheduled in this step.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            draft = drafts.get(seq.request_id) if drafts else None
            if draft:
                # Drafts give way first: to the budget, and to free blocks before any
                # preemption, so speculation never evicts another sequence.
                if (
                    num_new == 1
                    and len(draft) < budget
                    and self.block_manager.can_append_slots(seq, 1 + len(draft))
                ):
                    seq.token_ids.extend(draft)
                    num_new += len(draft)
                else:
                    draft = None
            while not self.block_manager.can_append_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq was the youngest itself: nobody is left behind it
            self.block_manager.append_slots(seq, num_new)
            scheduled.append(ScheduledSequence(seq, num_new, len(draft) if draft else 0))
            columns.append((seq.batch_row, seq.batch_generation, seq.num_computed_tokens,
                            num_new, len(seq.block_table), seq.num_tokens))  # fmt: skip
            budget -= num_new
            index += 1

        # A preemption means blocks ran out: admitting now would only be preempted in turn.
        if not preempted:
            self._admit(budget, scheduled, columns)
        arrays = ScheduledArrays(*np.array(columns, dtype=np.int64).reshape(-1, 6).T)
        return SchedulerOutput(scheduled, yielded + preempted, arrays)

    def _yield_to_urgent(self) -> list[Sequence]:
        """Preempt less urgent running sequences (``running`` ends with the least urgent, the
        youngest last) while the most urgent waiting one has no batch row, or no KV blocks
        for its first chunk: a batch request gives way to an interactive one at once."""
        victims: list[Sequence] = []
        manager, config = self.block_manager, self.config
        while self.waiting and self.running:
            head = self.waiting[0]
            if self.running[-1].priority <= head.priority:
                break
            if len(self.running) < config.max_num_seqs:
                cached = manager.match_prefix(head)
                tokens = len(cached) * config.block_size
                first = min(head.num_tokens - tokens, config.max_num_batched_tokens)
                if manager.can_allocate(cached, tokens + first):
                    break
            victim = self.running[-1]
            self._preempt(victim)
            victims.append(victim)
        return victims

    def _admit(
        self,
        budget: int,
        scheduled: list[ScheduledSequence],
        columns: list[tuple[int, int, int, int, int, int]],
    ) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora is not None and not self._lora_fits(seq):
                break  # strict FCFS: it waits for a running adapter to finish
            cached = manager.match_prefix(seq)
            num_cached_tokens = len(cached) * self.config.block_size
            num_new = min(seq.num_tokens - num_cached_tokens, budget)
            if not manager.can_allocate(cached, num_cached_tokens + num_new):
                break  # strict FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            manager.allocate(seq, cached, num_cached_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self._run(seq)
            self._take_row(seq)
            scheduled.append(ScheduledSequence(seq, num_new))
            columns.append((seq.batch_row, seq.batch_generation, seq.num_computed_tokens,
                            num_new, len(seq.block_table), seq.num_tokens))  # fmt: skip
            budget -= num_new

    def _run(self, seq: Sequence) -> None:
        """Into ``running`` behind every sequence of its priority or a lower one, so the
        last is always the least urgent and youngest: the next to preempt."""
        running = self.running
        if not running or running[-1].priority <= seq.priority:
            running.append(seq)
        else:
            running.insert(next(i for i, s in enumerate(running) if s.priority > seq.priority), seq)

    def _lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter runs already or a slot is left for one more: every
        running sequence is in every step, so this keeps each step within ``max_loras``."""
        running = {id(s.lora): s.lora for s in self.running if s.lora is not None}
        return id(seq.lora) in running or len(running) < self.config.max_loras

    def _take_row(self, seq: Sequence) -> None:
        row = self._free_rows.pop()
        self._row_generation[row] += 1
        seq.batch_row, seq.batch_generation = row, self._row_generation[row]

    def _release_row(self, seq: Sequence) -> None:
        if seq.batch_row >= 0:
            self._free_rows.append(seq.batch_row)
            seq.batch_row = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.pop()
        self._release_row(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        # Victims go youngest first, so each older one lands in front of it: FCFS holds.
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1

    def fork(
        self, parent: Sequence, child: Sequence, num_new_tokens: int, offset: int
    ) -> list[tuple[int, int]] | None:
        """Start ``child`` (same prompt) from the KV state ``parent`` reaches in this step:
        full blocks shared, the partly filled last one copied. The child runs right behind
        the parent (``offset`` places siblings in order) and this step's sampling row of the
        parent is its too. Returns the (source, destination) block copies to make; None when
        no block (or no batch row: ``max_num_seqs`` are running) is free, and the child then
        waits to compute its prompt itself."""
        computed = parent.num_computed_tokens + num_new_tokens
        copies = self.block_manager.fork(parent, child, computed) if self._free_rows else None
        self._live[child.request_id] = child
        if copies is None:
            child.status = SequenceStatus.WAITING
            self.waiting.appendleft(child)
            return None
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        self.running.insert(self.running.index(parent) + offset, child)
        self._take_row(child)
        return copies

    # -- results ----------------------------------------------------------------------------

    def accept_drafts(self, item: ScheduledSequence, num_accepted: int) -> None:
        """Keep the first ``num_accepted`` of ``item``'s draft tokens and roll the rest back
        (before ``advance``): the sequence ends at them, the step counts as having computed
        up to them, and blocks that held only rejected drafts are freed."""
        seq = item.seq
        keep = item.start + 1 + num_accepted
        del seq.token_ids[keep:]
        item.num_new_tokens = 1 + num_accepted
        self.block_manager.trim(seq, keep)

    def postprocess(self, output: SchedulerOutput, sampled: list[int | None]) -> list[Sequence]:
        """Record a step's results; returns the sequences that finished in it.

        ``sampled`` has one entry per ``output.scheduled`` item: the token sampled for it, or
        None where the item does not sample (a prefill chunk short of the last token).
        Sequences aborted while the step ran are skipped: their blocks are already free.
        """
        if len(sampled) != len(output.scheduled):
            raise ValueError(f"{len(sampled)} samples for {len(output.scheduled)} sequences")
        for item, token in zip(output.scheduled, sampled, strict=True):
            if item.samples and token is None:
                raise ValueError(f"{item.seq.request_id} reached its last token but got no sample")
        finished = self.advance(output)
        tokens = [t for item, t in zip(output.scheduled, sampled, strict=True) if item.samples]
        return finished + [s for s in self.record(output, tokens) if s not in finished]

    def advance(self, output: SchedulerOutput) -> list[Sequence]:
        """The half of a step's bookkeeping that needs no sampled token, done as soon as the
        step is launched: computed tokens, prefix-cache entries, a placeholder for each
        token being sampled, and the sequences this token ends by length (finished now so
        the next step leaves them out; ``record`` turns the reason to "stop" if the token
        is a stop token). Async scheduling schedules the next step right after this."""
        finished: list[Sequence] = []
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
            if not item.samples:
                continue
            tokens = seq.token_ids
            item.token_index = len(tokens)
            tokens.append(PLACEHOLDER)
            if len(tokens) - seq.num_prompt_tokens >= seq.params.max_tokens:
                self._finish(seq, "length")
                finished.append(seq)
        if finished:
            self.running = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        self._record_utilization()
        return finished

    def record(self, output: SchedulerOutput, tokens: list[int]) -> list[Sequence]:
        """Put the sampled tokens (one per item that samples, in order; extra ones, such as
        forked choices' rows, are ignored) in place of their placeholders and end the
        sequences they stop; returns those sequences. A sequence preempted since
        ``advance`` (waiting again) gets its token too; one that finished otherwise
        meanwhile (aborted, a stop string) is skipped."""
        finished: list[Sequence] = []
        sampling = [item for item in output.scheduled if item.samples]
        if len(sampling) > len(tokens):
            raise ValueError(f"{len(tokens)} samples for {len(sampling)} sampling sequences")
        for item, token in zip(sampling, tokens, strict=False):
            seq = item.seq
            if item.token_index is None or (seq.is_finished and seq.finish_reason != "length"):
                continue
            seq.token_ids[item.token_index] = token
            if not self.stops(seq, token):
                continue
            if seq.is_finished:
                seq.finish_reason = "stop"  # EOS or a stop token wins over the length
            else:
                self.finish(seq, "stop")
                finished.append(seq)
        return finished

    @staticmethod
    def stops(seq: Sequence, token: int) -> bool:
        """Whether ``token`` ends ``seq`` (EOS unless ignored, or one of its stop tokens)."""
        return token in seq.stop_token_ids or (
            token in seq.eos_token_ids and not seq.params.ignore_eos
        )

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running or waiting sequence now (the engine's stop strings); idempotent."""
        if seq.is_finished:
            return
        self._finish(seq, reason)
        self._drop(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """End a request and free its blocks at once; None if it is not in flight."""
        seq = self._live.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        self._drop(seq)
        return seq

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release_row(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._live[seq.request_id]

    def _drop(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.running:
            self.running.remove(seq)

    # -- state ------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._live)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get(self, request_id: str) -> Sequence | None:
        return self._live.get(request_id)

    @property
    def kv_tokens_stored(self) -> int:
        """Tokens whose K/V is in the cache, a shared prefix block counted once."""
        computed = sum(seq.num_computed_tokens for seq in self.running)
        return computed - self.block_manager.num_shared_refs * self.config.block_size

    def _record_utilization(self) -> None:
        used = self.block_manager.num_used_blocks
        if used:
            utilization = self.kv_tokens_stored / (used * self.config.block_size)
            self.peak_kv_utilization = max(self.peak_kv_utilization, utilization)

    def stats(self) -> dict[str, Any]:
        """Engine-level counters; prefix-cache queries and hits are counted in tokens."""
        return scheduler_stats(self)
