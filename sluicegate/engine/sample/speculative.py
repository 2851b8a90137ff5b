"""Verification of draft tokens against the target model's distributions.

Row i holds the target's logits at the position a draft token ``drafts[i]`` was proposed
for. Greedy rows accept the draft when it is the argmax and otherwise emit the argmax.
Random rows use rejection sampling against a point-mass draft distribution (prompt lookup
proposes one token with certainty): accept with probability p(draft) under the row's
tempered, filtered distribution p, and on rejection draw from p with the draft's mass
removed. A token t then comes out with probability p(d)[t = d] + (1 - p(d)) p(t) / (1 - p(d))
[t != d] = p(t): exactly the distribution sampling without speculation draws from.
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
) -> torch.Tensor:
    """[rows, 2] int64 on the device: per row whether its draft is accepted, and the token
    it emits if the chain of accepted drafts stops there. Only temperature, top-k, top-p
    and min-p shape the distribution: requests with penalties, logit bias, logprobs, a
    seed or a grammar are never speculated."""
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
        # filtered_probs leaves the kept mass unnormalised: compare against the row's total.
        mass = probs.gather(1, proposed)[:, 0].double()
        total = probs.sum(dim=-1, dtype=torch.float64)
        uniforms = torch.rand(
            (2, len(random_rows)), generator=generator, device=device, dtype=torch.float64
        )
        accepted[index] = uniforms[0] * total < mass
        tokens[index] = sample_from_probs(probs.scatter(1, proposed, 0.0), uniforms[1])
    return torch.stack([accepted.long(), tokens], dim=1)
