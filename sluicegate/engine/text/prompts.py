"""A request's prompt as token ids, from text, token ids or chat messages. Shared by the
engine core (in-process use) and the worker process when the core runs in its own process,
where tokenizing happens beside the step loop rather than inside it."""

from __future__ import annotations

from typing import Any

from sluicegate.engine.serving.request_options import RequestOptions
from sluicegate.engine.text.template_inputs import template_tools
from sluicegate.engine.text.tokenizer import Tokenizer


def prompt_ids(
    tokenizer: Tokenizer,
    vocab_size: int,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
    messages: list[Any] | None = None,
    options: RequestOptions | None = None,
) -> list[int]:
    given = [x is not None for x in (prompt, prompt_token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids, messages")
    if prompt is not None:
        return tokenizer.encode(prompt)
    if messages is not None:
        kwargs = dict(options.chat_template_kwargs or {}) if options else {}
        if options is not None and options.uses_tools:
            kwargs["tools"] = template_tools(options.tools or [])
        return tokenizer.apply_chat_template(messages, **kwargs)
    assert prompt_token_ids is not None
    if any(not 0 <= t < vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    return list(prompt_token_ids)
