"""Compile every Triton kernel for an H100/H200 (sm_90) without a GPU: Triton's own compiler
and the ptxas it ships turn the kernels into cubins, catching GPU-only compile errors (the
interpreter never runs that path) and checking that fp16/bf16 attention uses tensor cores.

Run as a script with ``TRITON_INTERPRET`` unset (under the interpreter ``triton.jit`` yields
functions the compiler cannot take); prints one line per kernel variant, exits non-zero on the
first failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("unset TRITON_INTERPRET to compile for the GPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sluicegate.kernels.launch_configs import family_config, tile_config
from sluicegate.kernels.triton_paged_attention import (
    _merge_splits_kernel,
    _paged_attention_kernel,
    plan_tiles,
)
from sluicegate.kernels.triton_quant_linear import _quant_linear_kernel
from sluicegate.kernels.triton_store_kv import _store_kv_kernel

SM90 = GPUTarget("cuda", 90, 32)
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}

# (dtype, decode?, GQA group, head_dim, block_size, splits, launch-table family): Llama-3.1-8B
# decode and prefill, split-KV decode, an odd head dim, head dim 256, a group that is not a
# power of two, with the default tiles; then Llama-3.1-8B with the H100/H200 table entry
# (whose shared memory must fit sm_90's 227 KiB per block).
ATTENTION_VARIANTS = [
    (torch.bfloat16, True, 4, 128, 16, 1, None),
    (torch.bfloat16, True, 4, 128, 16, 8, None),
    (torch.bfloat16, False, 4, 128, 16, 1, None),
    (torch.float16, False, 1, 80, 32, 1, None),
    (torch.bfloat16, True, 7, 64, 16, 1, None),
    (torch.float32, False, 2, 256, 16, 1, None),
    (torch.bfloat16, True, 4, 128, 16, 1, (9, 0)),
    (torch.bfloat16, True, 4, 128, 16, 8, (9, 0)),
    (torch.bfloat16, False, 4, 128, 16, 1, (9, 0)),
]
SM90_SHARED_BYTES = 227 * 1024


def compile_kernel(
    fn,
    types: dict[str, str],
    constants: dict[str, object],
    num_warps: int = 4,
    num_stages: int = 2,
):
    signature = {name: "constexpr" if name in constants else types[name] for name in fn.arg_names}
    source = ASTSource(fn, signature, constexprs=constants)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=SM90, options=options)


def attention_types(dtype: torch.dtype) -> dict[str, str]:
    element = TRITON_TYPES[dtype]
    types = {name: "i32" for name in _paged_attention_kernel.arg_names}
    types.update(
        {name: f"*{element}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr")}
    )
    types.update(
        block_tables_ptr="*i32",
        seq_lens_ptr="*i32",
        cu_seqlens_q_ptr="*i32",
        partial_out_ptr="*fp32",
        partial_lse_ptr="*fp32",
        scale_log2="fp32",
    )
    return types


def main() -> None:
    for dtype, is_decode, group, head_dim, block_size, splits, family in ATTENTION_VARIANTS:
        config = tile_config(
            family_config(family),
            is_decode=is_decode,
            head_dim_pad=triton.next_power_of_2(head_dim),
        )
        tiles = plan_tiles(
            is_decode=is_decode,
            group=group,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            interpreting=False,
            config=config,
        )
        kernel = compile_kernel(
            _paged_attention_kernel,
            attention_types(dtype),
            {**tiles, "NUM_SPLITS": splits},
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        uses_mma = "mma" in kernel.asm["ptx"]
        name = f"paged_attention {TRITON_TYPES[dtype]} decode={is_decode} group={group} "
        name += f"head_dim={head_dim} block={block_size} splits={splits} family={family}"
        if dtype != torch.float32 and not uses_mma:
            sys.exit(f"{name}: no tensor-core instructions in the PTX")
        if kernel.metadata.shared > SM90_SHARED_BYTES:
            sys.exit(f"{name}: {kernel.metadata.shared} B of shared memory, over sm_90's")
        print(f"{name}: ok (shared {kernel.metadata.shared} B, tensor cores {uses_mma})")
        if splits > 1:
            compile_kernel(
                _merge_splits_kernel,
                {
                    "partial_out_ptr": "*fp32",
                    "partial_lse_ptr": "*fp32",
                    "out_ptr": f"*{TRITON_TYPES[dtype]}",
                    "stride_out_token": "i32",
                    "stride_out_head": "i32",
                },
                {"HEAD_DIM": head_dim, "HEAD_DIM_PAD": tiles["HEAD_DIM_PAD"], "NUM_SPLITS": splits},
            )
            print(f"merge_splits {TRITON_TYPES[dtype]} splits={splits}: ok")

    for dtype, num_kv_heads, head_dim in [(torch.bfloat16, 8, 128), (torch.float16, 3, 80)]:
        element = TRITON_TYPES[dtype]
        types = {name: "i32" for name in _store_kv_kernel.arg_names}
        types.update(
            {name: f"*{element}" for name in ("key_ptr", "value_ptr", "k_cache_ptr", "v_cache_ptr")}
        )
        types["slot_mapping_ptr"] = "*i64"
        compile_kernel(
            _store_kv_kernel,
            types,
            {
                "NUM_KV_HEADS": num_kv_heads,
                "HEAD_DIM": head_dim,
                "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
                "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
                "BLOCK_SIZE": 16,
            },
        )
        print(f"store_kv {element} kv_heads={num_kv_heads} head_dim={head_dim}: ok")

    for bits, fp8 in [(8, True), (4, False), (8, False)]:
        types = {name: "i32" for name in _quant_linear_kernel.arg_names}
        types.update(
            x_ptr="*bf16", codes_ptr="*u8", zeros_ptr="*u8", scales_ptr="*fp32", out_ptr="*bf16"
        )
        kernel = compile_kernel(
            _quant_linear_kernel,
            types,
            {
                "GROUP": 128,
                "BITS": bits,
                "FP8": fp8,
                "DOT_FP32": False,
                "BLOCK_M": 16,
                "BLOCK_N": 64,
                "BLOCK_K": 32,
            },
        )
        name = f"quant_linear bf16 {'fp8' if fp8 else f'int{bits}'}"
        if "mma" not in kernel.asm["ptx"]:
            sys.exit(f"{name}: no tensor-core instructions in the PTX")
        print(f"{name}: ok")


if __name__ == "__main__":
    main()
