"""One checkpoint served four ways on the CPU, side by side: SmolLM2-135M-Instruct in bfloat16,
its compressed-tensors FP8 (``FP8_DYNAMIC``) and W4A16 (int4, groups of 64) checkpoints made by
the ecosystem's own tool, and the bfloat16 model split over two tensor-parallel ranks (gloo).

Each engine decodes the same chat prompts, greedy, single stream (one request at a time) and as
one batch of ``--batch`` requests; the engines take turns workload by workload, ``--rounds``
times, and the best round of each counts. On a 2-core machine two ranks share the two cores
the single rank has to itself, so TP=2 is not expected to be faster here: it is measured to
show its cost, not to win.

The last line is one JSON object: ``{variant}_{single,batch}_tok_s`` for variants ``bf16``,
``fp8``, ``int4``, ``bf16_tp2``, their ratios to ``bf16`` and each model's weight bytes.

    python bench/weights_layout.py --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# bench/kernels.py would shadow the `kernels` package the engine imports; the repository root
# holds the tests' checkpoint maker (compressed-tensors' own compressor, as the tests use it).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from sluicegate.engine import LLM, SamplingParams  # noqa: E402
from sluicegate.engine.demo_model import create_smollm2  # noqa: E402

QUESTIONS = [
    "Explain how a water mill works, step by step.",
    "Write a short story about a lighthouse keeper.",
    "List ten uses of a river for a town.",
    "What is the capital of France, and why is it famous?",
]


def checkpoints(root: Path) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    from tests.engine.models.quant.checkpoints import compress

    dense = create_smollm2(root / "SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(dense)
    bf16 = root / "bf16"
    model.to(torch.bfloat16).save_pretrained(bf16)
    folders = {"bf16": bf16}
    for name, preset in (("fp8", "FP8_DYNAMIC"), ("int4", "W4A16")):
        folder = root / name
        compress(dense, folder, preset, group_size=64 if preset == "W4A16" else None)
        folders[name] = folder
    for folder in folders.values():
        for file in dense.iterdir():
            if not (folder / file.name).exists():
                shutil.copy(file, folder / file.name)
    return folders


def weight_bytes(llm: LLM) -> int:
    model = llm.engine.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def tok_s(llm: LLM, prompts: list[list[int]], params: SamplingParams, together: bool) -> float:
    began = time.perf_counter()
    if together:
        outputs = llm.generate(prompts, params)
    else:
        outputs = [llm.generate(p, params)[0] for p in prompts]
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - began)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as scratch:
        folders = checkpoints(Path(scratch))
        engines = {
            "bf16": LLM(str(folders["bf16"]), dtype="bfloat16", num_kv_blocks=256),
            "fp8": LLM(str(folders["fp8"]), dtype="bfloat16", num_kv_blocks=256),
            "int4": LLM(str(folders["int4"]), dtype="bfloat16", num_kv_blocks=256),
            "bf16_tp2": LLM(
                str(folders["bf16"]), dtype="bfloat16", num_kv_blocks=256, tensor_parallel_size=2
            ),
        }
        try:
            first = engines["bf16"]
            chats = [
                first.engine.prompt_ids(messages=[{"role": "user", "content": q}])
                for q in QUESTIONS
            ]
            batch = [chats[i % len(chats)] for i in range(args.batch)]
            best: dict[str, float] = {}
            for round_index in range(args.rounds):
                for workload, prompts, together in (
                    ("single", chats[:2], False),
                    ("batch", batch, True),
                ):
                    for name, llm in engines.items():
                        figure = tok_s(llm, prompts, params, together)
                        key = f"{name}_{workload}_tok_s"
                        best[key] = max(best.get(key, 0.0), figure)
                        print(f"round {round_index} {key}: {figure:.1f}", flush=True)
            result: dict[str, Any] = {k: round(v, 1) for k, v in best.items()}
            for name in ("fp8", "int4", "bf16_tp2"):
                for workload in ("single", "batch"):
                    base = best[f"bf16_{workload}_tok_s"]
                    result[f"{name}_{workload}_vs_bf16"] = round(
                        best[f"{name}_{workload}_tok_s"] / base, 3
                    )
            for name in ("bf16", "fp8", "int4"):
                result[f"{name}_weight_bytes"] = weight_bytes(engines[name])
            result["cpu_count"] = os.cpu_count()
        finally:
            for llm in engines.values():
                llm.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
