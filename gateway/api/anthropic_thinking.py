"""Signatures on the ``thinking`` blocks we return, checked when a client sends them back.

Anthropic's clients keep a reply's ``thinking`` blocks and send them back in later turns (Claude
Code does so in every tool loop), each with the ``signature`` it came with, and Anthropic
refuses a block whose text was changed. Ours is the same promise: the signature is an
HMAC-SHA256 of the thinking text under a key derived from the gateway's master key, so every
replica issues and accepts the same signatures, and a thinking block sent back with any other
signature (text edited, signature altered or left out) is a 400 naming it. Rotating the master
key retires the signatures issued before; a gateway without a master key signs with a key of
its own process.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os

from gateway.errors import InvalidRequest
from gateway.translate.anthropic_in import MessageParam, ThinkingBlock

PREFIX = "sg1."
"""Versions the scheme, so a later one can be told apart (and old signatures refused)."""
_CONTEXT = b"sluicegate thinking signature v1"


class ThinkingSigner:
    def __init__(self, secret: bytes) -> None:
        self._key = hmac.new(secret, _CONTEXT, hashlib.sha256).digest()

    def sign(self, thinking: str) -> str:
        mac = hmac.new(self._key, thinking.encode(), hashlib.sha256).digest()
        return PREFIX + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()

    def valid(self, thinking: str, signature: str | None) -> bool:
        return signature is not None and hmac.compare_digest(self.sign(thinking), signature)

    def check(self, messages: list[MessageParam]) -> None:
        """A 400 for the first thinking block whose signature is not ours for its text."""
        for i, message in enumerate(messages):
            if isinstance(message.content, str):
                continue
            for j, block in enumerate(message.content):
                if isinstance(block, ThinkingBlock) and not self.valid(
                    block.thinking, block.signature
                ):
                    raise InvalidRequest(
                        "This thinking block's signature does not match its text: send thinking "
                        "blocks back exactly as they were returned.",
                        param=f"messages[{i}].content[{j}].signature",
                    )


@functools.lru_cache(maxsize=4)
def signer_for(master_key: str) -> ThinkingSigner:
    """The signer of a gateway with this master key (one per process when there is none)."""
    return ThinkingSigner(master_key.encode() if master_key else os.urandom(32))
