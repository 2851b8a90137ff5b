"""Which adapters an engine holds and where: up to ``max_cpu_loras`` loaded in host memory
(least recently used dropped first), ``max_loras`` of them in the device slots a step reads
(least recently stepped swapped out first).

The scheduler never runs more than ``max_loras`` distinct adapters at once, so a step's
adapters always fit the slots. Adapters are ``Adapter`` objects, compared by identity: a
request holds the one it was admitted with, so reloading or unloading a name never changes
the weights under a request already running; its slot and memory go when nothing uses it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sluicegate.engine.core.scheduler_output import ScheduledSequence
from sluicegate.engine.lora.adapter import Adapter, LoraLoadError, load_adapter
from sluicegate.engine.lora.layers import install_lora
from sluicegate.engine.lora.ops import LoraPlan
from sluicegate.engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraConfig:
    """``max_loras`` adapters per step (device slots), of rank up to ``max_rank``, and up
    to ``max_cpu_loras`` held in host memory (default: ``max_loras``, vLLM's default)."""

    max_loras: int
    max_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


def lora_manager(manager: LoraManager | None) -> LoraManager:
    """``manager``, or the refusal of an engine with LoRA off (a request's ``invalid_request``,
    a control command's ``ok=False``): never the base model's tokens instead."""
    if manager is None:
        raise LoraLoadError("LoRA is off on this engine (--max-loras 0)")
    return manager


class LoraManager:
    def __init__(self, model: LlamaForCausalLM, config: LoraConfig) -> None:
        self.config = config
        self.device = model.lm_head.weight.device
        self.dtype = model.config.dtype
        self.step, self.linears, self.projections = install_lora(
            model, config.max_loras, config.max_rank
        )
        self._held: OrderedDict[str, Adapter] = OrderedDict()
        """Host memory, least recently used first."""
        self._slots: list[Adapter | None] = [None] * config.max_loras
        self._slot_used = [0] * config.max_loras
        self._steps = 0
        self.num_loads = 0
        self.num_swaps = 0

    # -- host memory ------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The adapters held (in a slot or in host memory), for the heartbeat."""
        return list(self._held)

    def load(self, name: str, path: str) -> Adapter:
        """Read ``name`` from ``path`` (again, if held: the new weights serve later requests);
        raises ``LoraLoadError`` and then holds what it held before."""
        adapter = load_adapter(name, path, self.projections, self.config.max_rank, self.dtype)
        self._held.pop(name, None)
        self._held[name] = adapter
        self.num_loads += 1
        while len(self._held) > self.config.host_capacity:
            evicted, _ = self._held.popitem(last=False)
            logger.info("LoRA %s left host memory (least recently used)", evicted)
        logger.info("LoRA %s loaded from %s (rank %d)", name, path, adapter.rank)
        return adapter

    def acquire(self, name: str, path: str) -> Adapter:
        """The adapter a new request runs: the one held under ``name``, else loaded from
        ``path`` (lazily, on first use)."""
        adapter = self._held.get(name)
        if adapter is None:
            return self.load(name, path)
        self._held.move_to_end(name)
        return adapter

    def unload(self, name: str) -> None:
        """Drop ``name``; requests running with it finish with it."""
        adapter = self._held.pop(name, None)
        if adapter is None:
            raise LoraLoadError(f"LoRA adapter {name!r} is not loaded")
        for slot, holder in enumerate(self._slots):
            if holder is adapter:
                # Never read again (the scheduler admits no new request with it); freed
                # now so the next adapter takes this slot before a live one's.
                self._slot_used[slot] = 0

    # -- device slots -----------------------------------------------------------------------

    def begin_step(self, scheduled: Sequence[ScheduledSequence]) -> bool:
        """Set the plan of the step about to run (each scheduled row's adapter, None for the
        base model, and its tokens, in step order); whether any row has an adapter. Every
        forward of the model is preceded by this call, so a plan never outlives its step."""
        rows = [item.seq.lora for item in scheduled]
        if all(adapter is None for adapter in rows):
            self.step.plan = None
            return False
        self._steps += 1
        slot_of: dict[int, int] = {}
        needed = {id(a): a for a in rows if a is not None}
        for adapter in needed.values():
            slot_of[id(adapter)] = self._slot_for(adapter, needed)
        row_slots = np.array([slot_of[id(a)] if a is not None else -1 for a in rows])
        counts = np.array([item.num_new_tokens for item in scheduled], dtype=np.int64)
        self.step.plan = LoraPlan.build(np.repeat(row_slots, counts), self.device)
        return True

    def _slot_for(self, adapter: Adapter, needed: dict[int, Adapter]) -> int:
        for slot, holder in enumerate(self._slots):
            if holder is adapter:
                self._slot_used[slot] = self._steps
                return slot
        candidates = [
            slot
            for slot, holder in enumerate(self._slots)
            if holder is None or id(holder) not in needed
        ]
        if not candidates:  # the scheduler admits no more: a bug, never a client's error
            raise RuntimeError(f"a step needs more than max_loras={self.config.max_loras} adapters")
        slot = min(candidates, key=lambda s: (self._slots[s] is not None, self._slot_used[s]))
        if self._slots[slot] is not None:
            self.num_swaps += 1
        for name, linear in self.linears.items():
            linear.set_slot(slot, adapter.weights.get(name))
        self._slots[slot] = adapter
        self._slot_used[slot] = self._steps
        return slot

    def stats(self) -> dict[str, object]:
        return {
            "max_loras": self.config.max_loras,
            "max_lora_rank": self.config.max_rank,
            "loras": self.names,
            "lora_loads": self.num_loads,
            "lora_swaps": self.num_swaps,
        }
