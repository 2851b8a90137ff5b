"""Sluicegate's inference engine.

The heavy names load lazily so that ``import sluicegate.engine.protocol`` (which the gateway does)
never pulls in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluicegate.engine.sample.params import SamplingParams
    from sluicegate.engine.serving.async_engine import AsyncEngine
    from sluicegate.engine.serving.llm import LLM

__all__ = ["LLM", "AsyncEngine", "SamplingParams"]

_LAZY = {
    "LLM": "sluicegate.engine.serving.llm",
    "AsyncEngine": "sluicegate.engine.serving.async_engine",
    "SamplingParams": "sluicegate.engine.sample.params",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
