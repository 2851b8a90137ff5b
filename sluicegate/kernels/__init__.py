"""Triton kernels for the engine's hot path, each with a plain-torch twin in ``sluicegate.kernels.reference``
(and, for the CPU, ``sluicegate.kernels.cpu_attention``: a C++ decode kernel beside the same twin).

``sluicegate.kernels.store_kv`` and ``sluicegate.kernels.paged_attention`` are the Triton ops. They load lazily
(module ``__getattr__``) so that ``import sluicegate.kernels.reference`` neither imports triton nor needs a
GPU. The kernel modules are named ``triton_*`` rather than after the ops: a submodule called
``store_kv`` would replace the package attribute ``store_kv`` with itself once imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluicegate.kernels.triton_paged_attention import paged_attention
    from sluicegate.kernels.triton_store_kv import store_kv

__all__ = ["paged_attention", "store_kv"]

_LAZY = {
    "store_kv": "sluicegate.kernels.triton_store_kv",
    "paged_attention": "sluicegate.kernels.triton_paged_attention",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
