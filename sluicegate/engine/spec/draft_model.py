"""A draft model: a smaller checkpoint sharing the target's vocabulary proposes the draft
tokens that the target then verifies in one forward pass.

Its KV cache mirrors the target's: as many blocks of the same size, addressed through the
same block tables and slot mappings, and written for every token the target computes (a
``mirror`` forward on each step's own inputs). So whatever the target's cache holds for a
sequence (prefix-cache hits, chunked prefill, recomputation after preemption, blocks copied
for ``n`` > 1) the draft's holds too, and the scheduler's block accounting serves both.
Proposing then costs ``k`` one-token forwards of the draft per speculating sequence, into
slots the scheduler already reserved for the drafts it verifies; the verify step's mirror
forward rewrites them with the same tokens and adds the last draft's.

The cost: the draft's cache is memory beyond ``--kv-cache-memory`` (its own layers' share
per token), and the mirror forward runs on every step, speculating or not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as SequenceOf
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from sluicegate.engine.core.scheduler_output import ScheduledSequence
from sluicegate.engine.models.llama import LlamaForCausalLM
from sluicegate.engine.runner.attention import AttentionBackend, AttentionMetadata
from sluicegate.engine.runner.compilation import step_metadata
from sluicegate.engine.sample.batched import argmax_rows, filtered_probs, sample_from_probs
from sluicegate.engine.sample.params import SamplingParams

if TYPE_CHECKING:
    from sluicegate.engine.options import EngineOptions
    from sluicegate.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_draft_model(path: str | Path, runner: ModelRunner, options: EngineOptions) -> DraftModel:
    """The draft checkpoint in the target's dtype and device (a GGUF file converts once, as a
    target's does), its cache sized as the target runner's, mirrored from every step."""
    from sluicegate.engine.models.gguf import checkpoint_folder
    from sluicegate.engine.runner.build import load_engine_model

    # The draft proposes as the base model: the target verifies with each row's adapter.
    base_only = replace(options, max_loras=0, lora_modules=None)
    model, _ = load_engine_model(checkpoint_folder(path), runner.device, base_only)
    draft = DraftModel(
        model,  # type: ignore[arg-type]  # DraftModel refuses a transformers-backend model
        runner.backend,
        num_blocks=runner.num_kv_blocks_allocated,
        block_size=runner.block_size,
        target_vocab_size=runner.config.vocab_size,
    )
    runner.attach_draft(draft)
    return draft


class DraftModel:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        *,
        num_blocks: int,
        block_size: int,
        target_vocab_size: int,
    ) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(
                "the speculative draft model must be an architecture served natively "
                "(Llama, Mistral, Qwen2, Qwen3), not through the transformers backend"
            )
        if model.config.vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({model.config.vocab_size} tokens) differs from "
                f"the target's ({target_vocab_size}): they must share the tokenizer"
            )
        self.model = model
        self.backend = backend
        self.block_size = block_size
        config = model.config
        device = next(model.parameters()).device
        self.device = device
        self.kv_cache = torch.zeros(
            config.num_hidden_layers,
            2,
            num_blocks,
            block_size,
            config.num_key_value_heads,
            config.head_dim,
            dtype=config.dtype,
            device=device,
        )
        for layer, attention in enumerate(model.attention_layers()):
            attention.k_cache = self.kv_cache[layer, 0]
            attention.v_cache = self.kv_cache[layer, 1]
        logger.info(
            "speculative draft model: %d layers, its KV cache %.0f MiB beside the target's",
            config.num_hidden_layers,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )

    @torch.inference_mode()
    def mirror(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The draft's KV for the tokens a target step computes (its logits are not needed)."""
        with step_metadata(meta):
            self.model(ids, positions, meta)

    @torch.inference_mode()
    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def propose(
        self, items: SequenceOf[ScheduledSequence], generator: torch.Generator
    ) -> torch.Tensor | None:
        """Fill each item's draft tokens (the placeholders the scheduler appended after its
        last known token) with the draft model's: the argmax for greedy requests, a draw from
        the draft's tempered, filtered distribution q otherwise. Returns q for every draft
        token, item after item (rows of greedy requests are left zero), or None when every
        request is greedy."""
        starts = np.array([item.start for item in items], dtype=np.int64)
        widths = np.array([item.num_drafts for item in items], dtype=np.int64)
        params = [item.seq.params for item in items]
        random_items = np.array([i for i, p in enumerate(params) if not p.greedy], dtype=np.int64)
        offsets = np.cumsum(widths) - widths
        vocab = self.model.config.vocab_size
        q = None
        if len(random_items):
            q = torch.zeros(int(widths.sum()), vocab, dtype=torch.float32, device=self.device)
        tables = [item.seq.block_table for item in items]
        width = max(len(t) for t in tables)
        block_tables = np.zeros((len(items), width), dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        for step in range(int(widths.max())):
            rows = np.flatnonzero(widths > step)
            positions = starts[rows] + step
            ids = [items[r].seq.token_ids[p] for r, p in zip(rows, positions, strict=True)]
            logits = self._forward(ids, positions, block_tables[rows])
            tokens = argmax_rows(logits)
            random_rows = np.flatnonzero(np.isin(rows, random_items))
            if len(random_rows):
                assert q is not None
                chosen = [params[rows[r]] for r in random_rows]
                probs = _draft_distribution(logits[torch.from_numpy(random_rows)], chosen, vocab)
                uniforms = torch.rand(
                    len(random_rows), generator=generator, device=self.device, dtype=torch.float64
                )
                index = torch.from_numpy(random_rows).to(self.device)
                tokens[index] = sample_from_probs(probs, uniforms).to(tokens.dtype)
                q_rows = torch.from_numpy(offsets[rows[random_rows]] + step).to(self.device)
                q[q_rows] = probs
            for r, position, token in zip(rows, positions, tokens.tolist(), strict=True):
                items[r].seq.token_ids[position + 1] = token
        return q

    def _forward(
        self, ids: list[int], positions: np.ndarray, block_tables: np.ndarray
    ) -> torch.Tensor:
        """One decode token per row: logits (float32) after each."""
        size = self.block_size
        table_index = positions // size
        slots = block_tables[np.arange(len(ids)), table_index].astype(np.int64) * size
        slots += positions % size
        device = self.device

        def int32(values: np.ndarray | list[int]) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values, dtype=np.int32)).to(device)

        meta = AttentionMetadata(
            backend=self.backend,
            slot_mapping=int32(slots),
            block_tables=int32(block_tables),
            seq_lens=int32(positions + 1),
            cu_seqlens_q=int32(np.arange(len(ids) + 1)),
            num_decodes=len(ids),
        )
        with step_metadata(meta):
            hidden = self.model(int32(ids), int32(positions), meta)
        return self.model.compute_logits(hidden).float()


def _draft_distribution(
    logits: torch.Tensor, params: list[SamplingParams], vocab: int
) -> torch.Tensor:
    """q: the draft's distribution shaped as the request's own sampling shapes the target's
    (temperature, top-k, top-p, min-p), normalised."""
    temperature = np.array([p.temperature for p in params], dtype=np.float32)
    top_k = np.array([p.top_k if p.top_k > 0 else vocab for p in params], dtype=np.int64)
    top_p = np.array([p.top_p for p in params], dtype=np.float32)
    min_p = np.array([p.min_p for p in params], dtype=np.float32)
    scaled = logits / torch.from_numpy(temperature).to(logits.device)[:, None]
    probs = filtered_probs(scaled, top_k, top_p, min_p)
    return probs / probs.sum(dim=-1, keepdim=True)
