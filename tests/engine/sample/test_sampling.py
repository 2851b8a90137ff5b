"""Acceptance 3 (sampling): distributions of temperature/top-k/top-p/min-p, seeded draws that
ignore batch mates and preemption, penalties and logprobs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.sample.batched import PenaltyCounts
from sluicegate.engine.sample.sampler import Sampler
from sluicegate.engine.sample.slots import BatchRows

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])
DRAWS = 20_000


def seq(params: SamplingParams, tokens: list[int] | None = None, prompt_len: int = 1) -> Sequence:
    tokens = tokens or [0]
    sequence = Sequence("s", tokens[:prompt_len], params)
    for token in tokens[prompt_len:]:
        sequence.append_token(token)
    return sequence


def draw(params: SamplingParams, probs: torch.Tensor = PROBS) -> torch.Tensor:
    """Token frequencies over DRAWS independent rows sampled in one batch."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = probs.log().expand(DRAWS, -1).clone()
    tokens = sampler(logits, [seq(params)] * DRAWS).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(probs)).double() / DRAWS


def assert_matches(freqs: torch.Tensor, expected: torch.Tensor) -> None:
    """Each frequency within 5 standard errors of its expected probability; zeros exact."""
    expected = expected.double() / expected.sum()
    for token, (f, p) in enumerate(zip(freqs.tolist(), expected.tolist(), strict=True)):
        if p == 0:
            assert f == 0, f"token {token} is outside the allowed set but was drawn"
        else:
            assert abs(f - p) < 5 * math.sqrt(p * (1 - p) / DRAWS) + 1e-9, (token, f, p)


def test_plain_sampling_follows_the_distribution() -> None:
    assert_matches(draw(SamplingParams(temperature=1.0)), PROBS)


def test_temperature_sharpens_and_flattens() -> None:
    assert_matches(draw(SamplingParams(temperature=0.5)), PROBS**2)
    assert_matches(draw(SamplingParams(temperature=2.0)), PROBS**0.5)


def test_top_k() -> None:
    expected = PROBS.clone()
    expected[3:] = 0
    assert_matches(draw(SamplingParams(top_k=3)), expected)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    # 0.4 + 0.25 = 0.65 < 0.7, so the nucleus needs the third token too.
    expected = PROBS.clone()
    expected[3:] = 0
    assert_matches(draw(SamplingParams(top_p=0.7)), expected)


def test_min_p_floor_is_relative_to_the_top_token() -> None:
    # floor = 0.3 * 0.4 = 0.12: tokens at 0.1 and below go.
    expected = PROBS.clone()
    expected[3:] = 0
    assert_matches(draw(SamplingParams(min_p=0.3)), expected)


def test_top_k_and_top_p_combine() -> None:
    expected = PROBS.clone()
    expected[2:] = 0
    assert_matches(draw(SamplingParams(top_k=4, top_p=0.5)), expected)


def test_greedy_takes_the_argmax() -> None:
    freqs = draw(SamplingParams(temperature=0))
    assert freqs[0] == 1.0


@pytest.mark.parametrize("temperature", [1e-50, 1e-40, 1e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    # 1e-50 is 0 in float32; 1e-40 a float32 subnormal that overflows the logits to inf.
    assert draw(SamplingParams(temperature=temperature))[0] == 1.0


@pytest.mark.parametrize("top_p", [1e-50, 1e-9])
def test_a_vanishing_top_p_keeps_the_top_token(top_p: float) -> None:
    # A top_p float32 reads as 0 once kept nothing and failed the step of every request.
    assert draw(SamplingParams(temperature=0.8, top_p=top_p))[0] == 1.0


def test_seeded_draw_ignores_batch_mates() -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    seeded = seq(SamplingParams(seed=1234), [1, 2, 3], prompt_len=2)
    alone = Sampler(torch.device("cpu")).__call__(logits[:1], [seeded]).token_ids[0]
    mates = [seq(SamplingParams()), seq(SamplingParams(seed=99)), seq(SamplingParams(top_k=5))]
    for position in range(3):
        batch = torch.cat([logits[1 : 1 + position], logits[:1], logits[1 + position :]])
        members = [*mates[:position], seeded, *mates[position:]]
        tokens = Sampler(torch.device("cpu")).__call__(batch, members).token_ids
        assert tokens[position] == alone


def test_seeded_draws_follow_the_distribution_across_positions() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = PROBS.log()[None, :]
    tokens = []
    sequence = seq(SamplingParams(seed=7))
    for _ in range(4000):
        token = sampler(logits, [sequence]).token_ids[0]
        tokens.append(token)
        sequence.append_token(token)
    freqs = torch.bincount(torch.tensor(tokens), minlength=len(PROBS)).double() / 4000
    assert (freqs - PROBS.double()).abs().max() < 0.04


def test_presence_frequency_and_repetition_penalties() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    # prompt [3], outputs [1, 1, 2]
    history = [3, 1, 1, 2]
    sampler = Sampler(torch.device("cpu"))

    def greedy_logits(params: SamplingParams) -> torch.Tensor:
        out = sampler(logits.clone(), [seq(params, history, prompt_len=1)])
        return out

    params = SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.5, logprobs=0)
    # token 4 (3.0) is untouched and stays the argmax
    assert greedy_logits(params).token_ids == [4]

    def penalized(params: SamplingParams) -> torch.Tensor:
        counts = PenaltyCounts(1, 5, torch.device("cpu"))
        counts.reset_row(0, history[:1], history[1:])
        return counts.apply(
            logits.clone(),
            torch.tensor([0]),
            torch.tensor([params.presence_penalty]),
            torch.tensor([params.frequency_penalty]),
            torch.tensor([params.repetition_penalty]),
        )[0]

    row = penalized(params)
    assert torch.allclose(row, torch.tensor([1.0, 2.0 - 1.5 - 1.0, -1.0 - 1.5 - 0.5, 0.5, 3.0]))

    row = penalized(SamplingParams(repetition_penalty=2.0))
    # seen tokens 1, 2, 3 (prompt included): positive logits halve, negative ones double
    assert torch.allclose(row, torch.tensor([1.0, 1.0, -2.0, 0.25, 3.0]))

    # a strong frequency penalty moves greedy off a token the output keeps repeating
    history = [0, 4, 4, 4]
    out = sampler(
        logits.clone(), [seq(SamplingParams(temperature=0, frequency_penalty=2.0), history)]
    )
    assert out.token_ids == [1]


def test_logprobs_are_the_raw_model_distribution() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, logprobs=2, presence_penalty=2.0)
    out = Sampler(torch.device("cpu"))(logits, [seq(params, [0, 1], prompt_len=1)])
    expected = torch.log_softmax(logits[0], dim=-1)
    (entry,) = out.logprobs
    assert entry is not None
    # the penalty moved greedy to token 2, but logprobs report the model's own numbers
    assert entry.token_id == out.token_ids[0] == 2
    assert entry.logprob == pytest.approx(expected[2].item())
    assert [t for t, _ in entry.top] == [1, 2]
    assert entry.top[0][1] == pytest.approx(expected[1].item())


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"temperature": -1},
        {"top_p": 0},
        {"top_k": 0},
        {"min_p": 1.5},
        {"presence_penalty": 3},
        {"repetition_penalty": 0},
        {"logprobs": -1},
    ],
)
def test_invalid_params_are_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_seeded_request_same_alone_with_mates_and_after_preemption(llama_dir: Path) -> None:
    prompt = list(range(10, 50))
    seeded = SamplingParams(max_tokens=40, temperature=1.0, top_p=0.95, seed=2024, ignore_eos=True)
    alone = LLM(str(llama_dir), num_kv_blocks=256).generate([prompt], seeded)[0].token_ids

    mates = [list(range(60, 60 + n)) for n in (5, 90, 33, 120)]
    busy = SamplingParams(max_tokens=60, temperature=1.0, ignore_eos=True)
    llm = LLM(str(llama_dir), num_kv_blocks=256)
    outputs = llm.generate(
        [mates[0], mates[1], prompt, mates[2], mates[3]], [busy, busy, seeded, busy, busy]
    )
    assert outputs[2].token_ids == alone

    # 20 blocks cannot hold all five at once: younger requests get preempted and recomputed.
    tight = LLM(str(llama_dir), num_kv_blocks=20, enable_prefix_caching=False)
    outputs = tight.generate([mates[1], prompt, mates[3], mates[2]], [busy, seeded, busy, busy])
    assert tight.stats()["num_preemptions"] > 0
    assert outputs[1].token_ids == alone


def test_penalty_counts_follow_penalized_requests_not_batch_rows() -> None:
    """Counts take device memory per penalized request, not per batch row, and a row's new
    occupant starts from its own history, not its predecessor's."""
    sampler = Sampler(torch.device("cpu"), max_rows=256)
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(temperature=0, frequency_penalty=2.0)

    def draw(sequence: Sequence, generation: int) -> int:
        rows = BatchRows(np.array([7]), np.array([generation]), np.array([sequence.num_tokens]))
        return sampler.sample(logits.clone(), [sequence], None, rows).read().token_ids[0]

    first = seq(params, [0, 4, 4, 4])  # outputs 4 4 4: token 4 is penalised away
    assert draw(first, 1) == 1
    assert sampler._penalties is not None and sampler._penalties.counts.shape[0] == 8
    # Row 7's next occupant has no history: its argmax is the raw one.
    assert draw(seq(params, [0]), 2) == 4
