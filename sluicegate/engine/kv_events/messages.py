"""The KV-event wire messages (``sluicegate.engine.protocol`` names their streams and keys):
what a worker's prefix cache gains and loses, batched per step; its snapshot for a reader that
lost track; and its tokenizer files, so a gateway hashes a request's blocks as the worker would.
Torch-free: the gateway imports it."""

from __future__ import annotations

import msgspec

from sluicegate.engine.protocol import decode_with, writer_version


class KvBlockStored(msgspec.Struct, tag="stored", array_like=True):
    """A full block entered the prefix cache: its chained hash, its parent's (for a prompt's
    first block: None, or a LoRA adapter's hash seed) and its tokens, so a reader can place it
    in the chain."""

    block_hash: int
    parent_hash: int | None
    token_ids: list[int]


class KvBlockRemoved(msgspec.Struct, tag="removed", array_like=True):
    """A cached block was evicted: a request can no longer reuse it."""

    block_hash: int


class KvAllCleared(msgspec.Struct, tag="cleared", array_like=True):
    """The prefix cache is empty (the first batch of every worker start)."""


KvEvent = KvBlockStored | KvBlockRemoved | KvAllCleared


class KvEventBatch(msgspec.Struct, tag="kv_batch"):
    """One engine step's prefix-cache changes, in order. ``seq`` counts a worker start's
    batches from 0 (``epoch`` names that start), so a reader sees a batch it missed."""

    worker_id: str
    epoch: str
    seq: int
    block_size: int
    events: list[KvEvent]
    v: int = msgspec.field(default_factory=writer_version)


class KvSnapshot(msgspec.Struct, tag="kv_snapshot"):
    """Every block hash in a worker's prefix cache once batch ``seq`` of ``epoch`` applied; a
    reader that lost track loads it, then reads the stream after entry ``after``, skipping the
    batches up to ``seq``."""

    worker_id: str
    epoch: str
    seq: int
    after: str
    block_size: int
    block_hashes: list[int]
    v: int = msgspec.field(default_factory=writer_version)


class TokenizerFiles(msgspec.Struct, tag="tokenizer"):
    """What a gateway needs to turn a request into the worker's prompt token ids without
    torch or transformers: the fast tokenizer as the worker loaded it (``tokenizers`` JSON),
    its chat template(s) and the special tokens the template sees."""

    tokenizer_json: str
    chat_template: str | dict[str, str] | None
    special_tokens: dict[str, str | list[str]]
    v: int = msgspec.field(default_factory=writer_version)


KvMessage = KvEventBatch | KvSnapshot | TokenizerFiles
_kv_decoder = msgspec.msgpack.Decoder(KvMessage)


def decode_kv(data: bytes) -> KvMessage:
    """A KV-event stream entry, a snapshot or tokenizer files (kept out of
    ``protocol.Message``: the reply and request streams never carry them)."""
    return decode_with(_kv_decoder, data)
