"""Prefix affinity without tokenizing: which engine worker last served a prompt's prefix.

Where workers publish no KV events (docs/kv-events.md) the gateway cannot compute the engine's
block hashes. It hashes the prompt as the client sent it instead: a chain of hashes over
fixed-size character chunks of the rendered messages (or the prompt), each hash covering
everything before it, like the engine's block-hash chain. When a worker serves a request, the gateway maps the request's
prefix hashes to that worker in Redis (short TTL). A later request sharing the prefix finds
the deepest mapped hash and goes to that worker's own stream, where its KV blocks are likely
still cached, unless that worker is much busier than the others. A request with a LoRA
adapter seeds the chain with the adapter's name: the engine never shares a prefix's KV blocks
across adapters, so neither does the map.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from sluicegate.engine.protocol import ChatMessage

CHUNK_CHARS = 256
MAX_CHUNKS = 64


def render_prompt(messages: Sequence[ChatMessage] | None, prompt: str | list[int] | None) -> bytes:
    if messages is not None:
        return b"".join(
            f"{m.role}\x1f{m.name or ''}\x1f{m.content or ''}\x1e".encode() for m in messages
        )
    if isinstance(prompt, list):
        return b",".join(str(t).encode() for t in prompt)
    return (prompt or "").encode()


def prefix_hashes(
    rendered: bytes,
    chunk_chars: int = CHUNK_CHARS,
    max_chunks: int = MAX_CHUNKS,
    *,
    adapter: str | None = None,
) -> list[int]:
    """Chained 64-bit hashes of each full ``chunk_chars`` chunk, first chunk first."""
    hashes: list[int] = []
    parent = b"lora\x1f" + adapter.encode() if adapter is not None else b""
    for start in range(0, min(len(rendered) // chunk_chars, max_chunks) * chunk_chars, chunk_chars):
        parent = hashlib.blake2b(
            parent + rendered[start : start + chunk_chars], digest_size=8
        ).digest()
        hashes.append(int.from_bytes(parent, "big"))
    return hashes
