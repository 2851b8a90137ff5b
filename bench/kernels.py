"""GPU check of the Triton paged-attention kernel: decode bandwidth and prefill TFLOP/s.

Decode uses Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head dim 128, bf16,
block size 16, shuffled block tables) at batch 1/16/64/256 and context 512..32k. For each point
it prints the Triton kernel's time, achieved bandwidth (bytes of K/V read / time) and its ratio
to the device's peak HBM bandwidth, next to the torch reference (``sluicegate.kernels.reference``, where
its fp32 copies fit) and to ``scaled_dot_product_attention`` on contiguous K/V. Prefill prints
TFLOP/s for a fresh prompt and a chunk after a cached prefix, next to causal SDPA.

    python bench/kernels.py                 # CUDA GPU, < 5 minutes on an H100/H200
    python bench/kernels.py --peak-gbps 3350
    python bench/kernels.py --cpu-smoke     # tiny shapes under the Triton interpreter

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Peak HBM bandwidth (GB/s) by device-name fragment, most specific first.
PEAK_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),
)
TARGET_PEAK_RATIO = 0.70
# The torch reference gathers K/V into fp32 copies; past this many K/V bytes it is skipped.
REFERENCE_MAX_BYTES = 1 << 30


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill: tuple[tuple[int, int, int], ...]  # (requests, query tokens, cached tokens)


LLAMA_8B = Shapes(
    32, 8, 128, 16, (1, 16, 64, 256), (512, 1024, 2048, 4096, 8192, 16384, 32768),
    ((1, 4096, 0), (4, 2048, 0), (2, 2048, 2048)),
)  # fmt: skip
SMOKE = Shapes(4, 2, 64, 16, (1, 4), (64, 128), ((2, 48, 0), (1, 32, 32)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-gbps", type=float, help="device peak memory bandwidth, GB/s")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1"
    )
    args = parser.parse_args()

    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it to time the compiled kernel", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        message = "bench/kernels.py needs a CUDA GPU (none found); use --cpu-smoke to dry-run it"
        print(message, file=sys.stderr)
        print(json.dumps({"error": message}))
        return 2

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes = SMOKE if args.cpu_smoke else LLAMA_8B
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    device_name = "cpu (interpreter)" if args.cpu_smoke else torch.cuda.get_device_name()
    peak_gbps = args.peak_gbps or _known_peak(device_name)
    print(f"device: {device_name}; peak {peak_gbps or 'unknown'} GB/s; dtype {dtype}")

    started = time.perf_counter()
    decode = [
        _decode_point(shapes, batch, context, dtype, device, peak_gbps)
        for context in shapes.contexts
        for batch in shapes.batches
    ]
    prefill = [_prefill_point(shapes, *point, dtype, device) for point in shapes.prefill]

    headline = next((p for p in decode if p["batch"] == 64 and p["context"] == 4096), None)
    summary = {
        "device": device_name,
        "peak_gbps": peak_gbps,
        "dtype": str(dtype).removeprefix("torch."),
        "decode_b64_ctx4k_peak_ratio": headline and headline["triton_peak_ratio"],
        "target_peak_ratio": TARGET_PEAK_RATIO,
        "target_met": bool(
            headline
            and headline["triton_peak_ratio"] is not None
            and headline["triton_peak_ratio"] >= TARGET_PEAK_RATIO
        ),
        "prefill_tflops": max(p["triton_tflops"] for p in prefill),
        "decode": decode,
        "prefill": prefill,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))
    return 0


def _known_peak(device_name: str) -> float | None:
    return next((gbps for fragment, gbps in PEAK_GBPS if fragment in device_name), None)


def _decode_point(shapes, batch, context, dtype, device, peak_gbps) -> dict:
    import torch

    from sluicegate import kernels
    from sluicegate.kernels import reference
    from sluicegate.kernels.triton_paged_attention import default_num_splits

    paged = _paged_batch(shapes, [context] * batch, [1] * batch, dtype, device)
    kv_bytes = (
        2 * batch * context * shapes.num_kv_heads * shapes.head_dim * paged.k_cache.element_size()
    )
    splits = default_num_splits(paged.q, paged.block_tables, shapes.block_size, shapes.num_kv_heads)

    triton_ms = _time_ms(lambda: kernels.paged_attention(*paged.args()), device)
    out = kernels.paged_attention(*paged.args())
    point = {
        "batch": batch,
        "context": context,
        "num_splits": splits,
        "kv_mb": round(kv_bytes / 1e6, 1),
        "triton_ms": round(triton_ms, 4),
        "triton_gbps": round(kv_bytes / triton_ms / 1e6, 1),
        "triton_peak_ratio": peak_gbps and round(kv_bytes / triton_ms / 1e6 / peak_gbps, 3),
    }
    if splits > 1:
        unsplit_ms = _time_ms(lambda: kernels.paged_attention(*paged.args(), num_splits=1), device)
        point["triton_unsplit_ms"] = round(unsplit_ms, 4)

    if kv_bytes <= REFERENCE_MAX_BYTES:
        point["reference_ms"] = round(
            _time_ms(lambda: reference.paged_attention(*paged.args()), device), 4
        )
        expected = reference.paged_attention(*paged.args())
        point["max_abs_err_vs_reference"] = (out.float() - expected.float()).abs().max().item()
    if _fits(device, 2.2 * kv_bytes):
        try:
            q, keys, values = paged.contiguous(shapes)
            sdpa = _sdpa_decode(q, keys, values, paged.softmax_scale)
            sdpa_ms = _time_ms(sdpa, device)
            point["sdpa_ms"] = round(sdpa_ms, 4)
            point["sdpa_gbps"] = round(kv_bytes / sdpa_ms / 1e6, 1)
            point["max_abs_err_vs_sdpa"] = (out.float() - sdpa().float()).abs().max().item()
        except torch.OutOfMemoryError:
            point["sdpa_ms"] = "oom"
    print(
        f"decode b={batch:<4d} ctx={context:<6d} splits={splits:<2d} "
        f"triton {point['triton_ms']:.3f} ms {point['triton_gbps']:8.1f} GB/s "
        f"({point['triton_peak_ratio'] if peak_gbps else 'n/a'} of peak)  "
        f"reference {point.get('reference_ms', 'skipped')} ms  sdpa {point.get('sdpa_ms', 'skipped')} ms"
    )
    return point


def _prefill_point(shapes, requests, q_len, cached, dtype, device) -> dict:
    import torch
    import torch.nn.functional as F

    from sluicegate import kernels

    paged = _paged_batch(shapes, [cached + q_len] * requests, [q_len] * requests, dtype, device)
    # Each query token sees cached + its own position + 1 keys: QK^T and PV, 2 FLOPs per MAC.
    visible = requests * (q_len * cached + q_len * (q_len + 1) / 2)
    flops = 4 * shapes.num_heads * shapes.head_dim * visible
    triton_ms = _time_ms(lambda: kernels.paged_attention(*paged.args()), device)
    point = {
        "requests": requests,
        "q_len": q_len,
        "cached": cached,
        "triton_ms": round(triton_ms, 3),
        "triton_tflops": round(flops / triton_ms / 1e9, 2),
    }
    if cached == 0:
        q, keys, values = paged.contiguous(shapes)
        q = q.view(requests, q_len, shapes.num_heads, shapes.head_dim).transpose(1, 2)

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(
                q, keys, values, is_causal=True, scale=paged.softmax_scale, enable_gqa=True
            )

        sdpa_ms = _time_ms(sdpa, device)
        point["sdpa_ms"] = round(sdpa_ms, 3)
        point["sdpa_tflops"] = round(flops / sdpa_ms / 1e9, 2)
        out = kernels.paged_attention(*paged.args())
        expected = sdpa().transpose(1, 2).reshape(out.shape)
        point["max_abs_err_vs_sdpa"] = (out.float() - expected.float()).abs().max().item()
    print(
        f"prefill {requests}x{q_len} after {cached} cached: triton {point['triton_ms']} ms "
        f"{point['triton_tflops']} TFLOP/s  sdpa {point.get('sdpa_tflops', 'n/a')} TFLOP/s"
    )
    return point


@dataclass
class _PagedBatch:
    q: object
    k_cache: object
    v_cache: object
    block_tables: object
    seq_lens: object
    cu_seqlens_q: object
    softmax_scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            self.softmax_scale,
        )

    def contiguous(self, shapes: Shapes) -> tuple:
        """The same K/V as dense [batch, kv_heads, context, head_dim] tensors, for SDPA."""
        batch, context = self.seq_lens.shape[0], int(self.seq_lens[0])
        blocks = self.block_tables[:, : context // shapes.block_size].long()
        dense = [
            cache[blocks]
            .view(batch, context, shapes.num_kv_heads, shapes.head_dim)
            .transpose(1, 2)
            .contiguous()
            for cache in (self.k_cache, self.v_cache)
        ]
        return self.q, dense[0], dense[1]


def _paged_batch(shapes, seq_lens, q_lens, dtype, device) -> _PagedBatch:
    import torch

    if len(set(seq_lens)) != 1:
        raise ValueError("every request of a bench batch has the same length")
    num_blocks = len(seq_lens) * math.ceil(seq_lens[0] / shapes.block_size)
    cache_shape = (num_blocks, shapes.block_size, shapes.num_kv_heads, shapes.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    # Shuffled blocks: a long-running server's cache is fragmented, not laid out in order.
    order = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    block_tables = order.view(len(seq_lens), -1)
    q = torch.randn(sum(q_lens), shapes.num_heads, shapes.head_dim, dtype=dtype, device=device)
    cu_seqlens_q = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=device)
    cu_seqlens_q[1:] = torch.tensor(q_lens, device=device).cumsum(0)
    return _PagedBatch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables.contiguous(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens_q,
        softmax_scale=shapes.head_dim**-0.5,
    )


def _sdpa_decode(q, keys, values, scale) -> Callable[[], object]:
    import torch.nn.functional as F

    query = q.unsqueeze(2)  # [batch, heads, 1, head_dim]

    def run():
        out = F.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)
        return out.squeeze(2)

    return run


def _fits(device, nbytes: float) -> bool:
    import torch

    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info()
    # Memory the caching allocator holds but no tensor uses is free for this process too.
    free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    return nbytes < 0.9 * free


def _time_ms(fn: Callable[[], object], device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        # do_bench flushes L2 between runs, so small working sets are not timed from cache.
        return do_bench(fn, warmup=10, rep=40, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
