"""``torch.compile`` for the model's non-attention maths, with paged attention kept opaque.

Paged attention (KV write + attention through the block tables) is the custom op
``sluicegate::paged_attention``, so Dynamo and Inductor treat it as one call they neither
trace into nor break the graph at: RMSNorm, RoPE, SiLU x mul and the residual adds around it
fuse, and a CUDA graph captured around the compiled forward replays the attention kernels
like any other. As vLLM does, the op takes only activations and a layer number; the layer's
cache views and the step's metadata are looked up when it runs, so the KV cache never
enters the traced graph (where functionalisation would copy it) and a captured graph keeps
the addresses of the persistent buffers it was captured with.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from sluicegate.engine.runner.attention import AttentionMetadata, PagedAttention

logger = logging.getLogger(__name__)

_LAYERS: weakref.WeakValueDictionary[int, PagedAttention] = weakref.WeakValueDictionary()
_next_layer_id = itertools.count()
_step = threading.local()


@contextlib.contextmanager
def step_metadata(meta: AttentionMetadata) -> Iterator[None]:
    """The metadata the attention op reads during one forward (or one graph capture)."""
    previous = getattr(_step, "meta", None)
    _step.meta = meta
    try:
        yield
    finally:
        _step.meta = previous


@torch.library.custom_op("sluicegate::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
) -> torch.Tensor:
    layer = _LAYERS[layer_id]
    meta: AttentionMetadata = _step.meta
    meta.backend.store_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
    return meta.backend.paged_attention(
        q,
        layer.k_cache,
        layer.v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        layer.scale,
        num_decodes=meta.num_decodes,
    )


@paged_attention_op.register_fake
def _paged_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int
) -> torch.Tensor:
    return torch.empty_like(q)


def register_layers(model: torch.nn.Module) -> None:
    """Give each attention layer an id the op can find it by; they then call the op."""
    for attention in model.attention_layers():  # type: ignore[operator]
        if attention.layer_id is not None:
            continue
        attention.layer_id = next(_next_layer_id)
        _LAYERS[attention.layer_id] = attention


def compile_model(model: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The model's forward through ``torch.compile`` with dynamic token counts."""
    register_layers(model)
    return torch.compile(model.forward, dynamic=True)


def warm_compiled(run: Callable[[int, int], object], shapes: list[tuple[int, int]]) -> None:
    """Trigger every compilation at start-up: ``run(num_seqs, tokens_per_seq)`` per shape
    (Inductor specialises on 1 vs many, so decode and prefill each compile once)."""
    began = time.perf_counter()
    for index, (num_seqs, tokens) in enumerate(shapes, 1):
        run(num_seqs, tokens)
        logger.info(
            "start-up warm-up (compilation, kernels): shape %d/%d done (%.0f s)",
            index,
            len(shapes),
            time.perf_counter() - began,
        )
