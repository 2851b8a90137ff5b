"""The persistent batch: each running request owns a row of preallocated token-id and
block-table buffers, updated by diffs as requests join, grow and leave, so a step's inputs
are assembled by a few vectorised gathers instead of being rebuilt from Python lists.

The scheduler assigns the rows (a running sequence keeps its row until it leaves; a row's
generation counts its occupants) and hands each step over as columns (row, generation,
start, count, blocks, tokens per scheduled request: ``ScheduledArrays``), so preparing a
step reads no sequence objects: input ids, positions, slot mapping, sequence lengths, query
offsets, the rows that sample, and block tables as wide as this batch needs all come from
numpy indexing over the rows. Only requests whose state moved beyond what the rows already
hold (a new occupant, a prefill chunk, a table that grew) are read, and only the new part.
Decode inputs are never read from sequences: a step's sampled tokens are written into
their rows (on the device first, ``mark_pending``, for async scheduling; on the host when
read back, ``record_sampled``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.core.scheduler_output import ScheduledSequence, SchedulerOutput


@dataclass
class StepArrays:
    """One step's inputs as int32 host arrays (views into the batch's staging buffers)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    cu_seqlens_q: np.ndarray
    sample_rows: np.ndarray
    block_tables: np.ndarray
    # The batch rows of the scheduled requests that sample, in scheduled order, where
    # their sampled tokens go, and the rows' generations (a row reused by another request
    # since has a new one).
    sampling_batch_rows: np.ndarray
    sampling_positions: np.ndarray
    sampling_generations: np.ndarray
    decode_only: bool
    # How many leading scheduled requests compute one token (the scheduler puts running
    # decodes first): the attention kernel's decode launch.
    num_decodes: int
    # Input tokens not known on the host yet (sampled by the step still on the device):
    # their places in ``input_ids`` and their rows in that step's sampled-token tensor.
    pending_index: np.ndarray
    pending_source: np.ndarray


_EMPTY = np.zeros(0, dtype=np.int64)


class InputBatch:
    def __init__(
        self, max_num_seqs: int, max_model_len: int, block_size: int, max_num_batched_tokens: int
    ) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_blocks = blocks_for(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)
        self._generation = np.zeros(max_num_seqs, dtype=np.int64)
        # Per row: the row of the in-flight step's sampled tokens holding its token at
        # _pending_position (-1: none pending).
        self._pending_source = np.full(max_num_seqs, -1, dtype=np.int64)
        self._pending_position = np.zeros(max_num_seqs, dtype=np.int64)
        self._pending_step: StepArrays | None = None

    # -- membership -------------------------------------------------------------------------

    def _admit_rows(self, rows: np.ndarray, generations: np.ndarray) -> None:
        """Rows with a new occupant (the scheduler assigns rows and counts their
        generations) start empty; whatever the previous occupant left is never read."""
        new = self._generation[rows] != generations
        if new.any():
            joined = rows[new]
            self._generation[joined] = generations[new]
            self.num_tokens[joined] = 0
            self.num_blocks[joined] = 0
            self._pending_source[joined] = -1

    # -- one step ---------------------------------------------------------------------------

    def mark_pending(self, step: StepArrays) -> None:
        """``step`` was launched: its sampled tokens (still on the device, row i of its
        sampled-token tensor for its i-th sampling row) are the rows' next inputs."""
        self._pending_source[:] = -1
        self._pending_step = step
        rows, positions = step.sampling_batch_rows, step.sampling_positions
        if not len(rows):
            return
        ok = positions < self.token_ids.shape[1]
        self._pending_source[rows[ok]] = np.flatnonzero(ok)
        self._pending_position[rows[ok]] = positions[ok]
        # Only a row whose tokens were complete up to the sampled position stays in step.
        in_step = self.num_tokens[rows] == positions
        self.num_tokens[rows[ok & in_step]] += 1

    def record_sampled(self, step: StepArrays, token_ids: list[int]) -> None:
        """Write ``step``'s sampled tokens, now on the host, into rows still held by the
        requests that sampled them (rows past the step's own, forked choices', are new
        rows later). Tokens of requests that left meanwhile are never read."""
        if step is self._pending_step:
            self._pending_source[:] = -1
            self._pending_step = None
        rows, positions = step.sampling_batch_rows, step.sampling_positions
        if not len(rows):
            return
        tokens = np.asarray(token_ids[: len(rows)], dtype=np.int32)
        ok = (positions < self.token_ids.shape[1]) & (
            self._generation[rows] == step.sampling_generations
        )
        self.token_ids[rows[ok], positions[ok]] = tokens[ok]

    def rollback(self, row: int, generation: int, num_tokens: int, num_blocks: int) -> None:
        """Forget a row's tokens and blocks past ``num_tokens`` and ``num_blocks`` (draft
        tokens rejected, their blocks freed): a freed block's place may hold another block
        when the table grows again, so the next step copies it in afresh."""
        if self._generation[row] == generation:
            self.num_tokens[row] = min(int(self.num_tokens[row]), num_tokens)
            self.num_blocks[row] = min(int(self.num_blocks[row]), num_blocks)

    def prepare(self, output: SchedulerOutput) -> StepArrays:
        arrays = output.arrays
        assert arrays is not None, "a SchedulerOutput from Scheduler.schedule"
        rows, starts, counts = arrays.rows, arrays.starts, arrays.counts
        num_tokens = arrays.num_tokens
        self._admit_rows(rows, arrays.generations)
        ends = starts + counts
        items = output.scheduled
        self._sync_tokens(items, rows, ends)
        self._sync_tables(items, rows, arrays.table_lens)

        cu = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])
        token_rows = np.repeat(rows, counts)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, counts)
        block_index = positions // self.block_size
        slots = (
            self.block_table[token_rows, block_index].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        width = int((ends.max() + self.block_size - 1) // self.block_size) if len(items) else 1
        samples = ends == num_tokens
        decode_only = bool((counts == 1).all())
        input_ids = self.token_ids[token_rows, positions]
        pending_index = pending_source = _EMPTY
        if self._pending_step is not None:
            source = self._pending_source[token_rows]
            pending = (source >= 0) & (self._pending_position[token_rows] == positions)
            if pending.any():
                pending_index = np.flatnonzero(pending)
                pending_source = source[pending_index]
        return StepArrays(
            input_ids=input_ids,
            positions=positions.astype(np.int32),
            slot_mapping=slots.astype(np.int32),
            seq_lens=ends.astype(np.int32),
            cu_seqlens_q=cu.astype(np.int32),
            sample_rows=(cu[1:][samples] - 1).astype(np.int32),
            block_tables=self.block_table[rows, :width],
            sampling_batch_rows=rows[samples],
            sampling_positions=ends[samples],
            sampling_generations=self._generation[rows[samples]],
            decode_only=decode_only,
            num_decodes=len(counts) if decode_only else int(np.argmax(counts != 1)),
            pending_index=pending_index,
            pending_source=pending_source,
        )

    def _sync_tokens(
        self, items: list[ScheduledSequence], rows: np.ndarray, ends: np.ndarray
    ) -> None:
        """Copy in the tokens a row lacks up to this step's end (a join or a prefill chunk;
        decode tokens arrive through ``mark_pending`` and ``record_sampled``)."""
        behind = np.flatnonzero(self.num_tokens[rows] < ends)
        for i in behind:
            seq, row = items[i].seq, int(rows[i])
            have, want = int(self.num_tokens[row]), int(ends[i])
            self.token_ids[row, have:want] = seq.token_ids[have:want]
            self.num_tokens[row] = want

    def _sync_tables(
        self, items: list[ScheduledSequence], rows: np.ndarray, table_lens: np.ndarray
    ) -> None:
        """Append the blocks a request gained since the last step (tables only grow while a
        request runs; preemption frees its row)."""
        grew = np.flatnonzero(self.num_blocks[rows] != table_lens)
        for i in grew:
            seq, row = items[i].seq, int(rows[i])
            have, want = int(self.num_blocks[row]), int(table_lens[i])
            if want < have:
                have = 0
            self.block_table[row, have:want] = seq.block_table[have:want]
            self.num_blocks[row] = want
