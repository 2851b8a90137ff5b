"""The sampler's maths over whole batches, each request's parameters as a column tensor.

- ``counter_exponential``: Exp(1) noise that is a pure function of (seed, output position,
  token id) — a SplitMix64 hash in int64 tensor arithmetic — so seeded rows need no
  generator object, and a request's draw never depends on its batch mates or on how often
  it was preempted or resumed.
- ``filter_logits``: top-k by a per-row threshold from one ``topk`` (no full sort); min-p
  against each row's largest probability; top-p by a sort of only the rows that ask for it,
  and only of their top-k survivors when they also set top-k.
- ``PenaltyCounts``: per-row output-token counts and a seen-token mask on the device,
  filled when a request joins and bumped by one scatter per step, so presence, frequency
  and repetition penalties never re-count a request's history.
"""

from __future__ import annotations

import numpy as np
import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB
_POSITION_MIX = 0x632BE59BD9B4E019
_LOW_30, _LOW_27, _LOW_31, _LOW_24 = (1 << 34) - 1, (1 << 37) - 1, (1 << 33) - 1, (1 << 24) - 1


def _shift_right(x: torch.Tensor, bits: int, keep_mask: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically, dragging the sign in)."""
    return (x >> bits) & keep_mask


def counter_exponential(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) draws; row i depends only on (seeds[i], positions[i])."""
    device = seeds.device
    base = seeds.to(torch.int64) * _GOLDEN + positions.to(torch.int64) * _POSITION_MIX
    z = base[:, None] + (torch.arange(1, vocab + 1, device=device, dtype=torch.int64) * _GOLDEN)
    z = (z ^ _shift_right(z, 30, _LOW_30)) * _MIX1
    z = (z ^ _shift_right(z, 27, _LOW_27)) * _MIX2
    z = z ^ _shift_right(z, 31, _LOW_31)
    # The top 24 bits as a uniform in (0, 1): exact in float32, never 0 or 1.
    uniform = (_shift_right(z, 40, _LOW_24).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def filter_logits(
    logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> torch.Tensor:
    """Mask (to -inf) what each row's top-k, top-p nucleus and min-p floor exclude.

    The settings are host arrays, one entry per row (``top_k`` >= vocab, ``top_p`` 1.0 and
    ``min_p`` 0.0 are off), so every decision about which work to do is taken without
    reading the device. The nucleus and the floor are both judged on the distribution
    after top-k, as vLLM does; a token is kept while the mass strictly above it is below
    top_p, so the most likely token always stays.
    """
    device = logits.device
    vocab = logits.shape[1]
    logits = logits.clone()
    k_rows = top_k < vocab
    if k_rows.any():
        k_max = int(top_k[k_rows].max())
        k_index = torch.from_numpy(np.minimum(top_k, k_max) - 1).to(device)
        kth = logits.topk(k_max, dim=-1).values.gather(1, k_index[:, None])
        cut = torch.from_numpy(k_rows).to(device)[:, None] & (logits < kth)
        logits.masked_fill_(cut, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    cut = torch.zeros_like(probs, dtype=torch.bool)
    if (min_p > 0).any():
        floor = torch.from_numpy(min_p.astype(np.float32)).to(device)[:, None]
        cut |= probs < floor * probs.amax(dim=-1, keepdim=True)
    p_rows = np.flatnonzero(top_p < 1)
    if len(p_rows):
        rows = torch.from_numpy(p_rows).to(device)
        subset = probs[rows]
        # Rows that also set top-k have at most k candidates: sort only those.
        width = int(top_k[p_rows].max()) if k_rows[p_rows].all() else vocab
        if width < vocab:
            values, order = subset.topk(width, dim=-1)
        else:
            values, order = subset.sort(dim=-1, descending=True)
        threshold = torch.from_numpy(top_p[p_rows].astype(np.float32)).to(device)[:, None]
        outside = (values.cumsum(dim=-1) - values) >= threshold
        nucleus_cut = torch.ones_like(subset, dtype=torch.bool).scatter_(1, order, outside)
        cut[rows] |= nucleus_cut
    return logits.masked_fill_(cut, float("-inf"))


class PenaltyCounts:
    """Output-token counts and a seen-token (prompt or output) mask per batch row."""

    def __init__(self, num_rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.counts = torch.zeros(num_rows, vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(num_rows, vocab, dtype=torch.bool, device=device)

    def reset_row(self, row: int, prompt: list[int], outputs: list[int]) -> None:
        device = self.counts.device
        self.counts[row].zero_()
        self.seen[row].zero_()
        if outputs:
            ids = torch.tensor(outputs, dtype=torch.int64, device=device)
            self.counts[row].index_add_(0, ids, torch.ones(len(outputs), device=device))
            self.seen[row, ids] = True
        if prompt:
            self.seen[row, torch.tensor(prompt, dtype=torch.int64, device=device)] = True

    def add_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """One sampled token per row: one scatter each into counts and the seen mask."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32),
                               accumulate=True)  # fmt: skip
        self.seen[rows, tokens] = True

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor,
        presence: torch.Tensor,
        frequency: torch.Tensor,
        repetition: torch.Tensor,
    ) -> torch.Tensor:
        """OpenAI presence/frequency penalties on output tokens; the CTRL repetition
        penalty on every token seen, as vLLM and transformers apply them."""
        counts = self.counts[rows]
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
        seen = self.seen[rows]
        penalised = torch.where(
            logits > 0, logits / repetition[:, None], logits * repetition[:, None]
        )
        return torch.where(seen, penalised, logits)
