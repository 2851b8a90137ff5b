"""Per-request sampling parameters (plain Python: the wire format and the gateway mirror them)."""

from __future__ import annotations

from dataclasses import dataclass

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing float32 logits by one
overflows them to inf, and the softmax of an inf row is NaN, not the argmax."""


@dataclass
class SamplingParams:
    """How one request picks its tokens. ``temperature`` 0 (or below ``GREEDY_BELOW``) means
    greedy.

    ``seed`` makes a request reproducible whatever else shares its batch: the random draw for
    each output token is derived from ``(seed, output position)`` only.
    ``logprobs=n`` returns the sampled token's log-probability and the ``n`` most likely tokens
    at each step, from the model's raw distribution (before penalties and temperature).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    """Added to the logits of those token ids before sampling (OpenAI: -100..100)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            self.stop = [s for s in self.stop if s]
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.logprobs is not None and self.logprobs > 20:
            raise ValueError(f"logprobs must be at most 20, got {self.logprobs}")
        if self.logit_bias:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            if any(not -100 <= b <= 100 for b in self.logit_bias.values()):
                raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )
