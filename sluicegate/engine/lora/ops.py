"""The batched LoRA product: ``y[t] += (x[t] @ A[s]^T) @ B[s]^T`` for every token ``t`` of a
step whose row runs adapter slot ``s`` (rows of the base model, slot -1, add nothing).

A fused projection has slices (q, k, v): ``A`` stacks theirs ([slices x rank, in], one
shrinking product for all), ``B`` holds each slice's output rows ([out, rank]), and slice i's
rows are expanded from slice i's columns of the shrunk product.

Tokens are grouped by slot once per step (``LoraPlan``, shared by every layer): each group's
tokens are gathered into one padded [groups, longest group, in] batch, shrunk through the
groups' ``A`` and expanded through their ``B`` by batched matmuls, and the real rows are
added back into the base output. The work is that of one product per token at the adapter's
(padded) rank whatever the number of adapters, plus the padding of the shorter groups; a step
whose tokens all run one adapter multiplies with no gather at all. The scale is folded into
``B`` when an adapter loads (``sluicegate.engine.lora.adapter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class LoraPlan:
    """Which tokens of a step run which slot, grouped: ``slots`` [groups] (ascending),
    ``gather`` [groups, longest] token indices (padded with 0), and, of the flattened
    [groups x longest] products, the real ones (``valid``) and their tokens (``targets``).
    ``whole``: one group holding every token of the step in order (nothing to gather)."""

    slots: torch.Tensor
    gather: torch.Tensor
    valid: torch.Tensor
    targets: torch.Tensor
    first_slot: int
    contiguous: bool
    whole: bool

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device) -> LoraPlan | None:
        """The plan for a step's per-token slots (-1: no adapter); None when no token has one."""
        adapted = np.flatnonzero(token_slots >= 0)
        if not len(adapted):
            return None
        order = adapted[np.argsort(token_slots[adapted], kind="stable")]
        slots, starts, counts = np.unique(token_slots[order], return_index=True, return_counts=True)
        longest = int(counts.max())
        within = np.arange(len(order)) - np.repeat(starts, counts)
        group = np.repeat(np.arange(len(slots)), counts)
        gather = np.zeros((len(slots), longest), dtype=np.int64)
        gather[group, within] = order
        valid = group * longest + within
        first = int(slots[0])

        def tensor(values: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)).to(device)

        return cls(
            slots=tensor(slots),
            gather=tensor(gather),
            valid=tensor(valid),
            targets=tensor(order),
            first_slot=first,
            contiguous=bool(slots[-1] - first == len(slots) - 1),
            whole=len(slots) == 1 and len(order) == len(token_slots),
        )


def add_lora_(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    plan: LoraPlan,
    slices: Sequence[tuple[int, int]],
) -> torch.Tensor:
    """``y`` [tokens, out] += each token's LoRA delta, in place; ``x`` [tokens, in], ``a``
    [slots, slices x rank, in], ``b`` [slots, out, rank], all of one dtype; ``slices``:
    each slice's (first output row, rows)."""
    rank = b.shape[2]
    if plan.whole:
        shrunk = x @ a[plan.first_slot].t()
        for index, (first, rows) in enumerate(slices):
            # One fused multiply-add per slice, straight into the slice's output columns.
            y[:, first : first + rows].addmm_(
                shrunk[:, index * rank : (index + 1) * rank],
                b[plan.first_slot, first : first + rows].t(),
            )
        return y
    groups = plan.slots.shape[0]
    if plan.contiguous:  # the usual case: views, no copy of the weights
        a = a.narrow(0, plan.first_slot, groups)
        b = b.narrow(0, plan.first_slot, groups)
    else:
        a = a.index_select(0, plan.slots)
        b = b.index_select(0, plan.slots)
    shrunk = torch.bmm(x[plan.gather], a.transpose(1, 2))
    for index, (first, rows) in enumerate(slices):
        part = shrunk[:, :, index * rank : (index + 1) * rank]
        expanded = torch.bmm(part, b[:, first : first + rows].transpose(1, 2))
        y[:, first : first + rows].index_add_(
            0, plan.targets, expanded.reshape(-1, rows).index_select(0, plan.valid)
        )
    return y
