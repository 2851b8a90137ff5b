"""Turns the logits of the sampled positions into next tokens, one batched pass per step.

Seeded rows draw their noise from a generator seeded with (seed, output position) alone, so
a seeded request samples the same tokens whatever its batch mates are and however often it
was preempted and recomputed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sampling import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15
_SEED_MASK = (1 << 63) - 1


class SampledSequence(Protocol):
    """What the sampler reads from a sequence (``engine.sequence.Sequence`` satisfies it)."""

    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int


@dataclass
class TokenLogprobs:
    """Log-probability of the sampled token and of the ``n`` most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def derived_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded with ``seed`` (choice 0 keeps it)."""
    return seed if index == 0 else (seed + index * _SEED_MIX) & _SEED_MASK


def seeded_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(((seed * _SEED_MIX) ^ (position * 0x632BE59BD9B4E019)) & _SEED_MASK)
    return generator


class Sampler:
    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self,
        logits: torch.Tensor,
        seqs: SequenceOf[SampledSequence],
        constrain: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        """``constrain`` masks forbidden tokens in place (grammars); logprobs are taken from
        the model's raw distribution before it, as vLLM does."""
        params = [seq.params for seq in seqs]
        logits = logits.float()
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1)
            if any(p.logprobs is not None for p in params)
            else None
        )
        if constrain is not None:
            constrain(logits)
        if any(p.has_penalties or p.logit_bias for p in params):
            logits = logits.clone()
            for row, seq in enumerate(seqs):
                if seq.params.has_penalties:
                    _apply_penalties(logits[row], seq)
                if seq.params.logit_bias:
                    _apply_logit_bias(logits[row], seq.params.logit_bias)

        greedy_tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            tokens = greedy_tokens
        else:
            tokens = self._sample_random(logits, seqs, greedy_tokens)
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _gather_logprobs(raw_logprobs, params, token_ids))

    def _sample_random(
        self, logits: torch.Tensor, seqs: SequenceOf[SampledSequence], greedy: torch.Tensor
    ) -> torch.Tensor:
        params = [seq.params for seq in seqs]
        temperatures = torch.tensor(
            [p.temperature if p.temperature > 0 else 1.0 for p in params],
            device=logits.device,
            dtype=logits.dtype,
        )
        logits = logits / temperatures[:, None]
        if any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
            logits = _filter_top_k_top_p_min_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        # argmax(p / E) with E ~ Exp(1) is an exact draw from p (the exponential race) and
        # lets each row take its noise from its own generator.
        noise = torch.empty_like(probs)
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device, dtype=probs.dtype
            ).exponential_(generator=self.generator)
        for row, seq in enumerate(seqs):
            seed = seq.params.seed
            if seed is not None:
                position = len(seq.token_ids) - seq.num_prompt_tokens
                noise[row].exponential_(generator=seeded_generator(seed, position, probs.device))
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy, sampled)


def _apply_penalties(logits: torch.Tensor, seq: SampledSequence) -> None:
    """OpenAI presence/frequency penalties on generated tokens; the CTRL-style repetition
    penalty on every token seen (prompt and output), as vLLM and transformers do."""
    p = seq.params
    vocab = logits.shape[0]
    outputs = torch.tensor(
        seq.token_ids[seq.num_prompt_tokens :], device=logits.device, dtype=torch.long
    )
    if p.presence_penalty or p.frequency_penalty:
        counts = torch.bincount(outputs, minlength=vocab)[:vocab].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.repetition_penalty != 1:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=logits.device, dtype=torch.long)
        seen = seen[seen < vocab]
        values = logits[seen]
        logits[seen] = torch.where(
            values > 0, values / p.repetition_penalty, values * p.repetition_penalty
        )


def _apply_logit_bias(logits: torch.Tensor, bias: dict[int, float]) -> None:
    ids = torch.tensor(list(bias), device=logits.device, dtype=torch.long)
    logits.index_add_(0, ids, torch.tensor(list(bias.values()), device=logits.device))


def _filter_top_k_top_p_min_p(
    logits: torch.Tensor, params: SequenceOf[SamplingParams]
) -> torch.Tensor:
    """Mask (to -inf) every token outside each row's top-k, top-p nucleus and min-p floor."""
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    ranks = torch.arange(vocab, device=device)
    sorted_logits.masked_fill_(ranks[None, :] >= top_k[:, None], float("-inf"))

    probs = torch.softmax(sorted_logits, dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=probs.dtype)
    # A token is kept while the mass before it is below top_p, so the first one always stays.
    outside_nucleus = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=probs.dtype)
    below_floor = probs < (min_p[:, None] * probs[:, :1])
    sorted_logits.masked_fill_(outside_nucleus | below_floor, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(
    raw_logprobs: torch.Tensor | None,
    params: SequenceOf[SamplingParams],
    token_ids: list[int],
) -> list[TokenLogprobs | None]:
    """The sampled token's logprob and each row's top k, for every row in one gather and one
    top-k over the batch (one device-to-host copy)."""
    if raw_logprobs is None:
        return [None] * len(params)
    device = raw_logprobs.device
    sampled = raw_logprobs.gather(1, torch.tensor(token_ids, device=device)[:, None])[:, 0]
    k = max(p.logprobs or 0 for p in params)
    sampled_list = sampled.tolist()
    top_values: list[list[float]] = [[] for _ in params]
    top_ids: list[list[int]] = [[] for _ in params]
    if k > 0:
        values, indices = raw_logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), indices.tolist()
    result: list[TokenLogprobs | None] = []
    for row, (p, token) in enumerate(zip(params, token_ids, strict=True)):
        if p.logprobs is None:
            result.append(None)
            continue
        n = p.logprobs
        top = list(zip(top_ids[row][:n], top_values[row][:n], strict=True))
        result.append(TokenLogprobs(token, sampled_list[row], top))
    return result
