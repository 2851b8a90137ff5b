"""The batched sampling maths against the obvious per-row definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluicegate.engine.sample.batched import (
    PenaltyCounts,
    argmax_rows,
    counter_uniform,
    filtered_probs,
    sample_from_probs,
    sort_descending,
)

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
    got = filtered_probs(logits.clone(), top_k, top_p, min_p)
    for row, (k, p, m) in enumerate(settings):
        want = sorted_filter(logits[row], k, p, m)
        assert torch.equal(got[row] == 0, want.isinf()), row
        # What stays is the softmax after top-k, untouched (the sampler takes any mass).
        kept = ~want.isinf()
        torch.testing.assert_close(got[row][kept] / got[row].sum(), torch.softmax(want, -1)[kept])
    torch.testing.assert_close(got[0], torch.softmax(logits[0], -1))


def test_counter_uniform_is_a_function_of_seed_and_position_only() -> None:
    seeds = torch.tensor([7, 7, 8, 7])
    positions = torch.tensor([0, 1, 0, 0])
    u = counter_uniform(seeds, positions)
    assert u[0] == u[3] and u[0] != u[1] and u[0] != u[2]
    assert counter_uniform(seeds[3:], positions[3:])[0] == u[0]


def test_counter_uniform_is_uniform() -> None:
    seeds = torch.arange(1 << 18)
    u = counter_uniform(seeds % 977, seeds // 977).double()
    # U(0, 1): mean 1/2, variance 1/12, each decile a tenth; 262,144 draws put each within ~1%.
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    deciles = torch.bincount((u * 10).long(), minlength=10).double() / len(u)
    assert (deciles - 0.1).abs().max().item() < 0.003
    assert bool(((u >= 0) & (u < 1)).all())


def test_sampling_from_probs_inverts_the_cdf_and_skips_empty_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, -1)
    uniforms = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-53], dtype=torch.float64)
    assert sample_from_probs(probs, uniforms).tolist() == [1, 1, 3, 3, 3]


def test_cpu_fast_paths_match_torch() -> None:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, VOCAB, generator=generator)
    x[2, 10] = x[2, 20] = x[2].max() + 1  # a tie: the first index wins, as in torch
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(sort_descending(x), x.sort(dim=-1, descending=True).values)


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


def test_two_level_cdf_draws_what_one_running_sum_draws() -> None:
    """Across block edges, zero-mass runs and a vocabulary that is not a whole number of
    blocks, the blockwise inversion picks the token a plain float64 running sum picks."""
    generator = torch.Generator().manual_seed(4)
    probs = torch.rand(64, 1000, generator=generator) ** 8
    probs[:, 250:520] = 0  # a run of zero mass across a block edge
    probs[3, :-1] = 0  # all mass on the very last token
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    uniforms[:4] = torch.tensor([0.0, 1 - 2**-53, 0.5, 0.25], dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0]
    got = sample_from_probs(probs, uniforms)
    assert torch.equal(got, want.clamp(max=999))
    assert bool((probs.gather(1, got[:, None]) > 0).all())


@pytest.mark.parametrize("scale", [8.0, 0.05], ids=["peaked", "flat"])
def test_top_p_from_the_largest_candidates_matches_the_full_sort(scale: float) -> None:
    """On the CPU a nucleus found among each row's largest tokens (peaked rows) and one that
    needs the whole row (flat rows, where the candidates fall short) both equal the
    full-sort definition."""
    vocab = 6000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9)) * scale
    top_p = np.array([0.9, 0.5, 0.99, 0.3])
    got = filtered_probs(logits.clone(), np.full(4, vocab), top_p, np.zeros(4))
    for row in range(4):
        want = sorted_filter(logits[row], vocab, float(top_p[row]), 0.0)
        assert torch.equal(got[row] == 0, want.isinf()), row
