"""Async scheduling (issue 12, point 6): step N+1 is scheduled and prepared while step N's
tokens are still placeholders, then step N is completed. Outputs must be exactly those of
the synchronous loop, whatever ends a request (EOS, stop token, stop string, length) and
whatever the batch mixes: seeds, penalties, logprobs, n > 1, chunked prefill, preemption."""

from __future__ import annotations

from pathlib import Path

import torch

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.core.scheduler import PLACEHOLDER
from sluicegate.engine.serving.request_options import RequestOptions

MAX_TOKEN_ID = 256


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = [1, 5, 17, 40, 90, 130, 7, 64, 33, 200]
    return [torch.randint(3, MAX_TOKEN_ID, (n,), generator=generator).tolist() for n in lengths]


def params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=30, temperature=0),
        SamplingParams(max_tokens=25, temperature=0.9, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[97, 98, 99, 100, 101]),
        SamplingParams(max_tokens=35, temperature=0, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.7, top_p=0.8, seed=5, logprobs=2),
        SamplingParams(max_tokens=45, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=1.0, top_k=20, seed=3, stop=["e"]),
        SamplingParams(max_tokens=50, temperature=0, min_p=0.1, ignore_eos=True),
        SamplingParams(max_tokens=28, temperature=0, presence_penalty=0.5),
    ]


def run(model: Path, async_scheduling: bool) -> tuple[list[tuple], LLM]:
    llm = LLM(
        str(model),
        num_kv_blocks=24,
        max_num_batched_tokens=48,
        dtype="float32",
        async_scheduling=async_scheduling,
    )
    outputs = llm.generate(prompts(), params())
    summary = [
        (o.token_ids, o.text, o.finish_reason, [(lp.token_id, lp.top) for lp in o.logprobs or []])
        for o in outputs
    ]
    return summary, llm


def test_outputs_equal_the_synchronous_loop(llama_dir: Path) -> None:
    sync, _ = run(llama_dir, async_scheduling=False)
    overlapped, llm = run(llama_dir, async_scheduling=True)
    assert overlapped == sync
    assert llm.stats()["num_preemptions"] > 0
    reasons = {reason for _, _, reason, _ in sync}
    assert {"stop", "length"} <= reasons


def test_steps_really_overlap(llama_dir: Path) -> None:
    """After a step returns, the one it launched is still in flight, its sampled tokens
    placeholders on the host; requests that stop early waste at most one row."""
    llm = LLM(str(llama_dir), num_kv_blocks=64, dtype="float32", async_scheduling=True)
    engine = llm.engine
    for index, prompt in enumerate(prompts()[:4]):
        engine.add_request(f"r{index}", prompt, SamplingParams(max_tokens=6, temperature=0))
    overlapped = 0
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
        in_flight = engine._in_flight
        if in_flight is not None:
            overlapped += 1
            pending = [item.seq for item in in_flight.sampling_items]
            assert all(seq.token_ids[-1] == PLACEHOLDER for seq in pending if seq.num_tokens)
    assert overlapped >= 5
    assert all(PLACEHOLDER not in d.token_ids for d in deltas)
    done = [d for d in deltas if d.done]
    assert len(done) == 4


def choices(model: Path, async_scheduling: bool) -> dict[tuple[str, int], list[int]]:
    llm = LLM(str(model), num_kv_blocks=64, dtype="float32", async_scheduling=async_scheduling)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=2)
    for index, prompt in enumerate(prompts()[:3]):
        engine.add_request(f"r{index}", prompt, params, RequestOptions(n=3))
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault((delta.request_id, delta.index), []).extend(delta.token_ids)
    return tokens


def test_n_choices_equal_the_synchronous_loop(llama_dir: Path) -> None:
    """The step that forks a request's choices completes before the next is scheduled."""
    want = choices(llama_dir, async_scheduling=False)
    assert len(want) == 9
    assert choices(llama_dir, async_scheduling=True) == want


def test_abort_while_its_step_is_in_flight(llama_dir: Path) -> None:
    """An abort between steps ends the request at once; its step still on the device is
    dropped when completed, and its batch mates go on exactly as without it."""

    def run(abort_at: int | None) -> tuple[list[int], list]:
        llm = LLM(str(llama_dir), num_kv_blocks=64, dtype="float32", async_scheduling=True)
        engine = llm.engine
        for name, prompt in (("victim", prompts()[3]), ("mate", prompts()[4])):
            engine.add_request(name, prompt, SamplingParams(max_tokens=10, temperature=0))
        mate: list[int] = []
        victim = []
        steps = 0
        while engine.has_unfinished():
            if steps == abort_at:
                assert engine._in_flight is not None
                victim += engine.abort("victim")
            for delta in engine.step():
                if delta.request_id == "mate":
                    mate.extend(delta.token_ids)
                else:
                    victim.append(delta)
            steps += 1
        return mate, victim

    alone, _ = run(None)
    mate, victim = run(3)
    assert mate == alone
    assert victim[-1].finish_reason == "abort" and victim[-1].done
    assert sum(d.done for d in victim) == 1
