"""A local checkpoint's safetensors files: their names and tensors, read shard by shard."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def checkpoint_names(path: Path) -> list[str]:
    """Tensor names from the safetensors headers, without reading any tensor."""
    names: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            names.extend(shard.keys())
    return names


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as shard:
            for name in shard.keys():
                yield name, shard.get_tensor(name)
