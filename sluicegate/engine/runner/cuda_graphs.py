"""Decode steps replayed as CUDA graphs, one per padded batch size.

A decode-only step of ``n`` requests runs the graph captured for the smallest size ``>= n``
among 1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``. Every graph reads the same
persistent device buffers (one flat int32 allocation: input ids, positions, slot mapping,
sequence lengths, query offsets, full-width block tables), which a step fills with one
host-to-device copy from a pinned mirror; rows past ``n`` are padding whose KV writes are
skipped (slot -1) and whose outputs are dropped. The whole forward (compiled or eager) and
the LM head are captured; attention runs as ``sluicegate::paged_attention`` reading its
metadata from the step context, so capture records the persistent buffers' addresses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from sluicegate.engine.runner.attention import AttentionBackend, AttentionMetadata
from sluicegate.engine.runner.compilation import step_metadata
from sluicegate.engine.runner.input_batch import StepArrays
from sluicegate.engine.runner.staging import PinnedStaging

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 8))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        backend: AttentionBackend,
        device: torch.device,
        max_num_seqs: int,
        max_blocks: int,
    ) -> None:
        self.forward = forward
        self.compute_logits = compute_logits
        self.backend = backend
        self.device = device
        self.sizes = capture_sizes(max_num_seqs)
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks
        n = self.max_size
        # Layout of the flat buffer: ids, positions, slots, seq_lens (n each), cu (n + 1),
        # then the block tables (n x max_blocks) last, so a step copies a prefix.
        self._offsets = [0, n, 2 * n, 3 * n, 4 * n, 5 * n + 1]
        capacity = self._offsets[-1] + n * max_blocks
        self._host = PinnedStaging(capacity)
        self._device = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None

    def _views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        o, buf = self._offsets, self._device
        tables = buf[o[5] : o[5] + self.max_size * self.max_blocks].view(
            self.max_size, self.max_blocks
        )
        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=buf[o[2] : o[2] + size],
            block_tables=tables[:size],
            seq_lens=buf[o[3] : o[3] + size],
            cu_seqlens_q=buf[o[4] : o[4] + size + 1],
        )
        return buf[o[0] : o[0] + size], buf[o[1] : o[1] + size], meta

    def _fill(self, step: StepArrays | None, size: int) -> None:
        """Write a step (or, for capture, an all-padding batch) into the pinned mirror and
        copy the used prefix to the device buffers."""
        o, host = self._offsets, self._host.acquire()
        n = 0 if step is None else len(step.seq_lens)
        ids, pos, slots = host[o[0] : o[1]], host[o[1] : o[2]], host[o[2] : o[3]]
        seq_lens, cu = host[o[3] : o[4]], host[o[4] : o[5]]
        tables = host[o[5] :].reshape(self.max_size, self.max_blocks)
        if step is not None:
            ids[:n], pos[:n], slots[:n] = step.input_ids, step.positions, step.slot_mapping
            seq_lens[:n] = step.seq_lens
            tables[:n, : step.block_tables.shape[1]] = step.block_tables
        ids[n:size], pos[n:size], slots[n:size], seq_lens[n:size] = 0, 0, -1, 1
        tables[n:size] = 0
        cu[: size + 1] = np.arange(size + 1, dtype=np.int32)
        used = o[5] + size * self.max_blocks
        self._host.copy_to(self._device, used)

    def padded_size(self, step: StepArrays) -> int | None:
        n = len(step.seq_lens)
        # A graph returns logits for every row, so every row must sample: a one-token
        # prefill chunk short of its prompt's end is not a decode.
        if not step.decode_only or len(step.sample_rows) != n or n > self.max_size:
            return None
        return next(s for s in self.sizes if s >= n)

    @torch.inference_mode()
    def capture(self) -> None:
        began = time.perf_counter()
        # Largest first, so smaller graphs reuse the largest one's memory pool.
        for index, size in enumerate(reversed(self.sizes), 1):
            self._fill(None, size)
            ids, positions, meta = self._views(size)
            with step_metadata(meta):
                for _ in range(2):  # compile, autotune and JIT every kernel before capture
                    self.compute_logits(self.forward(ids, positions, meta))
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    logits = self.compute_logits(self.forward(ids, positions, meta))
            if self._pool is None:
                self._pool = graph.pool()
            self._graphs[size] = (graph, logits)
            if index % 8 == 0 or index == len(self.sizes):
                logger.info(
                    "capturing CUDA graphs: %d/%d batch sizes (%.0f s)",
                    index,
                    len(self.sizes),
                    time.perf_counter() - began,
                )

    def replay(
        self,
        step: StepArrays,
        size: int,
        fill_pending: Callable[[torch.Tensor, StepArrays], None],
    ) -> torch.Tensor:
        """Logits of the step's rows (all of them sample: a decode-only step).
        ``fill_pending`` writes the input ids still on the device into the graph's input
        buffer (async scheduling) after the host copy."""
        self._fill(step, size)
        fill_pending(self._views(size)[0], step)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[: len(step.seq_lens)]
