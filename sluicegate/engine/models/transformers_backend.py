"""Any causal LM transformers can build, run with its attention swapped for our paged attention.

The checkpoint's own transformers class does everything but attention (projections, rotary,
norms, residual layout), so fused projections, partial rotary or parallel residuals need no
code here. Attention goes through transformers' ``AttentionInterface`` to our paged attention
(``sluicegate.engine.models.transformers_attention``), so every layer reads and writes the block pool.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sluicegate.engine.models.checkpoint import checkpoint_names, iter_checkpoint
from sluicegate.engine.models.config import parse_dtype
from sluicegate.engine.models.transformers_attention import (
    ATTENTION_NAME,
    ForwardContext,
    PagedKVLayer,
    UnsupportedTransformersModelError,
    forward_context,
    register,
)
from sluicegate.engine.runner.attention import AttentionMetadata

__all__ = ["TransformersCausalLM", "UnsupportedTransformersModelError", "load_transformers_model"]

logger = logging.getLogger(__name__)


@dataclass
class TransformersModelConfig:
    """What the engine reads from a model's config (the native ``ModelConfig``'s subset)."""

    architecture: str
    model_type: str
    vocab_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    # Windows are applied per layer by the attention, so nothing caps the context length.
    sliding_window: int | None = None


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Build a module with its parameters on the meta device but its buffers real.

    Parameters are about to be replaced by the checkpoint's, so allocating and initialising
    them would be wasted; buffers (rotary inverse frequencies and the like) are derived from
    the config at construction and never stored in checkpoints, so they must be computed.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(
                param.to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


# Layer kinds a transformers config may list in ``layer_types``. Our paged attention implements
# full causal attention and sliding-window attention ("attention" is transformers' legacy name
# for full attention); every other kind is refused, with a reason that depends on what it is.
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention"}
# Kinds that hold recurrent / state-space / convolution state rather than per-token K/V, which
# the block pool cannot give (transformers' names, current and legacy).
_RECURRENT_LAYER_TYPES = {
    "linear_attention",
    "mamba",
    "mamba2",
    "conv",
    "hybrid",
    "hybrid_sliding",
    "recurrent",
}


def _describe_attention_pattern(layer_type: str, config: Any) -> str:
    """What an attention pattern our paged attention does not implement would need."""
    if layer_type == "chunked_attention":
        chunk = getattr(config, "attention_chunk_size", None)
        size = f"{chunk} tokens" if chunk else "a fixed size"
        return (
            f"chunked attention (each token attends only within its chunk of {size}; "
            "ours would let it attend to the whole context)"
        )
    if layer_type == "indexed_attention" or "sparse" in layer_type:
        return f"{layer_type} (indexed/sparse attention: an indexer picks the keys each token sees)"
    return layer_type


def check_supported(hf_config: Any, model_class: type) -> None:
    """Raise ``UnsupportedTransformersModelError`` naming why this model cannot be served."""
    name = model_class.__name__
    if getattr(hf_config, "is_encoder_decoder", False):
        raise UnsupportedTransformersModelError(
            f"{name} is an encoder-decoder model; the engine serves decoder-only causal LMs"
        )
    # A multimodal config keeps its decoder's layout in its text config: Mllama lists its
    # cross-attention layers there, Llama-4 its chunked-attention layers, not at the top.
    text = hf_config.get_text_config()
    configs = (hf_config,) if text is hf_config else (hf_config, text)
    for config in configs:
        layer_types = set(getattr(config, "layer_types", None) or [])
        recurrent = sorted(layer_types & _RECURRENT_LAYER_TYPES)
        if recurrent:
            raise UnsupportedTransformersModelError(
                f"{name} has {', '.join(recurrent)} layers: their recurrent/state-space state "
                "does not fit the paged KV block pool"
            )
        patterns = sorted(layer_types - _ATTENTION_LAYER_TYPES - _RECURRENT_LAYER_TYPES)
        if patterns:
            raise UnsupportedTransformersModelError(
                f"{name} has {', '.join(patterns)} layers: our paged attention implements only "
                "full and sliding-window attention, not "
                f"{'; '.join(_describe_attention_pattern(t, config) for t in patterns)}"
            )
    if any(
        getattr(c, "cross_attention_layers", None) or getattr(c, "add_cross_attention", False)
        for c in (hf_config, text)
    ):
        raise UnsupportedTransformersModelError(
            f"{name} uses cross-attention, whose keys come from another input rather than the "
            "token sequence the block pool caches"
        )
    if not model_class._supports_attention_backend:
        raise UnsupportedTransformersModelError(
            f"{name} cannot take a custom attention function (its transformers class does not "
            "dispatch attention through AttentionInterface)"
        )


class TransformersCausalLM(nn.Module):
    """The engine's model interface (``forward``, ``compute_logits``, ``attention_layers``)
    around a transformers ``*ForCausalLM`` whose attention is our paged attention."""

    def __init__(self, hf_model: nn.Module, config: TransformersModelConfig) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = config
        self._layers = [PagedKVLayer() for _ in range(config.num_hidden_layers)]
        hf_config = hf_model.config
        self._final_softcap = getattr(hf_config, "final_logit_softcapping", None)
        self._logit_scale = getattr(hf_config, "logit_scale", None)  # Cohere multiplies
        self._logits_scaling = getattr(hf_config, "logits_scaling", None)  # Granite divides

    def attention_layers(self) -> list[PagedKVLayer]:
        return self._layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        context = ForwardContext(meta, self._layers, int(meta.seq_lens.max()))
        with forward_context(context):
            out = self.hf_model.base_model(
                input_ids=input_ids[None],
                position_ids=positions[None],
                use_cache=False,
            )
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.hf_model.get_output_embeddings()(hidden)
        if self._final_softcap:
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        if self._logit_scale:
            logits = logits * self._logit_scale
        if self._logits_scaling:
            logits = logits / self._logits_scaling
        return logits


def _kv_shape(hf_config: Any) -> tuple[int, int]:
    """(KV heads, head dim) from the text config, the names transformers' classes use."""
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return kv_heads, head_dim


def load_transformers_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
) -> TransformersCausalLM:
    """Build the class on the meta device and copy our loader's weights in; checkpoints
    whose tensors transformers must merge or split first (e.g. per-expert MoE weights into
    fused experts) load through transformers' ``from_pretrained`` instead."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    register()
    hf_config = AutoConfig.from_pretrained(path)
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:
        raise UnsupportedTransformersModelError(
            f"transformers has no causal-LM class for model type {hf_config.model_type!r}"
        ) from None
    check_supported(hf_config, model_class)
    with _parameters_on_meta():
        hf_model = AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME
        )
    converted = _names_needing_conversion(hf_model, checkpoint_names(path))
    if converted:
        logger.info(
            "%s: %d checkpoint tensors (e.g. %s) need transformers' weight converters; "
            "loading through transformers' from_pretrained",
            model_class.__name__,
            len(converted),
            converted[0],
        )
        # Loaded on the CPU, then moved: a device_map would need accelerate.
        hf_model = AutoModelForCausalLM.from_pretrained(
            path, config=hf_config, dtype=dtype, attn_implementation=ATTENTION_NAME
        ).to(device)
    else:
        buffers = {name: buffer.to(device) for name, buffer in hf_model.named_buffers()}
        hf_model = hf_model.to_empty(device=device)
        for name, buffer in buffers.items():
            module_name, _, buffer_name = name.rpartition(".")
            hf_model.get_submodule(module_name)._buffers[buffer_name] = buffer
        _load_weights(hf_model, iter_checkpoint(path))
    hf_model.eval()

    text = hf_config.get_text_config()
    indexed = [m for m in hf_model.modules() if getattr(m, "layer_idx", None) is not None]
    if {m.layer_idx for m in indexed} != set(range(text.num_hidden_layers)):
        raise UnsupportedTransformersModelError(
            f"{model_class.__name__}: its attention modules do not carry a layer index for "
            f"each of its {text.num_hidden_layers} layers, so they cannot be given a block pool"
        )
    kv_heads, head_dim = _kv_shape(hf_config)
    windows = {getattr(m, "sliding_window", None) for m in indexed} - {None}
    eos = getattr(hf_config, "eos_token_id", None)
    config = TransformersModelConfig(
        architecture=model_class.__name__,
        model_type=hf_config.model_type,
        vocab_size=text.vocab_size,
        num_hidden_layers=text.num_hidden_layers,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=getattr(text, "max_position_embeddings", None) or 2048,
        dtype=dtype,
        eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
    )
    logger.info(
        "transformers backend: %s, %d layers, %d KV heads x %d, sliding windows %s",
        model_class.__name__,
        config.num_hidden_layers,
        kv_heads,
        head_dim,
        sorted(windows) or "none",
    )
    return TransformersCausalLM(hf_model, config)


def _weight_transforms(hf_model: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' (renamings, converters) for the class's checkpoint keys."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = get_model_conversion_mapping(hf_model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return renamings, [t for t in transforms if not isinstance(t, WeightRenaming)]


def _names_needing_conversion(hf_model: nn.Module, names: list[str]) -> list[str]:
    from transformers.core_model_loading import rename_source_key

    renamings, converters = _weight_transforms(hf_model)
    if not converters:
        return []
    return [name for name in names if rename_source_key(name, renamings, converters)[1]]


def _load_weights(hf_model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into the transformers model by name (after transformers' own
    key renamings for the class, e.g. GPT-NeoX's ``embed_out`` -> ``lm_head``); every
    parameter must be set (tied ones through their source) and every tensor have a place."""
    from transformers.core_model_loading import rename_source_key

    renamings, _ = _weight_transforms(hf_model)
    params = dict(hf_model.named_parameters(remove_duplicate=False))
    buffers = dict(hf_model.named_buffers())
    targets = {**buffers, **params}
    prefix = getattr(hf_model, "base_model_prefix", None)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            renamed, _ = rename_source_key(name, renamings, [], prefix, targets)
            target = targets.get(renamed)
            if target is None:
                if renamed.endswith("rotary_emb.inv_freq"):
                    continue  # older checkpoints stored the derived buffer
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(hf_model).__name__}"
                )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.add(renamed)
    tied = getattr(hf_model, "all_tied_weights_keys", None) or {}
    for target_name, source_name in tied.items():
        if target_name in loaded and source_name not in loaded:
            # Only the tied copy was stored: it becomes the source that tying shares.
            with torch.no_grad():
                hf_model.get_parameter(source_name).copy_(hf_model.get_parameter(target_name))
            loaded.add(source_name)
    hf_model.tie_weights()
    missing = [name for name in params if name not in loaded and name not in tied]
    if missing:
        raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")


def resolve_hf_dtype(
    requested: str | torch.dtype, raw_config: dict[str, Any], device: torch.device
) -> torch.dtype:
    """Same rule as the native loader: ``auto`` is the checkpoint's dtype, float16 on CPU
    runs as float32."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested != "auto":
        return parse_dtype(requested)
    text = raw_config.get("text_config") or raw_config
    name = (
        text.get("torch_dtype") or text.get("dtype") or raw_config.get("torch_dtype") or "float32"
    )
    dtype = parse_dtype(name)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.float32
    return dtype
