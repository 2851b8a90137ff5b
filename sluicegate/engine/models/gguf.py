"""GGUF checkpoints (llama.cpp's and Ollama's files): ``--model file.gguf``, or a folder that
holds one GGUF file and no ``config.json``.

transformers reads the file (through the ``gguf`` package): the architecture's config, the
tokenizer with its chat template, and every tensor, quantized ones dequantized to float32.
That is written once as a plain Hugging Face folder (float32 safetensors, so a float32 engine
serves exactly the values transformers' own ``gguf_file=`` load computes with, and a bfloat16
one rounds them once at load), which the ordinary loaders then serve. The folder is cached by
the file's path, size and modification time under ``$SLUICEGATE_CACHE_DIR`` (default
``~/.cache/sluicegate``), so a restart does not convert again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "SLUICEGATE_CACHE_DIR"
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")


class UnreadableGGUFError(ValueError):
    """A GGUF file this engine cannot serve: split, or holding a type the reader lacks."""


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file ``path`` names: the file itself, or the one ``*.gguf`` in a folder that
    has no ``config.json``; None for anything else (a Hugging Face folder)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1 and not all(_SPLIT.search(f.name) for f in found):
            raise UnreadableGGUFError(
                f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): "
                "name the one to serve"
            )
        if found:
            return found[0]
    return None


def checkpoint_folder(model: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A Hugging Face folder for ``model``: itself, or its GGUF file converted (once)."""
    file = gguf_file(model)
    if file is None:
        return Path(model)
    root = Path(cache_dir or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sluicegate")
    return convert(file, root / "gguf" / f"{file.stem}-{_fingerprint(file)}")


def _fingerprint(file: Path) -> str:
    stat = file.stat()
    key = f"{file.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def convert(file: Path, folder: Path) -> Path:
    """``file`` as a Hugging Face folder at ``folder`` (kept if already there)."""
    if (folder / "config.json").is_file():
        return folder
    if _SPLIT.search(file.name):
        raise UnreadableGGUFError(
            f"{file.name} is one part of a split GGUF file; merge the parts into one file "
            "first (llama.cpp's `llama-gguf-split --merge`)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s (dequantizing its tensors once, into %s)", file.name, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            model = AutoModelForCausalLM.from_pretrained(
                file.parent, gguf_file=file.name, dtype=torch.float32
            )
        except Exception as exc:  # any reader failure: one error naming the file and its types
            raise UnreadableGGUFError(
                f"cannot read {file.name} (tensor types {', '.join(_tensor_types(file))}): {exc}"
            ) from exc
        _plain_copy(model).save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted %s", file.name)
    return folder


def _plain_copy(model):  # -> transformers.PreTrainedModel
    """The same class and tensors without the GGUF quantizer transformers attached, which
    refuses to save: the tensors are dequantized already, so nothing is lost."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    with torch.device("meta"):
        plain = type(model)(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    return plain


def _tensor_types(file: Path) -> list[str]:
    try:
        from gguf import GGUFReader

        return sorted({tensor.tensor_type.name for tensor in GGUFReader(file).tensors})
    except Exception:  # the file is unreadable already: the caller's error says so
        return ["unknown"]
