"""Host CPU time per decode step, phase by phase (issue 12, point 4 and the served gap).

A random Llama of small shape (``--layers`` layers, hidden 512, 8 query heads over 2 KV
heads, vocab 32000, float32) runs ``--seqs`` requests that all decode together (prompts
of 64 tokens, ``--steps`` output tokens each, ignore_eos). After the prompts are in, each
decode step's CPU time (``time.thread_time``, torch on one thread so the forward's work is
in this thread too) is split into the engine's phases: schedule, input preparation, forward
and LM head, sampling, scheduler postprocess, and per-request output (``LiveChoices.advance``:
detokenize, stop strings, deltas). ``--sampling mixed`` gives the requests a mix of
temperature, top-k/top-p/min-p, seeds, penalties and logprobs instead of all greedy.

The last line is one JSON object: per phase its median microseconds per step, plus
host_us (everything but the forward) and step_us (the whole step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# bench/kernels.py would shadow the engine's `kernels` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402

from bench.engine_throughput import build_model  # noqa: E402
from sluicegate.engine import LLM, SamplingParams  # noqa: E402

try:
    from sluicegate.engine.sample.output import SampledBatch
except ImportError:  # older engines
    SampledBatch = None  # type: ignore[assignment,misc]


def mixed_params(index: int, steps: int) -> SamplingParams:
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_k=50),
        dict(temperature=1.0, top_p=0.9, seed=index),
        dict(temperature=0.7, min_p=0.05, presence_penalty=0.5),
        dict(temperature=0, repetition_penalty=1.2),
        dict(temperature=0, logprobs=2),
    ]
    return SamplingParams(max_tokens=steps, ignore_eos=True, **kinds[index % len(kinds)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--sampling", choices=("greedy", "mixed"), default="greedy")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_model(folder, args.layers)
        llm = LLM(str(folder), dtype="float32", device="cpu", num_threads=1)
        engine = llm.engine
        spent: dict[str, float] = defaultdict(float)

        def timed(owner: Any, name: str, phase: str) -> None:
            inner: Callable[..., Any] = getattr(owner, name)

            def wrapper(*a: Any, **k: Any) -> Any:
                began = time.thread_time()
                try:
                    return inner(*a, **k)
                finally:
                    spent[phase] += time.thread_time() - began

            setattr(owner, name, wrapper)

        timed(engine.scheduler, "schedule", "schedule")
        timed(engine.runner.input_batch, "prepare", "prepare")
        timed(engine.runner, "run", "run")
        if hasattr(engine, "choices"):
            timed(engine.choices, "advance", "advance")
        else:  # older engines (comparisons across commits)
            timed(engine, "_advance", "advance")
        if hasattr(engine.scheduler, "advance"):  # a step launched, then completed
            timed(engine.scheduler, "advance", "postprocess")
            timed(engine.scheduler, "record", "postprocess")
            timed(engine.sampler, "sample", "sample")
            timed(SampledBatch, "read", "sample")
        else:  # older engines (comparisons across commits)
            timed(engine.scheduler, "postprocess", "postprocess")
            timed(engine.sampler, "__call__", "sample")
            # Instance attributes do not reach a dunder call: route the engine through one.
            engine.sampler = engine.sampler.__call__  # type: ignore[assignment]

        for index in range(args.seqs):
            params = (
                mixed_params(index, args.steps)
                if args.sampling == "mixed"
                else SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
            )
            prompt = [(7 * index + 13 * j) % 31000 + 3 for j in range(64)]
            engine.add_request(f"r{index}", prompt, params)
        per_step: dict[str, list[float]] = defaultdict(list)
        while engine.has_unfinished():
            spent.clear()
            began = time.thread_time()
            engine.step()
            total = time.thread_time() - began
            if engine.scheduler.num_running != args.seqs or not spent.get("sample"):
                continue  # the prefill and the tail are not decode steps of the full batch
            forward = spent["run"] - spent["prepare"]
            per_step["step"].append(total)
            per_step["forward"].append(forward)
            per_step["host"].append(total - forward)
            for phase in ("schedule", "prepare", "sample", "postprocess", "advance"):
                per_step[phase].append(spent[phase])
        result = {
            f"{phase}_us": round(statistics.median(values) * 1e6, 1)
            for phase, values in per_step.items()
        }
        result.update(steps=len(per_step["step"]), seqs=args.seqs, sampling=args.sampling)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
