"""What an engine core is built on: the checkpoint's tokenizer and weights (this rank's shard
under tensor parallelism, with the other ranks started), LoRA adapters, the model runner and
its KV cache, and the speculative proposer; refusing the combinations not served."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sluicegate.engine.models.gguf import checkpoint_folder
from sluicegate.engine.models.loader import shard_plan
from sluicegate.engine.options import EngineOptions
from sluicegate.engine.parallel.ranks import RankGroup, agree_on_blocks
from sluicegate.engine.parallel.shard import TensorParallel
from sluicegate.engine.runner.build import build_runner, context_length, load_engine_model
from sluicegate.engine.runner.model_runner import ModelRunner
from sluicegate.engine.serving.speculation import Speculator
from sluicegate.engine.spec.config import SpeculativeConfig
from sluicegate.engine.spec.draft_model import load_draft_model
from sluicegate.engine.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from sluicegate.engine.lora.manager import LoraManager
    from sluicegate.engine.runner.build import Model


@dataclass
class ModelSide:
    tokenizer: Tokenizer
    model: Model
    loras: LoraManager | None
    runner: ModelRunner
    ranks: RankGroup | None
    max_model_len: int
    speculator: Speculator | None


def load_model_side(model: str | Path, options: EngineOptions, device: torch.device) -> ModelSide:
    spec_config = None
    if options.speculative_config is not None:
        spec_config = SpeculativeConfig.parse(options.speculative_config)
        if spec_config.model is not None and options.tensor_parallel_size > 1:
            raise ValueError("draft-model speculation is not served with tensor parallelism")
    if options.max_loras and options.tensor_parallel_size > 1:
        # The adapters' matrices would need the base weights' split on every rank.
        raise ValueError("LoRA adapters are not served with tensor parallelism yet")
    # A GGUF file is served from the Hugging Face folder it converts to (once).
    folder = checkpoint_folder(model)
    tokenizer = Tokenizer(folder)
    ranks = None
    tp = None
    if options.tensor_parallel_size > 1:
        plan = shard_plan(folder, 0, options.tensor_parallel_size)  # refuses bad splits first
        ranks = RankGroup(folder, options)
        tp = TensorParallel(plan)
    try:
        loaded, loras = load_engine_model(folder, device, options, tp)
        max_model_len = context_length(loaded, options)
        runner = build_runner(loaded, device, options, max_model_len, loras)
        if ranks is not None:
            runner.resize_kv_cache(agree_on_blocks(runner.num_kv_blocks))
            runner.ranks = ranks
        speculator = None
        if spec_config is not None:
            draft = None
            if spec_config.model is not None:
                draft = load_draft_model(spec_config.model, runner, options)
            speculator = Speculator(spec_config, draft)
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    return ModelSide(tokenizer, loaded, loras, runner, ranks, max_model_len, speculator)
