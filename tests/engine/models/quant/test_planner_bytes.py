"""The capacity planner's quantized weight bytes are what compressed-tensors really writes:
its FP8_DYNAMIC and W4A16 checkpoints of the test model, tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from sluicegate.engine.capacity_sharding import weight_bytes
from sluicegate.engine.model_shape import ModelShape
from tests.engine.models.quant.checkpoints import checkpoint_tensors


@pytest.mark.parametrize(("fmt", "dtype"), [("ct-fp8-dynamic", "fp8"), ("ct-w4a16", "int4")])
def test_planner_weight_bytes_equal_the_checkpoint(
    fmt: str, dtype: str, quantized: Callable[[str], Path]
) -> None:
    folder = quantized(fmt)
    shape = ModelShape.from_config(json.loads((folder / "config.json").read_text()))
    tensors = checkpoint_tensors(folder)
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    # pack-quantized also stores each linear's shape: two int64s, which no GPU holds.
    shapes = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.endswith("_shape"))
    assert weight_bytes(shape, shape.parameter_count(), dtype).total == stored - shapes
