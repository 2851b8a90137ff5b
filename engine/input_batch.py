"""The persistent batch: each running request owns a row of preallocated token-id and
block-table buffers, updated by diffs as requests join, grow and leave, so a step's inputs
are assembled by a few vectorised gathers instead of being rebuilt from Python lists.

A step reads the scheduler's output once into flat arrays (row, start, count per scheduled
request); everything else — input ids, positions, slot mapping, sequence lengths, query
offsets, the rows that sample, and block tables as wide as this batch needs — comes from
numpy indexing over the rows. Only requests whose state moved beyond what the rows already
hold (a new admission, a prefill chunk, a table that grew) are copied in, and only the new
part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.block_manager import blocks_for
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


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
        self._row_of: dict[str, int] = {}
        self._seq_of: list[Sequence | None] = [None] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))
        self._generation = np.zeros(max_num_seqs, dtype=np.int64)
        # Per row: the row of the in-flight step's sampled tokens holding its token at
        # _pending_position (-1: none pending).
        self._pending_source = np.full(max_num_seqs, -1, dtype=np.int64)
        self._pending_position = np.zeros(max_num_seqs, dtype=np.int64)
        self._pending_step: StepArrays | None = None

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    # -- membership -------------------------------------------------------------------------

    def _row_for(self, seq: Sequence) -> int:
        row = self._row_of.get(seq.request_id)
        if row is not None and self._seq_of[row] is seq:
            return row
        # New, or a new request reusing a departed one's id.
        self.remove(seq.request_id)
        return self._add(seq)

    def _add(self, seq: Sequence) -> int:
        row = self._free_rows.pop()
        self._row_of[seq.request_id] = row
        self._seq_of[row] = seq
        self.num_tokens[row] = 0
        self.num_blocks[row] = 0
        self._generation[row] += 1
        self._pending_source[row] = -1
        return row

    def remove(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._seq_of[row] = None
            self._free_rows.append(row)

    def _evict_departed(self, output: SchedulerOutput, scheduled_ids: set[str]) -> None:
        """Free the rows of requests that left: preempted ones (their blocks are gone) and any
        request that is no longer running (finished, aborted, stopped by a stop string)."""
        for seq in output.preempted:
            self.remove(seq.request_id)
        for request_id in self._row_of.keys() - scheduled_ids:
            seq = self._seq_of[self._row_of[request_id]]
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                self.remove(request_id)

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

    def prepare(self, output: SchedulerOutput) -> StepArrays:
        scheduled = output.scheduled
        self._evict_departed(output, {item.seq.request_id for item in scheduled})
        seqs = [item.seq for item in scheduled]
        # The one pass over the scheduler's output: everything after it is array maths.
        info = np.array(
            [
                (self._row_for(item.seq), item.start, item.num_new_tokens,
                 len(item.seq.block_table), item.seq.num_tokens)
                for item in scheduled
            ],
            dtype=np.int64,
        ).reshape(-1, 5)  # fmt: skip
        rows, starts, counts, table_lens, num_tokens = info.T
        ends = starts + counts
        self._sync_tokens(seqs, rows, ends)
        self._sync_tables(seqs, rows, table_lens)

        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        total = int(cu[-1])
        token_rows = np.repeat(rows, counts)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - starts, counts)
        block_index = positions // self.block_size
        slots = (
            self.block_table[token_rows, block_index].astype(np.int64) * self.block_size
            + positions % self.block_size
        )
        width = int((ends.max() + self.block_size - 1) // self.block_size) if len(seqs) else 1
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

    def _sync_tokens(self, seqs: list[Sequence], rows: np.ndarray, ends: np.ndarray) -> None:
        """Copy in the tokens a row lacks up to this step's end (a join or a prefill chunk;
        decode tokens arrive through ``record_sampled``)."""
        behind = np.flatnonzero(self.num_tokens[rows] < ends)
        for i in behind:
            seq, row = seqs[i], int(rows[i])
            have, want = int(self.num_tokens[row]), int(ends[i])
            self.token_ids[row, have:want] = seq.token_ids[have:want]
            self.num_tokens[row] = want

    def _sync_tables(self, seqs: list[Sequence], rows: np.ndarray, table_lens: np.ndarray) -> None:
        """Append the blocks a request gained since the last step (tables only grow while a
        request runs; preemption frees its row)."""
        grew = np.flatnonzero(self.num_blocks[rows] != table_lens)
        for i in grew:
            seq, row = seqs[i], int(rows[i])
            have, want = int(self.num_blocks[row]), int(table_lens[i])
            if want < have:
                have = 0
            self.block_table[row, have:want] = seq.block_table[have:want]
            self.num_blocks[row] = want
