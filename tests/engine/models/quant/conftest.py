"""Quantized checkpoints of one tiny random Llama, made once a session
(``tests.engine.models.quant.checkpoints`` makes them and reads them back)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.engine.models.quant.checkpoints import TOKENIZER_FILES, make_checkpoint


@pytest.fixture(scope="session")
def quant_base(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """The dense bfloat16 checkpoint every quantized one is made from."""
    folder = tmp_path_factory.mktemp("quant-base")
    torch.manual_seed(29)
    config = LlamaConfig(
        vocab_size=320,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        if (llama_dir / name).is_file():
            shutil.copy(llama_dir / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def quantized(tmp_path_factory: pytest.TempPathFactory, quant_base: Path) -> Callable[[str], Path]:
    """The folder of a format in FORMATS, made on first use."""
    root = tmp_path_factory.mktemp("quantized")
    made: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            make_checkpoint(quant_base, root / fmt, fmt)
            made[fmt] = root / fmt
        return made[fmt]

    return get
