"""Signatures on the ``thinking`` blocks we return, checked when a client sends them back.

Anthropic's clients keep a reply's ``thinking`` blocks and send them back in later turns (Claude
Code does so in every tool loop), each with the ``signature`` it came with, and Anthropic
refuses a block whose text was changed. Ours is the same promise: the signature is an
HMAC-SHA256 of the thinking text under a key derived from the gateway's master key, so every
replica issues and accepts the same signatures, and a thinking block sent back with any other
signature (text edited, signature altered or left out) is a 400 naming it. When the backend
signed the thinking itself (an Anthropic deployment), its signature travels inside ours, and
goes back to it with the block. Rotating the master
key retires the signatures issued before; a gateway without a master key signs with a key of
its own process.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import os

from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.translate.anthropic_in import MessageParam, ThinkingBlock

PREFIX = "sg1."
"""Versions the scheme, so a later one can be told apart (and old signatures refused)."""
_CONTEXT = b"sluicegate thinking signature v1"


class ThinkingSigner:
    """``sign`` a thinking text (and the signature its backend gave it, if any); ``unwrap``
    the thinking blocks a client sent back."""

    def __init__(self, secret: bytes) -> None:
        self._key = hmac.new(secret, _CONTEXT, hashlib.sha256).digest()

    def _mac(self, thinking: str, upstream: str) -> str:
        signed = json.dumps([thinking, upstream]).encode()  # unambiguous: both are quoted
        mac = hmac.new(self._key, signed, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def sign(self, thinking: str, upstream: str = "") -> str:
        """Ours: ``sg1.<mac>``, followed by ``.<upstream>`` when the backend signed the text
        itself (Anthropic does, and wants its signature back with the block)."""
        signature = PREFIX + self._mac(thinking, upstream)
        return f"{signature}.{upstream}" if upstream else signature

    def upstream_of(self, thinking: str, signature: str | None) -> str | None:
        """The backend's signature inside one of ours (``""`` if it had none); ``None`` when
        ``signature`` is not ours for ``thinking``."""
        if not signature or not signature.startswith(PREFIX):
            return None
        mac, _, upstream = signature[len(PREFIX) :].partition(".")
        return upstream if hmac.compare_digest(self._mac(thinking, upstream), mac) else None

    def unwrap(self, messages: list[MessageParam]) -> None:
        """Check every thinking block's signature, and leave in it only the backend's own (or
        none): a 400 for the first block whose signature is not ours for its text."""
        for i, message in enumerate(messages):
            if isinstance(message.content, str):
                continue
            for j, block in enumerate(message.content):
                if not isinstance(block, ThinkingBlock):
                    continue
                upstream = self.upstream_of(block.thinking, block.signature)
                if upstream is None:
                    raise InvalidRequest(
                        "This thinking block's signature does not match its text: send thinking "
                        "blocks back exactly as they were returned.",
                        param=f"messages[{i}].content[{j}].signature",
                    )
                block.signature = upstream or None


@functools.lru_cache(maxsize=4)
def signer_for(master_key: str) -> ThinkingSigner:
    """The signer of a gateway with this master key (one per process when there is none)."""
    return ThinkingSigner(master_key.encode() if master_key else os.urandom(32))
