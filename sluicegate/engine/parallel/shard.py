"""Tensor parallelism for the native models: which slice of each weight a rank holds, and the
collectives that make the slices add up to the whole model (Megatron-style).

Each rank holds a contiguous run of KV heads with the query heads that read them (so a rank's
attention needs nothing from the others), a run of the MLP's intermediate columns, and a run
of the vocabulary. The merged QKV and gate/up projections are column-parallel (each rank's
rows of q, k, v, gate and up), ``o_proj`` and ``down_proj`` row-parallel (their partial sums
are all-reduced, their bias added once), the embedding vocab-parallel (each rank looks up its
own tokens, the rest are zeros, all-reduced) and the LM head too (each rank's logits,
all-gathered). Uneven splits are fine: SmolLM2's 3 KV heads over 2 ranks give one rank 2 (6
query heads) and the other 1 (3). With fewer KV heads than ranks each KV head is replicated
on ``ranks / kv_heads`` ranks that split its query heads; a model whose heads cannot be laid
out that way is refused, naming the counts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    # Not at run time: the models package imports this module while it initialises.
    from sluicegate.engine.models.config import ModelConfig


def split_evenly(total: int, parts: int, index: int) -> range:
    """The ``index``-th of ``parts`` contiguous runs of ``range(total)``, sizes differing by
    at most one (the first ones larger)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range
    vocab_size: int
    head_dim: int

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        group = heads // kv_heads
        if kv_heads >= size:
            kv = split_evenly(kv_heads, size, rank)
            q = range(kv.start * group, kv.stop * group)
        elif size % kv_heads == 0 and group % (size // kv_heads) == 0:
            replicas = size // kv_heads
            head, part = divmod(rank, replicas)
            per_rank = group // replicas
            kv = range(head, head + 1)
            q = range(head * group + part * per_rank, head * group + (part + 1) * per_rank)
        else:
            raise ValueError(
                f"tensor_parallel_size {size} cannot split {heads} attention heads over "
                f"{kv_heads} KV heads: use a size up to {kv_heads}, or one that divides "
                f"{heads} as a multiple of {kv_heads}"
            )
        if config.intermediate_size < size or config.vocab_size < size:
            raise ValueError(f"tensor_parallel_size {size} exceeds the model's layer widths")
        return cls(
            rank=rank,
            size=size,
            q_heads=q,
            kv_heads=kv,
            intermediate=split_evenly(config.intermediate_size, size, rank),
            vocab=split_evenly(config.vocab_size, size, rank),
            vocab_size=config.vocab_size,
            head_dim=config.head_dim,
        )

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's modules are built from: its heads and intermediate width
        (the vocabulary stays whole: sampling and grammars see every token)."""
        return dataclasses.replace(
            config,
            num_attention_heads=len(self.q_heads),
            num_key_value_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )

    def shard(self, target: str, part: int, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a checkpoint tensor bound for our parameter ``target``
        (``part``: q/k/v or gate/up within a merged projection)."""
        module, _, leaf = target.rpartition(".")
        name = module.rpartition(".")[2]
        hd = self.head_dim
        if name == "qkv_proj":
            heads = self.q_heads if part == 0 else self.kv_heads
            return tensor[heads.start * hd : heads.stop * hd]
        if name == "gate_up_proj":
            return tensor[self.intermediate.start : self.intermediate.stop]
        if name in ("o_proj", "down_proj"):
            if leaf == "bias":  # added once, after the partial sums meet
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            run = (
                range(self.q_heads.start * hd, self.q_heads.stop * hd)
                if name == "o_proj"
                else self.intermediate
            )
            return tensor[:, run.start : run.stop]
        if name in ("embed_tokens", "lm_head"):
            return tensor[self.vocab.start : self.vocab.stop]
        return tensor


@dataclass(frozen=True)
class TensorParallel:
    """What a rank's forward needs at run time: its plan and the process group."""

    plan: ShardPlan
    group: dist.ProcessGroup | None = None


def reduce_partial_sums(x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    if tp is not None:
        dist.all_reduce(x, group=tp.group)
    return x


def embed(weight: torch.Tensor, ids: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """Embedding rows for ``ids`` from this rank's run of the vocabulary, all-reduced."""
    if tp is None:
        return F.embedding(ids, weight)
    vocab = tp.plan.vocab
    local = ids.long() - vocab.start
    outside = (local < 0) | (local >= len(vocab))
    rows = F.embedding(local.clamp_(0, len(vocab) - 1), weight)
    rows.masked_fill_(outside[:, None], 0)
    dist.all_reduce(rows, group=tp.group)
    return rows


def gather_logits(logits: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """Every rank's logits for its run of the vocabulary, side by side (runs of unequal
    length travel padded to the longest)."""
    if tp is None:
        return logits
    plan = tp.plan
    widest = len(split_evenly(plan.vocab_size, plan.size, 0))
    padded = F.pad(logits, (0, widest - logits.shape[-1]))
    parts = [torch.empty_like(padded) for _ in range(plan.size)]
    dist.all_gather(parts, padded.contiguous(), group=tp.group)
    return torch.cat(
        [
            part[:, : len(split_evenly(plan.vocab_size, plan.size, r))]
            for r, part in enumerate(parts)
        ],
        dim=-1,
    )
