"""The batched LoRA product (``add_lora_``) against a plain per-token torch reference, in every
dtype the engine serves, for each shape a step's plan can take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluicegate.engine.lora.ops import LoraPlan, add_lora_

SLOTS, RANK, IN, OUT = 4, 12, 48, 40
# Tolerances relative to the delta's scale: float32 sums in another order, 16-bit dtypes
# round the shrunk product once more.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def reference_delta(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: list[int],
    slices: list[tuple[int, int]],
) -> torch.Tensor:
    """Token by token and slice by slice, in float32: ``(x[t] @ A[s, i]^T) @ B[s, rows i]^T``,
    nothing for slot -1."""
    out = torch.zeros(x.shape[0], b.shape[1], dtype=torch.float32)
    for token, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for index, (first, rows) in enumerate(slices):
            shrink = a[slot, index * RANK : (index + 1) * RANK].float()
            expand = b[slot, first : first + rows].float()
            out[token, first : first + rows] = (x[token].float() @ shrink.t()) @ expand.t()
    return out


CASES = {
    "mixed with base rows": [0, 0, -1, 2, 2, 2, -1, 1, 3, 0, -1],
    "one adapter, every token": [2] * 9,
    "one adapter, some tokens": [-1, 1, 1, -1],
    "slots with a gap": [3, 0, 3, -1, 0],
    "decode rows, one token each": [1, 0, 3, 2, -1, 1],
}


# One projection, or fused ones (q, k, v) whose slices' output rows follow each other.
SLICES = {"one linear": [(0, OUT)], "fused q, k, v": [(0, 16), (16, 12), (28, 12)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(SLICES))
def test_batched_lora_equals_the_per_token_reference(
    dtype: torch.dtype, case: str, layout: str
) -> None:
    token_slots, slices = CASES[case], SLICES[layout]
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(len(token_slots), IN, generator=generator).to(dtype)
    a = (torch.randn(SLOTS, len(slices) * RANK, IN, generator=generator) / IN**0.5).to(dtype)
    b = torch.randn(SLOTS, OUT, RANK, generator=generator).to(dtype)
    base = torch.randn(len(token_slots), OUT, generator=generator).to(dtype)
    plan = LoraPlan.build(np.array(token_slots), torch.device("cpu"))
    assert plan is not None
    y = add_lora_(base.clone(), x, a, b, plan, slices)
    assert y.dtype == dtype
    expected = base.float() + reference_delta(x, a, b, token_slots, slices)
    scale = expected.abs().max().item()
    assert (y.float() - expected).abs().max().item() <= TOLERANCE[dtype] * scale
    untouched = [t for t, slot in enumerate(token_slots) if slot < 0]
    assert torch.equal(y[untouched], base[untouched])


def test_a_step_without_adapters_has_no_plan() -> None:
    assert LoraPlan.build(np.array([-1, -1, -1]), torch.device("cpu")) is None


def test_the_plan_groups_tokens_by_slot() -> None:
    plan = LoraPlan.build(np.array([2, -1, 0, 2, 0, 2]), torch.device("cpu"))
    assert plan is not None
    assert plan.slots.tolist() == [0, 2]
    assert not plan.contiguous and not plan.whole
    assert plan.gather.tolist() == [[2, 4, 0], [0, 3, 5]]
    assert plan.targets.tolist() == [2, 4, 0, 3, 5]
    assert plan.valid.tolist() == [0, 1, 3, 4, 5]
