"""The worker's tokenizer as ``TokenizerFiles``: what a gateway needs to tokenize prompts the
same way (``prompt_tokens.PromptTokenizer``)."""

from __future__ import annotations

from typing import Any

from sluicegate.engine.kv_events import messages as kv_messages


def tokenizer_files(hf_tokenizer: Any) -> kv_messages.TokenizerFiles | None:
    """From a transformers tokenizer; None for a slow (Python) one, which has no ``tokenizers``
    form: a gateway then routes that model's requests by text hashing."""
    if not getattr(hf_tokenizer, "is_fast", False):
        return None
    template = hf_tokenizer.chat_template
    special: dict[str, str | list[str]] = {}
    for name, value in hf_tokenizer.special_tokens_map.items():
        if isinstance(value, str):
            special[name] = value
        elif isinstance(value, list):
            special[name] = [str(v) for v in value]
    return kv_messages.TokenizerFiles(
        # The backend as loaded, with whatever transformers changed at load (BOS handling).
        tokenizer_json=hf_tokenizer.backend_tokenizer.to_str(),
        chat_template=dict(template) if isinstance(template, dict) else template,
        special_tokens=special,
    )
