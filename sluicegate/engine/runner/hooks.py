"""What else a model runner drives besides its own model: a second model whose cache mirrors
its own (a speculative draft model), and the other tensor-parallel ranks."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from sluicegate.engine.runner.attention import AttentionMetadata


class KVMirror(Protocol):
    """A second model whose KV cache follows the target's block for block (a speculative
    draft model): it computes every token the target computes, and its blocks are copied
    with the target's."""

    def mirror(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> None: ...

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...


class StepFollowers(Protocol):
    """The other tensor-parallel ranks, as rank 0 sees them
    (``sluicegate.engine.parallel.ranks.RankGroup``): told each forward's inputs before rank 0
    runs it, and every other change to the cache."""

    def send_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor | None,
    ) -> None: ...

    def send(self, command: tuple[Any, ...]) -> None: ...
