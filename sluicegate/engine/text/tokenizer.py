"""Tokenizer access (encode, chat template) and incremental, stop-string-aware detokenizing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sluicegate.engine.text.template_inputs import message_dict

# Prompt tokens decoded together with the first output tokens, so that a word-initial token
# gets its leading space (SentencePiece-style decoders drop it at the start of a text).
_CONTEXT_TOKENS = 5
_BROKEN_CHAR = "\ufffd"


class Tokenizer:
    """The model folder's Hugging Face tokenizer plus the EOS ids generation should stop on."""

    def __init__(self, model_path: str | Path) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model_path))
        self.eos_token_ids = _eos_token_ids(self.hf, Path(model_path))
        self._token_bytes: list[bytes] | None = None
        self._token_bytes_lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text))

    def decode(self, token_ids: Iterable[int]) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        template = self.hf.chat_template
        if isinstance(template, dict):
            return template.get("tool_use") or template.get("default")
        return template

    def single_token_id(self, text: str) -> int | None:
        """The id of the one token that is exactly ``text`` (an added token), if any."""
        ids = self.hf.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for (byte-level and byte-fallback aware)."""
        if self._token_bytes is None:
            with self._token_bytes_lock:
                if self._token_bytes is None:
                    self._token_bytes = _decoded_vocab(self.hf)
        if 0 <= token_id < len(self._token_bytes) and self._token_bytes[token_id]:
            return self._token_bytes[token_id]
        return self.hf.decode([token_id]).encode()

    def apply_chat_template(self, messages: list[Any], **template_kwargs: Any) -> list[int]:
        """Messages are mappings or objects with ``role``/``content`` (e.g. protocol structs);
        ``template_kwargs`` become template variables (``tools``, ``enable_thinking``...)."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; send a plain prompt")
        text = self.hf.apply_chat_template(
            [message_dict(m) for m in messages],
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )
        # The template already wrote any BOS it wants; adding special tokens would double it.
        return list(self.hf.encode(text, add_special_tokens=False))


def _decoded_vocab(hf: PreTrainedTokenizerBase) -> list[bytes]:
    import xgrammar

    return list(xgrammar.TokenizerInfo.from_huggingface(hf).decoded_vocab)


def _eos_token_ids(hf: PreTrainedTokenizerBase, model_path: Path) -> set[int]:
    ids: set[int] = set()
    if hf.eos_token_id is not None:
        ids.add(int(hf.eos_token_id))
    # Chat models often end turns with a token that generation_config.json lists as EOS.
    generation_config = model_path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive.

    ``text`` only ever grows by whole characters (a token ending inside a multi-byte UTF-8
    character waits for the next one). When a stop string appears, ``text`` is cut right before
    it and ``stopped`` is set. ``pop_delta`` hands out the text not yet delivered, holding back
    any tail that could still become a stop string, so a partial stop string never streams out.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._stop = list(stop or [])
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._emitted = 0
        self.text = ""
        self.stopped = False
        self.stopped_by: str | None = None
        """The stop string that ended the text."""

    def add_token(self, token_id: int) -> None:
        if self.stopped:
            return
        self._tokens.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_BROKEN_CHAR):
            return
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._append_text(full_text[len(prefix_text) :])

    def replay(self, token_ids: list[int]) -> str:
        """Take outputs produced and streamed elsewhere, one step per token as they were made,
        so later deltas continue exactly where that stream stopped; the text it delivered."""
        for token in token_ids:
            self.add_token(token)
            self.pop_delta()
        return self.text[: self._emitted]

    def _append_text(self, new_text: str) -> None:
        search_from = max(0, len(self.text) - self._max_stop_len + 1)
        self.text += new_text
        if not self._stop:
            return
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        if hits:
            at, self.stopped_by = min(hits, key=lambda hit: hit[0])
            self.text = self.text[:at]
            self.stopped = True

    def pop_delta(self, final: bool = False) -> str:
        """Text not yet delivered; on ``final`` (or once stopped) nothing is held back."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
