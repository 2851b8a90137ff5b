"""Acceptance 4 (issue 12): a decode step reads the device once, whatever the batch mixes
(greedy, temperature, top-k/top-p/min-p, seeds, penalties, logit bias, logprobs), and the
step path has no other device-to-host read than ``sluicegate.engine.runner.readback.to_host``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.runner.readback import num_reads

STEP_PATH = [
    "sluicegate/engine/runner/model_runner.py",
    "sluicegate/engine/runner/input_batch.py",
    "sluicegate/engine/sample/sampler.py",
    "sluicegate/engine/sample/slots.py",
    "sluicegate/engine/sample/output.py",
    "sluicegate/engine/sample/batched.py",
    "sluicegate/engine/runner/cuda_graphs.py",
    "sluicegate/engine/runner/compilation.py",
    "sluicegate/engine/runner/staging.py",
    "sluicegate/engine/core/scheduler.py",
    "sluicegate/engine/serving/core.py",
    "sluicegate/engine/serving/speculation.py",
    "sluicegate/engine/sample/speculative.py",
    "sluicegate/kernels/triton_paged_attention.py",
    "sluicegate/kernels/attention_launch.py",
    "sluicegate/kernels/triton_store_kv.py",
]
# Each of these makes the host wait for the device when the tensor lives on a GPU.
DEVICE_READS = re.compile(
    r"\.(tolist|item|cpu)\(\)|\b(int|float|bool)\(\w+\.(any|all|max|min|sum)\("
)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_one_device_read_per_step_for_a_mixed_batch(
    llama_dir: Path, async_scheduling: bool
) -> None:
    """With async scheduling the first step only launches; every later one reads once."""
    llm = LLM(str(llama_dir), num_kv_blocks=128, dtype="float32", async_scheduling=async_scheduling)
    engine = llm.engine
    mixed = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=12, min_p=0.1, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=12, repetition_penalty=1.3, logit_bias={7: 5.0}, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True),
    ]
    for index, params in enumerate(mixed):
        engine.add_request(f"r{index}", list(range(10 + index, 30 + 2 * index)), params)
    reads_per_step = []
    while engine.has_unfinished():
        before = num_reads()
        engine.step()
        reads_per_step.append(num_reads() - before)
    assert len(reads_per_step) >= 12
    if async_scheduling:
        assert reads_per_step[0] == 0
        reads_per_step = reads_per_step[1:]
    assert set(reads_per_step) == {1}


def test_the_step_path_reads_the_device_only_through_readback() -> None:
    root = Path(__file__).resolve().parents[3]
    offenders = [
        f"{name}:{number}: {line.strip()}"
        for name in STEP_PATH
        for number, line in enumerate((root / name).read_text().splitlines(), 1)
        if DEVICE_READS.search(line)
    ]
    assert offenders == []
