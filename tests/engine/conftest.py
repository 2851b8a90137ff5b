"""Tiny random Hugging Face model folders (Llama, Qwen2, Qwen3) with a real trained tokenizer.

Each folder is what ``LLM(model=...)`` loads in production: config.json, safetensors weights
(the Llama one sharded, with an index), generation_config.json and tokenizer files. Weights use
a large initializer range so that greedy decoding has clear winners: with the usual 0.02,
a tiny random model has near-tied logits and comparisons would hinge on rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from sluicegate.engine.text.chat_templates import MARKUP_TOKENS, hermes_chat_template

VOCAB_SIZE = 320
EOS_TOKEN = "</s>"
CHAT_TEMPLATE = hermes_chat_template()
THINKING_CHAT_TEMPLATE = hermes_chat_template(thinking=True)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size blocks of sixteen tokens.",
    "Continuous batching admits new requests at every step; finished ones leave at once.",
    "Héllo wörld, naïve café — ünïcödé ☃ 日本語のテキスト, emoji 🚀🌊 and numbers 0123456789.",
    "user assistant system: what is the capital of France? Paris is the capital of France.",
]


def build_tokenizer(thinking: bool = False) -> PreTrainedTokenizerFast:
    """A byte-level BPE (every UTF-8 byte is a token, so multi-byte characters split across
    tokens, as the detokenizer must handle) with a Hermes-style chat template that supports
    tools (and, with ``thinking``, Qwen3-style ``<think>`` blocks). The call and thinking markup
    are single added tokens that stay in decoded text, as in Qwen's tokenizers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MARKUP_TOKENS),
        special_tokens=["<s>", EOS_TOKEN, "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token=EOS_TOKEN,
        pad_token="<pad>",
        chat_template=THINKING_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE,
    )


_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def _llama() -> torch.nn.Module:
    config = LlamaConfig(
        **_COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _qwen2() -> torch.nn.Module:
    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=True))


def _qwen3() -> torch.nn.Module:
    return Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=32, tie_word_embeddings=False))


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
}


def save_model(kind: str, folder: Path) -> Path:
    torch.manual_seed(1234)
    model = BUILDERS[kind]().float().eval()
    # Random biases too (HF zero-initialises them), so a missed Qwen2 qkv bias would show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3)
    shard = "60KB" if kind == "llama" else "50MB"
    model.save_pretrained(folder, max_shard_size=shard)
    build_tokenizer(thinking=kind == "qwen3").save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a machine shared with other
    busy processes a second thread can slow every op down many times over."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-models")
    return {kind: save_model(kind, root / kind) for kind in BUILDERS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]
