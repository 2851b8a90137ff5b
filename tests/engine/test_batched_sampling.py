"""The batched sampling maths against the obvious per-row definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.batched_sampling import PenaltyCounts, counter_exponential, filter_logits

VOCAB = 300


def sorted_filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row through a full sort: top-k by rank, then nucleus and floor on what is left."""
    sorted_logits, order = logits.sort(descending=True)
    if top_k < VOCAB:
        sorted_logits[top_k:] = float("-inf")
    probs = torch.softmax(sorted_logits, dim=-1)
    # top_p 1 is "off": a float cumsum may reach 1.0 before the tail and would cut it.
    outside = (probs.cumsum(-1) - probs) >= top_p if top_p < 1 else torch.zeros_like(probs) > 0
    below = probs < min_p * probs[0]
    sorted_logits[outside | below] = float("-inf")
    return torch.empty_like(logits).scatter_(0, order, sorted_logits)


@pytest.mark.parametrize("seed", range(4))
def test_filter_matches_the_sorting_definition(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, VOCAB, generator=generator) * 3
    settings = [(VOCAB, 1.0, 0.0), (5, 1.0, 0.0), (VOCAB, 0.7, 0.0), (40, 0.9, 0.0),
                (VOCAB, 1.0, 0.2), (17, 0.5, 0.05)]  # fmt: skip
    top_k = np.array([s[0] for s in settings])
    top_p = np.array([s[1] for s in settings])
    min_p = np.array([s[2] for s in settings])
    got = filter_logits(logits, top_k, top_p, min_p)
    for row, (k, p, m) in enumerate(settings):
        assert torch.equal(got[row].isinf(), sorted_filter(logits[row], k, p, m).isinf()), row
    assert torch.equal(got[0], logits[0])


def test_counter_noise_is_a_function_of_seed_and_position_only() -> None:
    seeds = torch.tensor([7, 7, 8, 7])
    positions = torch.tensor([0, 1, 0, 0])
    noise = counter_exponential(seeds, positions, VOCAB)
    assert torch.equal(noise[0], noise[3])
    assert not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2])
    alone = counter_exponential(seeds[3:], positions[3:], VOCAB)
    assert torch.equal(alone[0], noise[0])


def test_counter_noise_is_exponential() -> None:
    seeds = torch.arange(64)
    noise = counter_exponential(seeds, seeds * 3, 4096).flatten().double()
    # Exp(1): mean 1, variance 1, P(X > 1) = 1/e; 262,144 draws put each within ~1%.
    assert abs(noise.mean().item() - 1) < 0.01
    assert abs(noise.var().item() - 1) < 0.02
    assert abs((noise > 1).double().mean().item() - math.exp(-1)) < 0.005
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())


def test_penalty_counts_match_recounting_the_history() -> None:
    generator = torch.Generator().manual_seed(1)
    counts = PenaltyCounts(3, VOCAB, torch.device("cpu"))
    prompts = [[1, 2, 3], [4, 4], [5]]
    outputs: list[list[int]] = [[9], [], [2, 2]]
    for row in range(3):
        counts.reset_row(row, prompts[row], outputs[row])
    for _ in range(20):
        tokens = torch.randint(0, 12, (3,), generator=generator)
        counts.add_tokens(torch.arange(3), tokens)
        for row in range(3):
            outputs[row].append(int(tokens[row]))
    logits = torch.randn(3, VOCAB, generator=generator)
    presence = torch.tensor([0.5, 0.0, 1.0])
    frequency = torch.tensor([0.2, 0.3, 0.0])
    repetition = torch.tensor([1.3, 1.0, 0.8])
    got = counts.apply(logits, torch.arange(3), presence, frequency, repetition)
    for row in range(3):
        want = logits[row].clone()
        history = torch.bincount(torch.tensor(outputs[row]), minlength=VOCAB).float()
        want -= frequency[row] * history + presence[row] * (history > 0).float()
        seen = sorted(set(prompts[row]) | set(outputs[row]))
        values = want[seen]
        r = repetition[row]
        want[seen] = torch.where(values > 0, values / r, values * r)
        torch.testing.assert_close(got[row], want)
