"""The paged KV cache's memory: the bytes of one block, how many blocks a CPU budget buys, and
the one allocation every layer's attention takes its views of."""

from __future__ import annotations

import torch

from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.models.config import ModelConfig
from sluicegate.engine.models.llama import LlamaForCausalLM

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
"""KV cache size on CPU when neither num_kv_blocks nor kv_cache_memory is given (vLLM's CPU
default is 4 GiB; the cache is zeroed, so a smaller default starts faster)."""


def kv_bytes_per_block(config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return per_token * element * block_size


def cpu_num_blocks(
    kv_cache_memory: int | None,
    bytes_per_block: int,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> int:
    """The blocks ``kv_cache_memory`` bytes hold (``DEFAULT_CPU_KV_CACHE_BYTES`` if None), but
    no more than every allowed sequence at full length could use: more would sit idle."""
    budget = DEFAULT_CPU_KV_CACHE_BYTES if kv_cache_memory is None else kv_cache_memory
    useful = max_num_seqs * blocks_for(max_model_len, block_size)
    blocks = min(budget // bytes_per_block, useful)
    if blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is below one block ({bytes_per_block} bytes)"
        )
    return blocks


def allocate_kv_cache(
    model: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One allocation, [layers, K/V, blocks, block_size, kv_heads, head_dim]; each layer gets
    views. Zeroed: masked attention weights multiply cache rows never written, and 0 x NaN
    from uninitialised memory would poison the output."""
    c = model.config
    cache = torch.empty(
        c.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        c.num_key_value_heads,
        c.head_dim,
        dtype=dtype,
        device=device,
    )
    # zero_() rather than torch.zeros: it touches every page now, not on first use mid-run.
    cache.zero_()
    for layer, attention in enumerate(model.attention_layers()):
        attention.k_cache = cache[layer, 0]
        attention.v_cache = cache[layer, 1]
    return cache
