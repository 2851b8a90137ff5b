"""Verification of draft tokens against the target model's distributions.

Row i holds the target's logits at the position a draft token ``drafts[i]`` was proposed
for. Greedy rows accept the draft when it is the argmax and otherwise emit the argmax.
Random rows use rejection sampling (Leviathan et al., 2023): a draft d drawn from the
draft's distribution q is accepted with probability min(1, p(d) / q(d)) under the row's
tempered, filtered distribution p, and on rejection the token is drawn from the residual
max(0, p - q), renormalised. A token t then comes out with probability
min(q(t), p(t)) + (1 - sum_s min(q(s), p(s))) max(0, p(t) - q(t)) / sum_s max(0, p(s) - q(s))
= p(t): exactly the distribution sampling without speculation draws from. Prompt lookup
proposes one token with certainty (q is a point mass): accept with probability p(d), and on
rejection draw from p with the draft's mass removed.
"""

from __future__ import annotations

import numpy as np
import torch

from sluicegate.engine.sample.batched import argmax_rows, filtered_probs, sample_from_probs
from sluicegate.engine.sample.params import SamplingParams


def verify_drafts(
    logits: torch.Tensor,
    drafts: np.ndarray,
    params: list[SamplingParams],
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rows, 2] int64 on the device: per row whether its draft is accepted, and the token
    it emits if the chain of accepted drafts stops there. Only temperature, top-k, top-p
    and min-p shape the distribution: requests with penalties, logit bias, logprobs, a
    seed or a grammar are never speculated. ``draft_probs``: q, the distribution each draft
    was drawn from (rows x vocab, normalised; only random rows' are read), or None for point
    masses (prompt lookup)."""
    device = logits.device
    logits = logits.float()
    draft = torch.from_numpy(drafts.astype(np.int64)).to(device)
    tokens = argmax_rows(logits).to(device)
    accepted = tokens == draft
    random_rows = np.array([i for i, p in enumerate(params) if not p.greedy], dtype=np.int64)
    if len(random_rows):
        index = torch.from_numpy(random_rows).to(device)
        chosen = [params[i] for i in random_rows]
        vocab = logits.shape[1]
        temperature = np.array([p.temperature for p in chosen], dtype=np.float32)
        top_k = np.array([p.top_k if p.top_k > 0 else vocab for p in chosen], dtype=np.int64)
        top_p = np.array([p.top_p for p in chosen], dtype=np.float32)
        min_p = np.array([p.min_p for p in chosen], dtype=np.float32)
        subset = logits.index_select(0, index) / torch.from_numpy(temperature).to(device)[:, None]
        if (top_k < vocab).any() or (top_p < 1).any() or (min_p > 0).any():
            probs = filtered_probs(subset, top_k, top_p, min_p)
        else:
            probs = torch.softmax(subset, dim=-1)
        proposed = draft.index_select(0, index)[:, None]
        uniforms = torch.rand(
            (2, len(random_rows)), generator=generator, device=device, dtype=torch.float64
        )
        if draft_probs is None:
            # filtered_probs leaves the kept mass unnormalised: compare against the row's total.
            mass = probs.gather(1, proposed)[:, 0].double()
            total = probs.sum(dim=-1, dtype=torch.float64)
            accepted[index] = uniforms[0] * total < mass
            residual = probs.scatter(1, proposed, 0.0)
        else:
            p = probs / probs.sum(dim=-1, keepdim=True)
            q = draft_probs.index_select(0, index).float()
            p_draft = p.gather(1, proposed)[:, 0].double()
            q_draft = q.gather(1, proposed)[:, 0].double()
            accepted[index] = uniforms[0] * q_draft < p_draft
            residual = (p - q).clamp_(min=0.0)
            # Where p and q agree to rounding the residual is empty and a rejection all but
            # impossible; drawing from p then keeps the emitted token well defined.
            empty = residual.sum(dim=-1, keepdim=True) <= 0
            residual = torch.where(empty, p, residual)
        tokens[index] = sample_from_probs(residual, uniforms[1])
    return torch.stack([accepted.long(), tokens], dim=1)
