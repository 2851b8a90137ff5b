"""Quantized checkpoints of a tiny random Llama (and of a Qwen2, for q/k/v biases and tied
embeddings), made once a session (``tests.engine.models.quant.checkpoints`` makes them and
reads them back)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.engine.models.quant.checkpoints import TOKENIZER_FILES, make_checkpoint


@pytest.fixture(scope="session")
def quant_base(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """The dense bfloat16 checkpoint every quantized one is made from."""
    folder = tmp_path_factory.mktemp("quant-base")
    torch.manual_seed(29)
    LlamaForCausalLM(LlamaConfig(**_SHAPE, tie_word_embeddings=False)).to(
        torch.bfloat16
    ).save_pretrained(folder)
    return _with_tokenizer(folder, llama_dir)


@pytest.fixture(scope="session")
def qwen2_quant_base(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """A dense bfloat16 Qwen2: random q/k/v biases (HF zero-initialises them), tied
    embeddings."""
    folder = tmp_path_factory.mktemp("quant-base-qwen2")
    torch.manual_seed(30)
    model = Qwen2ForCausalLM(Qwen2Config(**_SHAPE, tie_word_embeddings=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3)
    model.to(torch.bfloat16).save_pretrained(folder)
    return _with_tokenizer(folder, llama_dir)


_SHAPE = dict(
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
)


def _with_tokenizer(folder: Path, llama_dir: Path) -> Path:
    for name in TOKENIZER_FILES:
        if (llama_dir / name).is_file():
            shutil.copy(llama_dir / name, folder / name)
    return folder


def _maker(root: Path, base: Path) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            make_checkpoint(base, root / fmt, fmt)
            made[fmt] = root / fmt
        return made[fmt]

    return get


@pytest.fixture(scope="session")
def quantized(tmp_path_factory: pytest.TempPathFactory, quant_base: Path) -> Callable[[str], Path]:
    """The Llama folder of a format in FORMATS, made on first use."""
    return _maker(tmp_path_factory.mktemp("quantized"), quant_base)


@pytest.fixture(scope="session")
def qwen2_quantized(
    tmp_path_factory: pytest.TempPathFactory, qwen2_quant_base: Path
) -> Callable[[str], Path]:
    """The Qwen2 folder of a format in FORMATS, made on first use."""
    return _maker(tmp_path_factory.mktemp("quantized-qwen2"), qwen2_quant_base)
