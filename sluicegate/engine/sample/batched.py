"""The sampler's maths over whole batches, each request's parameters as a column.

- ``argmax_rows`` / ``sort_descending``: on the CPU through numpy's vectorised kernels
  (torch's CPU argmax is ~12x and its sort ~30x slower on [32, 32000] float32 rows), and for
  top-p only the largest 1,024 of each row when the nucleus lies among them; on a GPU,
  torch's own.
- ``sample_from_probs``: one exact draw per row by inverting its CDF at one uniform (a
  cumulative sum and a binary search), instead of racing a full row of exponential noise:
  on the CPU, drawing 32 x 32000 exponentials cost ~15 ms a step.
- ``counter_uniform``: that uniform for seeded rows as a pure function of (seed, output
  position) — a SplitMix64 hash in int64 tensor arithmetic — so seeded rows need no
  generator object, and a request's draw never depends on its batch mates or on how often
  it was preempted or resumed.
- ``filtered_probs``: top-k by a per-row threshold from one ``topk`` over the rows that ask
  (no full sort); min-p against each row's largest probability; top-p by a threshold read
  off the sorted probabilities of only the rows that ask (values only: no permutation to
  scatter back).
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
_CDF_BLOCK = 256
# Top-p on the CPU first looks for each row's nucleus among this many largest tokens.
_NUCLEUS_CANDIDATES = 1024
_LOW_30, _LOW_27, _LOW_31, _LOW_53 = (1 << 34) - 1, (1 << 37) - 1, (1 << 33) - 1, (1 << 53) - 1


def _shift_right(x: torch.Tensor, bits: int, keep_mask: int) -> torch.Tensor:
    """Logical right shift of int64 (torch shifts arithmetically, dragging the sign in)."""
    return (x >> bits) & keep_mask


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[rows] float64 uniforms in [0, 1); entry i depends only on (seeds[i], positions[i])."""
    z = seeds.to(torch.int64) * _GOLDEN + positions.to(torch.int64) * _POSITION_MIX + _GOLDEN
    z = (z ^ _shift_right(z, 30, _LOW_30)) * _MIX1
    z = (z ^ _shift_right(z, 27, _LOW_27)) * _MIX2
    z = z ^ _shift_right(z, 31, _LOW_31)
    # The top 53 bits: every value exact in float64.
    return _shift_right(z, 11, _LOW_53).to(torch.float64) * (1.0 / (1 << 53))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's first largest index (int64), as ``torch.argmax(x, -1)``."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(x.numpy().argmax(axis=1))
    return x.argmax(dim=-1)


def sort_descending(x: torch.Tensor, covering: np.ndarray | None = None) -> torch.Tensor:
    """Each row's values, largest first (no permutation). With ``covering`` (one mass per
    row, float64), only a leading part may come back: the largest ``_NUCLEUS_CANDIDATES``
    of each row, when on every row they add up to at least its mass (a top-p nucleus
    inside them is then the whole row's). That partial selection replaces the full sort
    on the CPU, where a decision on the sums costs no device read; a GPU sorts."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return x.sort(dim=-1, descending=True).values
    values = x.numpy()
    width = values.shape[1]
    # Rows whose largest value times the candidates' count stays below the mass cannot be
    # covered: skip the selection for a batch with one.
    if (
        covering is not None
        and width > 2 * _NUCLEUS_CANDIDATES
        and (values.max(axis=1) * _NUCLEUS_CANDIDATES >= covering).all()
    ):
        top = np.partition(values, width - _NUCLEUS_CANDIDATES, axis=1)
        top = top[:, width - _NUCLEUS_CANDIDATES :]
        if (top.sum(axis=1, dtype=np.float64) >= covering).all():
            values = top
    return torch.from_numpy(np.ascontiguousarray(np.sort(values, axis=1)[:, ::-1]))


def search_cumsum(
    values: torch.Tensor, targets: torch.Tensor, *, right: bool, of_total: bool = False
) -> torch.Tensor:
    """Per row, the first index whose running sum of ``values`` (non-negative) exceeds
    (``right``) or reaches its target ([rows]; with ``of_total``, a fraction in [0, 1) of the
    row's sum), never past the row's last value that can.

    Sums run in float64 (a float32 running sum over a large vocabulary drifts by ~1e-3 at
    its end), in two levels so that a row is read once: the running sum of blocks of
    ``_CDF_BLOCK`` values finds the block, a running sum within that one block the index (a
    float64 running sum of a whole [32, 32000] batch cost ~1.4 ms on this project's CPU)."""
    rows, width = values.shape
    padded = -(-width // _CDF_BLOCK) * _CDF_BLOCK
    if padded != width:
        values = torch.nn.functional.pad(values, (0, padded - width))
    blocks = values.reshape(rows, padded // _CDF_BLOCK, _CDF_BLOCK)
    block_sums = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    zero = block_sums.new_zeros(())
    targets = targets.to(torch.float64)[:, None]
    if of_total:
        total = block_sums[:, -1:]
        # Below the total even after rounding: some value's running sum exceeds it.
        targets = (targets * total).minimum(total.nextafter(zero))
    block = torch.searchsorted(block_sums, targets, right=right).clamp_(max=blocks.shape[1] - 1)
    before = torch.where(block > 0, block_sums.gather(1, (block - 1).clamp(min=0)), zero)
    inside = blocks.gather(1, block[:, :, None].expand(-1, -1, _CDF_BLOCK))[:, 0]
    local = inside.to(torch.float64).cumsum(dim=-1)
    # The block's own running sum may round a hair below the block sums: stay inside it.
    last = local[:, -1:]
    local_targets = (targets - before).clamp(min=0).minimum(last.nextafter(zero) if right else last)
    index = torch.searchsorted(local, local_targets, right=right)
    return (block * _CDF_BLOCK + index)[:, 0].clamp_(max=width - 1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Row i's token drawn from ``probs[i]`` (unnormalised is fine) at ``uniforms[i]`` in
    [0, 1): the first token whose cumulative mass exceeds ``u`` x the row's total. A token of
    zero mass spans an empty interval, so it is never drawn."""
    return search_cumsum(probs, uniforms, right=True, of_total=True)


def filtered_probs(
    logits: torch.Tensor, top_k: np.ndarray, top_p: np.ndarray, min_p: np.ndarray
) -> torch.Tensor:
    """Each row's softmax with what its top-k, top-p nucleus and min-p floor exclude set to
    0 (not renormalised: ``sample_from_probs`` takes any mass). ``logits`` is changed in
    place (callers pass a tensor of their own).

    The settings are host arrays, one entry per row (``top_k`` >= vocab, ``top_p`` 1.0 and
    ``min_p`` 0.0 are off), so every decision about which work to do is taken without
    reading the device. The nucleus and the floor are both judged on the distribution
    after top-k, as vLLM does; a token is kept while the mass strictly above it is below
    top_p, so the most likely token always stays (and tokens tied with the last one kept
    stay with it). Zeroing the softmax instead of masking logits to -inf and taking a
    second softmax gives the same distribution for one full pass less.
    """
    device = logits.device
    vocab = logits.shape[1]
    k_rows = np.flatnonzero(top_k < vocab)
    if len(k_rows):
        k_max = int(top_k[k_rows].max())
        index = torch.from_numpy(k_rows).to(device)
        subset = logits.index_select(0, index)
        k_index = torch.from_numpy(top_k[k_rows] - 1).to(device)
        kth = subset.topk(k_max, dim=-1).values.gather(1, k_index[:, None])
        logits[index] = subset.masked_fill_(subset < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    p_rows = np.flatnonzero(top_p < 1)
    if len(p_rows):
        rows = torch.from_numpy(p_rows).to(device)
        nucleus = probs.index_select(0, rows)
        masses = top_p[p_rows].astype(np.float64)
        values = sort_descending(nucleus, covering=masses).to(device)
        threshold = torch.from_numpy(masses).to(device)
        # The sorted values kept are those with less than top_p above them: all up to the
        # first whose running sum reaches top_p (the first always: nothing is above it).
        last = search_cumsum(values, threshold, right=False)
        outside = nucleus < values.gather(1, last[:, None])
    if (min_p > 0).any():
        floor = torch.from_numpy(min_p.astype(np.float32)).to(device)[:, None]
        probs.masked_fill_(probs < floor * probs.amax(dim=-1, keepdim=True), 0.0)
        if len(p_rows):
            nucleus = probs.index_select(0, rows)  # the floor's cuts, then the nucleus's
    if len(p_rows):
        probs.index_copy_(0, rows, nucleus.masked_fill_(outside, 0.0))
    return probs


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
        presence: torch.Tensor | None,
        frequency: torch.Tensor | None,
        repetition: torch.Tensor | None,
    ) -> torch.Tensor:
        """OpenAI presence/frequency penalties on output tokens; the CTRL repetition
        penalty on every token seen, as vLLM and transformers apply them. A penalty given
        as None is off for every row (each costs full-vocabulary passes)."""
        if presence is not None or frequency is not None:
            counts = self.counts[rows]
            if frequency is not None:
                logits = logits - frequency[:, None] * counts
            if presence is not None:
                logits = logits - presence[:, None] * (counts > 0)
        if repetition is None:
            return logits
        r = repetition[:, None]
        penalised = torch.where(logits > 0, logits / r, logits * r)
        return torch.where(self.seen[rows], penalised, logits)
