"""Draft verification: greedy rows accept the argmax only; rejection sampling of a
point-mass draft reproduces the target distribution exactly (checked statistically)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.sample.speculative import verify_drafts

SAMPLES = 50_000
# The expected total variation of SAMPLES draws from a 6-token distribution is ~0.003;
# 0.015 is five times that, and far below what a wrong acceptance rule gives (see below).
TV_BOUND = 0.015
LOGITS = torch.tensor([2.0, 1.5, 0.3, 0.0, -1.0, -2.5])


def target(params: SamplingParams) -> np.ndarray:
    """The distribution sampling without speculation draws from (temperature, top-k, top-p)."""
    probs = torch.softmax(LOGITS / params.temperature, dim=-1).double().numpy()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), dtype=bool)
    if params.top_k > 0:
        keep[order[: params.top_k]] = True
    else:
        keep[:] = True
    above = np.cumsum(probs[order]) - probs[order]
    keep[order[above >= params.top_p]] = False
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def emitted(params: SamplingParams, draft: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The token each of SAMPLES rows emits (the draft if accepted), and the acceptances."""
    logits = LOGITS.repeat(SAMPLES, 1)
    drafts = np.full(SAMPLES, draft, dtype=np.int64)
    generator = torch.Generator().manual_seed(seed)
    verdicts = verify_drafts(logits, drafts, [params] * SAMPLES, generator).numpy()
    accepted = verdicts[:, 0].astype(bool)
    return np.where(accepted, draft, verdicts[:, 1]), accepted


def total_variation(tokens: np.ndarray, expected: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=len(expected)) / len(tokens)
    return 0.5 * float(np.abs(observed - expected).sum())


@pytest.mark.parametrize(
    ("params", "draft"),
    [
        (SamplingParams(temperature=1.0), 0),
        (SamplingParams(temperature=1.0), 3),
        (SamplingParams(temperature=0.7, top_k=3), 1),
        (SamplingParams(temperature=0.7, top_k=3), 4),  # outside the top-k: never accepted
        (SamplingParams(temperature=1.3, top_p=0.8), 2),
    ],
)
def test_rejection_sampling_reproduces_the_target_distribution(
    params: SamplingParams, draft: int
) -> None:
    expected = target(params)
    tokens, accepted = emitted(params, draft)
    assert total_variation(tokens, expected) < TV_BOUND
    # A draft is accepted with its probability under the target.
    assert abs(accepted.mean() - expected[draft]) < 0.01


def test_the_bound_catches_a_wrong_rule() -> None:
    """Resampling from the full distribution on rejection (not the draft's mass removed)
    over-weights the draft: the same check fails it."""
    params = SamplingParams(temperature=1.0)
    expected = target(params)
    _, accepted = emitted(params, 1)
    generator = torch.Generator().manual_seed(1)
    full = torch.multinomial(torch.from_numpy(expected), SAMPLES, True, generator=generator)
    wrong = np.where(accepted, 1, full.numpy())
    assert total_variation(wrong, expected) > 5 * TV_BOUND


def test_greedy_rows_accept_only_the_argmax_and_emit_it_otherwise() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    generator = torch.Generator().manual_seed(0)
    verdicts = verify_drafts(logits, np.array([1, 2, 0]), [greedy] * 3, generator)
    assert verdicts.tolist() == [[1, 1], [0, 0], [0, 2]]


DRAFT_LOGITS = torch.tensor([0.0, 1.8, 1.0, 0.5, -0.5, 0.2])
"""A draft model's logits: it ranks the tokens differently from the target."""


def drafted_from_model(params: SamplingParams, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """SAMPLES drafts drawn from a draft model's distribution q, verified against the
    target's with q given: the tokens emitted and the acceptances."""
    q = torch.softmax(DRAFT_LOGITS / params.temperature, dim=-1)
    generator = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, SAMPLES, True, generator=generator).numpy()
    logits = LOGITS.repeat(SAMPLES, 1)
    draft_probs = q.repeat(SAMPLES, 1)
    verdicts = verify_drafts(logits, drafts, [params] * SAMPLES, generator, draft_probs).numpy()
    accepted = verdicts[:, 0].astype(bool)
    return np.where(accepted, drafts, verdicts[:, 1]), accepted


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
)
def test_rejection_sampling_against_a_draft_distribution_reproduces_the_target(
    params: SamplingParams,
) -> None:
    """Accept with min(1, p/q), resample from max(0, p - q) on rejection: the tokens follow
    p, and a draft is accepted with probability sum_t min(p(t), q(t))."""
    expected = target(params)
    q = torch.softmax(DRAFT_LOGITS / params.temperature, dim=-1).double().numpy()
    tokens, accepted = drafted_from_model(params)
    assert total_variation(tokens, expected) < TV_BOUND
    assert abs(accepted.mean() - np.minimum(expected, q).sum()) < 0.01


def test_the_bound_catches_resampling_from_the_target_on_rejection() -> None:
    """Accepting with min(1, p/q) but resampling from p itself (not the residual) on
    rejection under-weights what the draft favours: the same check fails it."""
    params = SamplingParams(temperature=1.0)
    expected = target(params)
    tokens, accepted = drafted_from_model(params)
    generator = torch.Generator().manual_seed(1)
    full = torch.multinomial(torch.from_numpy(expected), SAMPLES, True, generator=generator)
    wrong = np.where(accepted, tokens, full.numpy())
    assert total_variation(wrong, expected) > 5 * TV_BOUND
