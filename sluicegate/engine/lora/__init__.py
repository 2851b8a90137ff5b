"""LoRA adapters on a native model: many per engine, mixed row by row in one step
(``docs/lora.md``)."""

from sluicegate.engine.lora.adapter import Adapter, LoraLoadError
from sluicegate.engine.lora.manager import LoraConfig, LoraManager, lora_manager

__all__ = ["Adapter", "LoraConfig", "LoraLoadError", "LoraManager", "lora_manager"]
