"""A request's prompt token ids as a worker computes them, from the ``TokenizerFiles`` it
published: ``tokenizers`` for the fast tokenizer, Jinja for the chat template. Torch-free, so
a gateway can hash a request's blocks the way the worker's prefix cache will."""

from __future__ import annotations

import hashlib

import msgspec
from tokenizers import Tokenizer

from sluicegate.engine import protocol
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.text.chat_render import pick_template, render_chat
from sluicegate.engine.text.template_inputs import message_dict, template_tools


def tokenizer_digest(files: kv_messages.TokenizerFiles) -> str:
    """The name a worker publishes ``files`` under: equal files, equal name, so workers of
    one checkpoint share one copy."""
    return hashlib.blake2b(protocol.encode(files), digest_size=12).hexdigest()


class PromptTokenizer:
    def __init__(self, files: kv_messages.TokenizerFiles) -> None:
        self.files = files
        self.tokenizer = Tokenizer.from_str(files.tokenizer_json)

    def prompt_token_ids(self, request: protocol.Request) -> list[int] | None:
        """What the worker's prefix cache sees of ``request``; None where this side cannot tell
        (a chat request to a tokenizer without a template, a template that fails to render:
        the worker answers those with an error anyway)."""
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None:
            return self.tokenizer.encode(request.prompt, add_special_tokens=True).ids
        if request.messages is None:
            return None
        kwargs = dict(request.chat_template_kwargs or {})
        tools = None
        if request.tools and request.tool_choice != "none":
            tools = template_tools(request.tools)
        template = pick_template(self.files.chat_template, tools)
        if template is None:
            return None
        messages = [message_dict(m) for m in msgspec.to_builtins(request.messages)]
        try:
            text = render_chat(template, messages, self.files.special_tokens, tools, **kwargs)
        except Exception:  # a template's own raise_exception, or one it cannot render
            return None
        # The template wrote any BOS it wants, as the worker's tokenizer assumes.
        return self.tokenizer.encode(text, add_special_tokens=False).ids
