"""Reading a peft LoRA folder (``adapter_config.json`` + ``adapter_model.safetensors``) into
the layout the engine's LoRA linears hold: per projection one ``A`` [slices x rank, in] and one ``B``
[out, rank] with the adapter's scaling folded in, padded to ``--max-lora-rank`` so that every
adapter fits every slot.

A fused projection (``qkv_proj``, ``gate_up_proj``) gets one slice per checkpoint linear
(q, k, v; gate, up): slice i's rows of ``A`` are that linear's ``lora_A`` (one shrinking
product serves all of them), and that linear's output rows of ``B`` its ``lora_B``. What the
engine does not serve is refused by name: DoRA, adapters on the embeddings or the LM head,
``modules_to_save``, LoRA biases, per-module rank or alpha patterns, a rank above
``--max-lora-rank``, a module or shape the base model does not have.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$"
)
_EMBEDDING_KEY = re.compile(r"lora_embedding_[AB]|lora_magnitude_vector")


class LoraLoadError(ValueError):
    """An adapter the engine cannot serve, with the reason (a client's ``invalid_request``)."""


@dataclass(frozen=True)
class Projection:
    """One LoRA-capable projection of the base model: its input width and, per checkpoint
    linear fused into it, that linear's name and output rows."""

    in_features: int
    parts: tuple[tuple[str, int], ...]

    @property
    def out_features(self) -> int:
        return sum(rows for _, rows in self.parts)


@dataclass(eq=False)
class Adapter:
    """A loaded adapter in host memory. Compared by identity: reloading a name makes a new
    one, and requests already running keep the one they started with."""

    name: str
    path: str
    rank: int
    digest: str
    """blake2b of the config and weights: the prefix cache's key, with the name."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    """Per projection (our module name): A [slices x max_rank, in], B [out, max_rank]."""

    @property
    def hash_seed(self) -> int:
        """Seeds the prefix cache's block-hash chain: no block is shared with the base model
        or another adapter, nor with other weights once loaded under this name."""
        digest = hashlib.blake2b(f"{self.name}\x00{self.digest}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little", signed=True)


def load_adapter(
    name: str,
    path: str | Path,
    projections: dict[str, Projection],
    max_rank: int,
    dtype: torch.dtype,
) -> Adapter:
    """The adapter at ``path`` packed for ``projections`` (our module name -> shape, from
    ``sluicegate.engine.lora.layers.lora_projections``); raises ``LoraLoadError``."""
    folder = Path(path)
    config_file, weights_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LoraLoadError(f"adapter {name!r}: {needed} not found (a peft LoRA folder)")
    config_bytes = config_file.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as exc:
        raise LoraLoadError(f"adapter {name!r}: {config_file} is not JSON: {exc}") from None
    rank, scale = _check_config(name, config, max_rank)
    digest = hashlib.blake2b(config_bytes, digest_size=16)
    tensors: dict[tuple[str, str], torch.Tensor] = {}
    with weights_file.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as weights:
            for key in weights.keys():
                if _EMBEDDING_KEY.search(key):
                    raise LoraLoadError(
                        f"adapter {name!r}: {key}: adapters on embeddings and DoRA "
                        "magnitudes are not served"
                    )
                match = _KEY.match(key)
                if match is None:
                    raise LoraLoadError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B")
                tensors[match["module"], match["which"]] = weights.get_tensor(key)
    except (OSError, RuntimeError) as exc:  # safetensors' header errors are RuntimeErrors
        raise LoraLoadError(f"adapter {name!r}: {weights_file}: {exc}") from None
    if not tensors:
        raise LoraLoadError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    packed = _pack(name, tensors, projections, rank, max_rank, scale, dtype)
    return Adapter(name, str(folder), rank, digest.hexdigest(), packed)


def _check_config(name: str, config: dict[str, object], max_rank: int) -> tuple[int, float]:
    """The adapter's rank and scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA)."""

    def refuse(why: str) -> LoraLoadError:
        return LoraLoadError(f"adapter {name!r}: {why}")

    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r}; only LORA is served")
    if config.get("use_dora"):
        raise refuse("DoRA (use_dora) is not served")
    if config.get("modules_to_save"):
        raise refuse(f"modules_to_save {config['modules_to_save']!r} (whole layers) is not served")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config['bias']!r}: LoRA biases are not served")
    if config.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out (Conv1D weights) is not served")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise refuse(f"a per-module {pattern} is not served")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)  # type: ignore[call-overload]
    for target in targets:
        if any(word in str(target) for word in ("embed", "lm_head")):
            raise refuse(f"target module {target!r}: adapters on embeddings or the LM head")
    rank = int(config.get("r", 8))  # type: ignore[call-overload]
    if rank < 1:
        raise refuse(f"rank r={rank}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is above this worker's --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", 8))  # type: ignore[arg-type]
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, scale


def _pack(
    name: str,
    tensors: dict[tuple[str, str], torch.Tensor],
    projections: dict[str, Projection],
    rank: int,
    max_rank: int,
    scale: float,
    dtype: torch.dtype,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    owner = {
        part: (module, index, offset)
        for module, projection in projections.items()
        for index, (part, offset) in enumerate(_offsets(projection.parts))
    }
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for part, which in sorted(tensors):
        if which == "B":
            continue
        if (part, "B") not in tensors:
            raise LoraLoadError(f"adapter {name!r}: {part} has lora_A but no lora_B")
        if part not in owner:
            leaf = part.rpartition(".")[2]
            raise LoraLoadError(
                f"adapter {name!r}: module {part!r} ({leaf}) is not a projection of this base "
                "model that LoRA is served on (q/k/v/o, gate/up/down)"
            )
        module, index, offset = owner[part]
        projection = projections[module]
        rows = projection.parts[index][1]
        lora_a, lora_b = tensors[part, "A"], tensors[part, "B"]
        if lora_a.shape != (rank, projection.in_features) or lora_b.shape != (rows, rank):
            raise LoraLoadError(
                f"adapter {name!r}: {part}: A {tuple(lora_a.shape)} and B "
                f"{tuple(lora_b.shape)} do not fit the base model's ({rank}, "
                f"{projection.in_features}) and ({rows}, {rank}) (another base model?)"
            )
        if module not in packed:
            slices = len(projection.parts) * max_rank
            packed[module] = (
                torch.zeros(slices, projection.in_features, dtype=dtype),
                torch.zeros(projection.out_features, max_rank, dtype=dtype),
            )
        a, b = packed[module]
        first = index * max_rank
        a[first : first + rank] = lora_a.to(dtype)
        # Scaled in float32, then rounded once to the model's dtype.
        b[offset : offset + rows, :rank] = (lora_b.float() * scale).to(dtype)
    for part, which in tensors:
        if which == "B" and (part, "A") not in tensors:
            raise LoraLoadError(f"adapter {name!r}: {part} has lora_B but no lora_A")
    return packed


def _offsets(parts: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    """Each part's name with its first output row in the fused projection."""
    offsets, row = [], 0
    for part, rows in parts:
        offsets.append((part, row))
        row += rows
    return offsets
