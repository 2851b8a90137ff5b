"""The engine on one GPU at Llama-3.1-8B's shape, next to transformers on the same weights.

One prepared run (at most ~8 minutes on an H100/H200), nothing downloaded: random bf16
weights of Llama-3.1-8B's shape are made on the GPU, once, and shared by both sides (ours
loads them from the transformers model in memory, fusing q/k/v and gate/up as it does from a
checkpoint). It reports:

- ``copy_gbps``: device-to-device copy bandwidth, measured (bytes read + written / time);
- ``single_stream_tok_s`` and ``roofline_fraction``: one request's decode tokens/s (the time
  between two generations differing only in length, so prefill cancels out) against the HBM
  roofline, ``copy_gbps`` / the weight bytes one decode step must read (every parameter but
  the embedding table, of which a step reads one row);
- ``concurrent_tok_s``: output tokens/s of 256 concurrent requests of 1,024 prompt and 128
  output tokens through ``LLM.generate`` (compiled, CUDA graphs; ``--enforce-eager`` not);
- ``hf_static_tok_s``: transformers ``generate`` on the same requests in static batches;
- ``kernels``: the summary line of ``bench/kernels.py``;
- with ``--cases``, more ways to serve the same weights, each with its single-stream and
  concurrent tokens/s: ``tp`` (split over every GPU of the machine, ``tensor_parallel_size``;
  skipped with one GPU), ``fp8`` and ``int4`` (compressed-tensors' ``FP8_DYNAMIC`` and
  ``W4A16`` checkpoints of the weights, made by its own compressor on the host: minutes at
  this size). These write the weights to disk first (the ranks and the compressor read files).

The last line is one JSON object. ``--dry-run`` runs every part on a tiny model on the CPU
(eager, float32, kernels skipped) to check the script itself; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# This script's folder would shadow the `kernels` package with bench/kernels.py.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402

TARGET_ROOFLINE = 0.8
TARGET_CONCURRENT_TOK_S = 12_500  # vLLM's published figure for this model on one H100


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    requests: int
    prompt: int
    output: int
    hf_batch: int


LLAMA_31_8B = Shape(4096, 14336, 32, 32, 8, 128256, 256, 1024, 128, 64)
TINY = Shape(64, 128, 2, 4, 2, 512, 8, 32, 8, 4)


def hf_config(shape: Shape) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def write_folder(folder: Path, config: Any, dtype: torch.dtype) -> None:
    """config.json and a word-level tokenizer over the vocabulary: what the engine reads
    besides the weights (which it takes from memory here)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config.dtype = dtype
    config.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="w0", pad_token="w0", bos_token="w1", eos_token="w2"
    ).save_pretrained(folder)


def make_hf_model(config: Any, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def engine_from_memory(folder: Path, hf_model: Any, options: dict[str, Any]) -> Any:
    """An ``LLM`` whose weights are copied from ``hf_model`` (device to device) instead of
    read from safetensors files, which for 16 GB would dominate the run."""
    import sluicegate.engine.runner.build as engine_build
    from sluicegate.engine import LLM
    from sluicegate.engine.models.loader import ModelConfig, model_class, resolve_dtype

    def load_from_memory(
        path: str | Path,
        device: torch.device,
        dtype: Any = "auto",
        model_impl: str = "native",
        tp: Any = None,
    ) -> Any:
        config = ModelConfig.from_folder(path)
        config.dtype = resolve_dtype(dtype, config, device)
        with torch.device("meta"):
            model = model_class(config)(config)
        model = model.to(dtype=config.dtype).to_empty(device=device)
        model.load_weights(hf_model.state_dict().items())
        return model.eval()

    original = engine_build.load_model
    engine_build.load_model = load_from_memory
    try:
        return LLM(str(folder), **options)
    finally:
        engine_build.load_model = original


def copy_bandwidth_gbps(device: torch.device, nbytes: int) -> float:
    source = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    synchronize(device)
    times = []
    for _ in range(10):
        began = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        times.append(time.perf_counter() - began)
    return 2 * nbytes / min(times) / 1e9


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_weight_bytes(model: Any) -> int:
    """Bytes of parameters one decode step reads: all but the embedding table."""
    embed = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)


def single_stream_tok_s(llm: Any, prompt: list[int], short: int, long: int) -> float:
    from sluicegate.engine import SamplingParams

    def timed(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        began = time.perf_counter()
        (output,) = llm.generate([prompt], params)
        assert len(output.token_ids) == n
        return time.perf_counter() - began

    timed(short)
    best_short = min(timed(short) for _ in range(2))
    best_long = min(timed(long) for _ in range(2))
    return (long - short) / (best_long - best_short)


def concurrent_tok_s(llm: Any, prompts: list[list[int]], output: int) -> float:
    from sluicegate.engine import SamplingParams

    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    llm.generate(prompts[:8], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    began = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - began
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == output * len(prompts)
    return produced / wall


def hf_static_tok_s(model: Any, prompts: list[list[int]], output: int, batch: int) -> float:
    device = next(model.parameters()).device
    with torch.inference_mode():
        warm = torch.tensor(prompts[:1], device=device)
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2)
        synchronize(device)
        began = time.perf_counter()
        for first in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[first : first + batch], device=device)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=output, do_sample=False
            )
            assert out.shape[1] - ids.shape[1] == output
        synchronize(device)
    return output * len(prompts) / (time.perf_counter() - began)


CASES = ("tp", "fp8", "int4")


def layout_figures(
    cases: list[str],
    hf_model: Any,
    options: dict[str, Any],
    shape: Shape,
    prompts: list[list[int]],
    dry_run: bool,
) -> dict[str, Any]:
    """Single-stream and concurrent tokens/s of the same weights split over the GPUs or
    quantized, each case an engine of its own loading a checkpoint from disk."""
    import shutil

    from sluicegate.engine import LLM
    from tests.engine.models.quant.checkpoints import compress

    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        dense = Path(tmp) / "dense"
        hf_model.save_pretrained(dense)
        write_folder(dense, hf_model.config, next(hf_model.parameters()).dtype)
        for case in cases:
            case_options = dict(options)
            folder = dense
            if case == "tp":
                ranks = 2 if dry_run else torch.cuda.device_count()
                if ranks < 2:
                    figures[case] = {"skipped": "tensor parallelism needs 2 or more GPUs"}
                    continue
                case_options["tensor_parallel_size"] = ranks
                # Each rank sizes its own cache; the whole step runs eagerly under TP.
                case_options["enforce_eager"] = True
            else:
                folder = Path(tmp) / case
                preset = "FP8_DYNAMIC" if case == "fp8" else "W4A16"
                compress(
                    dense, folder, preset, group_size=64 if dry_run and case == "int4" else None
                )
                for file in dense.iterdir():
                    if not (folder / file.name).exists():
                        shutil.copy(file, folder / file.name)
            llm = LLM(str(folder), **case_options)
            try:
                single = single_stream_tok_s(llm, prompts[0][:128], shape.output // 4, shape.output)
                concurrent = concurrent_tok_s(llm, prompts, shape.output)
            finally:
                llm.close()
            figures[case] = {
                "single_stream_tok_s": round(single, 1),
                "concurrent_tok_s": round(concurrent, 1),
                **({"ranks": case_options["tensor_parallel_size"]} if case == "tp" else {}),
            }
            del llm
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return figures


def kernel_figures(dry_run: bool) -> dict[str, Any] | None:
    if dry_run:
        return None
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(_HERE / "kernels.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"bench/kernels.py exited {done.returncode}: {done.stderr[-500:]}"}
    summary = json.loads(lines[-1])
    summary.pop("decode", None)
    summary.pop("prefill", None)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument(
        "--cases",
        default="",
        help=f"comma-separated extra cases among {', '.join(CASES)} (default: none)",
    )
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases: {', '.join(unknown)}")
    if not args.dry_run and not torch.cuda.is_available():
        print(json.dumps({"error": "bench/gpu.py needs a CUDA GPU; --dry-run checks it on CPU"}))
        return 2
    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    shape = TINY if args.dry_run else LLAMA_31_8B
    started = time.perf_counter()
    result: dict[str, Any] = {
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(),
        "dtype": str(dtype).removeprefix("torch."),
        "model": "tiny" if args.dry_run else "llama-3.1-8b-shape",
    }

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {what}", flush=True)

    result["copy_gbps"] = round(copy_bandwidth_gbps(device, 1 << (24 if args.dry_run else 31)), 1)
    progress(f"copy bandwidth {result['copy_gbps']} GB/s")
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape.vocab, (shape.requests, shape.prompt), generator=generator)
    prompt_lists = prompts.tolist()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        config = hf_config(shape)
        write_folder(folder, config, dtype)
        hf_model = make_hf_model(config, device, dtype)
        progress("random weights made")
        weight_bytes = decode_weight_bytes(hf_model)
        options: dict[str, Any] = {
            "device": device.type,
            "dtype": str(dtype).removeprefix("torch."),
            "max_num_seqs": shape.requests,
            "max_num_batched_tokens": 8192 if not args.dry_run else 256,
            "max_model_len": shape.prompt + shape.output + 256,
            "enforce_eager": args.enforce_eager or args.dry_run,
        }
        if args.dry_run:
            options["num_kv_blocks"] = 256
        llm = engine_from_memory(folder, hf_model, options)
        progress("engine ready (compiled and graphs captured unless eager)")
        single = single_stream_tok_s(llm, prompt_lists[0][:128], shape.output // 4, shape.output)
        roofline = result["copy_gbps"] * 1e9 / weight_bytes
        result.update(
            single_stream_tok_s=round(single, 1),
            roofline_tok_s=round(roofline, 1),
            roofline_fraction=round(single / roofline, 3),
            weight_bytes_per_token=weight_bytes,
        )
        progress(f"single stream {single:.1f} tok/s ({single / roofline:.2f} of roofline)")
        result["concurrent_tok_s"] = round(concurrent_tok_s(llm, prompt_lists, shape.output), 1)
        progress(f"{shape.requests} concurrent: {result['concurrent_tok_s']} tok/s")
        del llm
        gc.collect()  # the engine's KV cache and graph pool, before transformers runs
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if cases:
            result["cases"] = layout_figures(
                cases, hf_model, options, shape, prompt_lists, args.dry_run
            )
            progress(f"cases: {result['cases']}")
        result["hf_static_tok_s"] = round(
            hf_static_tok_s(hf_model, prompt_lists, shape.output, shape.hf_batch), 1
        )
        result["hf_static_batch"] = shape.hf_batch
        progress(f"transformers static x{shape.hf_batch}: {result['hf_static_tok_s']} tok/s")
        del hf_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["kernels"] = kernel_figures(args.dry_run)
    result.update(
        requests=shape.requests,
        prompt_tokens=shape.prompt,
        output_tokens=shape.output,
        target_roofline_fraction=TARGET_ROOFLINE,
        target_concurrent_tok_s=TARGET_CONCURRENT_TOK_S,
        enforce_eager=bool(options["enforce_eager"]),
        wall_s=round(time.perf_counter() - started, 1),
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
