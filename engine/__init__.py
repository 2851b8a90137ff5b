"""Sluicegate's inference engine.

The heavy names load lazily so that ``import engine.protocol`` (which the gateway does)
never pulls in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm import LLM
    from engine.sampling import SamplingParams

__all__ = ["LLM", "AsyncEngine", "SamplingParams"]

_LAZY = {
    "LLM": "engine.llm",
    "AsyncEngine": "engine.async_engine",
    "SamplingParams": "engine.sampling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
