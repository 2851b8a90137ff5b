"""``speculative_config`` as vLLM spells it: which proposer (prompt lookup, or a smaller
draft model given by ``model``), how many draft tokens a step verifies, and when a step skips
speculation."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")

DEFAULT_DISABLE_BY_BATCH_SIZE = 4
"""Speculate only while this many sequences or fewer run. Verifying k drafts turns each
decode row into k + 1 query tokens; a step of a few rows reads every weight once whatever
its row count (the linears are bound by memory traffic), so the extra rows are almost free
there. With a full batch the linears are bound by arithmetic instead, every rejected draft
costs as much as a real token, and the step slows down for all: bench/spec_decode.py
measured where the verified step stops being nearly free on this project's CPU."""


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str | None = None
    """``ngram`` or ``draft_model``; left out, as vLLM does: ``draft_model`` when ``model`` is
    given, else ``ngram``."""
    model: str | None = None
    """The draft model's checkpoint (a folder or a GGUF file), sharing the target's vocabulary."""
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model else "ngram")
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method {self.method!r} is not supported here "
                f"(supported: {', '.join(METHODS)})"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config method 'draft_model' needs 'model'")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config method 'ngram' takes no 'model'")
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size < 1:
            raise ValueError(
                f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}"
            )

    @classmethod
    def parse(cls, value: SpeculativeConfig | Mapping[str, Any] | str) -> SpeculativeConfig:
        """From a config, a mapping or its JSON text (the CLI's ``--speculative-config``);
        an unknown key is an error naming it, not silently ignored."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json.loads(value)
            if not isinstance(value, Mapping):
                raise ValueError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys: {', '.join(unknown)}")
        return cls(**value)
