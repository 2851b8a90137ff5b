"""Output tokens/s of the engine vs transformers, on this CPU (issue 2, acceptance 5).

A random Llama of realistic small shape (4 layers, hidden 512, 8 heads, vocab 32000, float32)
serves a seeded workload of 64 requests whose prompt and output lengths are each uniform in
32..256, greedy with ignore_eos, three ways, side by side in one run:

- engine: all 64 submitted at once to ``LLM.generate`` (continuous batching, paged KV);
- transformers one request at a time (``generate`` per request);
- transformers static batches of 16 in submission order, left-padded to the longest prompt,
  each batch generating the longest output it contains; only each request's wanted tokens
  count as output.

The last line is one JSON object: engine_tok_s, hf_serial_tok_s, hf_static_tok_s,
ratio_vs_serial, ratio_vs_static, peak_kv_utilization. ``--model-impl transformers`` runs the
engine with the checkpoint's transformers class on our paged attention (issue 14) and, on the
same workload in the same run, with the native Llama, adding native_tok_s and
transformers_slowdown (native / transformers backend) to the JSON. All three runs use the same torch
thread count (``--threads``, default every core). The model has 8 query heads over 2 KV heads
(grouped-query attention in Llama 3's 4:1 ratio) and intermediate size 1408.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning. On a CPU shared with other busy processes,
# spinning threads steal time from the one thread every op is waiting for, and both the
# engine and transformers ran several times slower (and erratically) with the default policy.
# Set before torch loads OpenMP; it applies to all three runs alike.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Python puts this script's folder first on sys.path, where bench/kernels.py would shadow the
# `kernels` package the engine imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from sluicegate.engine import LLM, SamplingParams  # noqa: E402

VOCAB_SIZE = 32000


def build_model(folder: Path, layers: int) -> None:
    """Random weights saved as a Hugging Face folder, with a word-level tokenizer covering
    the whole vocabulary (the workload is token ids; text only needs to decode)."""
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().eval().save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(VOCAB_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="w0", pad_token="w0", bos_token="w1", eos_token="w2"
    ).save_pretrained(folder)


def workload(num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len, output_len = rng.randint(32, 256), rng.randint(32, 256)
        requests.append(([rng.randrange(3, VOCAB_SIZE) for _ in range(prompt_len)], output_len))
    return requests


def run_engine(
    folder: Path,
    requests: list[tuple[list[int], int]],
    threads: int,
    model_impl: str = "native",
    cpu_compile: bool = False,
) -> tuple[float, float]:
    llm = LLM(
        str(folder),
        dtype="float32",
        device="cpu",
        num_threads=threads,
        model_impl=model_impl,
        cpu_compile=cpu_compile,
    )
    warmup = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([p for p, _ in requests[:4]], warmup)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outputs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == sum(n for _, n in requests), "engine produced a wrong number of tokens"
    return produced / elapsed, llm.stats()["peak_kv_utilization"]


def load_hf(folder: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # Generate exactly max_new_tokens, as ignore_eos does (EOS neither stops nor is banned).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_hf_serial(model: LlamaForCausalLM, requests: list[tuple[list[int], int]]) -> float:
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for prompt, wanted in requests:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=wanted, do_sample=False
            )
            produced += out.shape[1] - len(prompt)
    return produced / (time.perf_counter() - start)


def run_hf_static(
    model: LlamaForCausalLM, requests: list[tuple[list[int], int]], batch_size: int
) -> float:
    start = time.perf_counter()
    wanted_total = 0
    with torch.inference_mode():
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for row, (prompt, _) in enumerate(batch):
                ids[row, width - len(prompt) :] = torch.tensor(prompt)
                mask[row, width - len(prompt) :] = 1
            longest = max(n for _, n in batch)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest, do_sample=False)
            assert out.shape[1] - width == longest
            wanted_total += sum(n for _, n in batch)
    return wanted_total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--skip-hf", action="store_true", help="engine only (quick profiling)")
    parser.add_argument(
        "--model-impl",
        choices=("native", "transformers"),
        default="native",
        help="transformers: the engine runs the transformers class on our paged attention, "
        "and is compared with the native engine on the same workload",
    )
    parser.add_argument(
        "--cpu-compile",
        action="store_true",
        help="also run the engine with its forward through torch.compile, next to eager",
    )
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads, all runs"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    requests = workload(args.requests, args.seed)
    print(
        f"{len(requests)} requests, {sum(len(p) for p, _ in requests)} prompt tokens, "
        f"{sum(n for _, n in requests)} output tokens; torch threads {torch.get_num_threads()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, args.layers)
        engine_tok_s, peak_kv = run_engine(folder, requests, args.threads, args.model_impl)
        print(
            f"engine ({args.model_impl}): {engine_tok_s:8.1f} output tok/s (peak KV {peak_kv:.3f})"
        )
        native: dict[str, float] = {}
        if args.cpu_compile:
            compiled_tok_s, _ = run_engine(
                folder, requests, args.threads, args.model_impl, cpu_compile=True
            )
            native["compiled_tok_s"] = round(compiled_tok_s, 1)
            native["compile_speedup"] = round(compiled_tok_s / engine_tok_s, 2)
            print(f"engine compiled: {compiled_tok_s:8.1f} output tok/s")
        if args.model_impl == "transformers":
            native_tok_s, _ = run_engine(folder, requests, args.threads, "native")
            native.update(
                native_tok_s=round(native_tok_s, 1),
                transformers_slowdown=round(native_tok_s / engine_tok_s, 2),
            )
            print(
                f"engine (native): {native_tok_s:8.1f} output tok/s; the transformers backend "
                f"is {native['transformers_slowdown']}x slower"
            )
        if args.skip_hf:
            print(
                json.dumps(
                    {
                        "model_impl": args.model_impl,
                        "engine_tok_s": round(engine_tok_s, 1),
                        **native,
                    }
                )
            )
            return
        model = load_hf(folder)
        static_tok_s = run_hf_static(model, requests, args.static_batch)
        print(f"transformers static x{args.static_batch}:   {static_tok_s:8.1f} output tok/s")
        serial_tok_s = run_hf_serial(model, requests)
        print(f"transformers one at a time: {serial_tok_s:8.1f} output tok/s")
    result = {
        "engine_tok_s": round(engine_tok_s, 1),
        "hf_serial_tok_s": round(serial_tok_s, 1),
        "hf_static_tok_s": round(static_tok_s, 1),
        "ratio_vs_serial": round(engine_tok_s / serial_tok_s, 2),
        "ratio_vs_static": round(engine_tok_s / static_tok_s, 2),
        "peak_kv_utilization": round(peak_kv, 4),
        "requests": len(requests),
        "output_tokens": sum(n for _, n in requests),
        "model_impl": args.model_impl,
        **native,
    }
    print(
        f"engine vs one at a time: {result['ratio_vs_serial']}x, vs static: {result['ratio_vs_static']}x"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
