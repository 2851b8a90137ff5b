"""KV-cache blocks: who holds which block, and which full blocks can be reused by hash.

The cache is ``num_blocks`` fixed-size blocks of ``block_size`` token slots. A block is in
exactly one of three states:

- used: ``ref_count > 0``, referenced by that many live block tables;
- cached: ``ref_count == 0`` but it still holds a full block known to the prefix cache; it
  counts as free and is reclaimed least-recently-freed first when fresh blocks run out;
- free: ``ref_count == 0`` and no content worth keeping.

Every operation is O(1) per block: a deque of free blocks, an ``OrderedDict`` of cached
blocks in LRU order and a dict from block hash to block id. Blocks are allocated on demand
only, for the tokens a step will compute, so the only slack is each sequence's last,
partly filled block.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as TokenIds

from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.kv_events.messages import KvBlockRemoved, KvBlockStored, KvEvent


def hash_block(parent_hash: int | None, token_ids: TokenIds[int]) -> int:
    """Chained hash of one full block: equal iff the whole prefix up to here is equal.

    blake2b (not Python's ``hash``) so that the value is stable across processes: the gateway
    routes requests by prefix using the same function.
    """
    digest = hashlib.blake2b(digest_size=8)
    if parent_hash is not None:
        digest.update(parent_hash.to_bytes(8, "little", signed=True))
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(digest.digest(), "little", signed=True)


def compute_block_hashes(
    token_ids: TokenIds[int], block_size: int, seed: int | None = None
) -> list[int]:
    """Chained hashes of every full block of ``token_ids`` (a trailing partial block has
    none); ``seed`` starts the chain (a LoRA adapter's ``hash_seed``; None: the base model)."""
    hashes: list[int] = []
    parent: int | None = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set only while this block is the prefix cache's entry for its hash.
        self.block_hash: int | None = None


class BlockManager:
    """Allocates block tables for sequences and shares full blocks through a prefix cache.

    Prefix-cache statistics count tokens: ``prefix_cache_queries`` adds a sequence's token
    count at each admission, ``prefix_cache_hits`` the tokens served from the cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[int, int] = {}
        # Sum over used blocks of (ref_count - 1): references beyond the first, which only
        # shared (hence full) prefix blocks have.
        self.num_shared_refs = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.kv_events: list[KvEvent] | None = None
        """Changes to the prefix cache since they were last taken (``record_events``)."""

    def record_events(self) -> None:
        """From now on, note each block entering and leaving the prefix cache in ``kv_events``
        (its owner takes them every step, so a reader can follow the cache's contents)."""
        self.kv_events = []

    def take_events(self) -> list[KvEvent]:
        if self.kv_events is None:
            return []
        events, self.kv_events = self.kv_events, []
        return events

    # -- accounting -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation may take: truly free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._cached)

    def cached_block_hashes(self) -> set[int]:
        """Every hash a request could reuse now (held or evictable): what KV events describe."""
        return set(self._hash_to_block)

    def cached_block_ids_lru(self) -> list[int]:
        """Evictable cached blocks, next to be evicted first."""
        return list(self._cached)

    # -- prefix cache -----------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Block ids of the longest cached prefix of ``seq``, never covering its last token.

        The last token must be computed by the model so that its logits exist, hence at most
        ``(num_tokens - 1) // block_size`` blocks can come from the cache.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = seq.hash_seed
        tokens = seq.token_ids
        size = self.block_size
        for start in range(0, (seq.num_tokens - 1) // size * size, size):
            parent = hash_block(parent, tokens[start : start + size])
            block_id = self._hash_to_block.get(parent)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the newly computed full blocks of ``seq`` to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        tokens = seq.token_ids
        hashes = seq.block_hashes
        for index in range(len(hashes), seq.num_computed_tokens // size):
            parent = hashes[-1] if hashes else seq.hash_seed
            block_hash = hash_block(parent, tokens[index * size : (index + 1) * size])
            hashes.append(block_hash)
            # Two sequences may compute the same block side by side before either is
            # cached; the first one registered stays the cache entry, the twin stays private.
            if block_hash not in self._hash_to_block:
                block = self.blocks[seq.block_table[index]]
                block.block_hash = block_hash
                self._hash_to_block[block_hash] = block.block_id
                if self.kv_events is not None:
                    block_tokens = list(tokens[index * size : (index + 1) * size])
                    self.kv_events.append(KvBlockStored(block_hash, parent, block_tokens))

    # -- allocation -------------------------------------------------------------------------

    def can_allocate(self, cached_blocks: list[int], num_tokens: int) -> bool:
        """Whether a waiting sequence can hold ``num_tokens`` tokens, reusing ``cached_blocks``."""
        reclaimed = sum(1 for block_id in cached_blocks if self.blocks[block_id].ref_count == 0)
        fresh = blocks_for(num_tokens, self.block_size) - len(cached_blocks)
        return fresh + reclaimed <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_tokens: int) -> None:
        """Give a waiting sequence blocks for its first ``num_tokens`` tokens.

        ``cached_blocks`` (from :meth:`match_prefix`) become the head of the table and count as
        computed; fresh blocks cover the rest. Call :meth:`can_allocate` first.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq.request_id} already holds blocks")
        hashes: list[int] = []
        for block_id in cached_blocks:
            block_hash = self.blocks[block_id].block_hash
            if block_hash is None:
                raise RuntimeError(f"block {block_id} left the prefix cache since it matched")
            hashes.append(block_hash)
            self._ref(block_id)
        seq.block_table = list(cached_blocks)
        seq.block_hashes = hashes
        seq.num_cached_tokens = seq.num_computed_tokens = len(cached_blocks) * self.block_size
        self._grow(seq, num_tokens)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += seq.num_cached_tokens

    def can_append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether a running sequence can compute ``num_new_tokens`` more tokens."""
        needed = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return needed - len(seq.block_table) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow a running sequence's table to hold ``num_new_tokens`` more tokens."""
        self._grow(seq, seq.num_computed_tokens + num_new_tokens)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink a running sequence's table to ``num_tokens`` tokens: the blocks past them
        held only rejected draft tokens (never hashed: only computed, accepted tokens are),
        so they go back as fresh, first in line to be taken again."""
        keep = blocks_for(num_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.block_hash is None, "a draft's block"
            block.ref_count = 0
            self._free.appendleft(block_id)

    def fork(
        self, parent: Sequence, child: Sequence, num_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Give ``child`` the KV of ``parent``'s first ``num_tokens`` tokens: full blocks are
        shared (read-only from now on: both only ever append), the partly filled last block
        gets a fresh copy. Returns the (source, destination) copies; None if no block is free."""
        full, partial = divmod(num_tokens, self.block_size)
        if partial and self.num_free_blocks < 1:
            return None
        for block_id in parent.block_table[:full]:
            self._ref(block_id)
        child.block_table = parent.block_table[:full]
        child.block_hashes = parent.block_hashes[:full]
        child.num_cached_tokens = parent.num_cached_tokens
        if not partial:
            return []
        fresh = self._take_fresh()
        child.block_table.append(fresh)
        return [(parent.block_table[full], fresh)]

    def free(self, seq: Sequence) -> None:
        """Release a sequence's blocks; full cached ones stay reusable until evicted."""
        # Tail first, so that a sequence's last blocks are evicted before its prefix, which
        # other requests are likelier to share.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                self.num_shared_refs -= 1
            elif block.block_hash is not None:
                self._cached[block_id] = None
            else:
                self._free.append(block_id)
        seq.block_table = []
        seq.block_hashes = []

    # -- internals --------------------------------------------------------------------------

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        needed = blocks_for(num_tokens, self.block_size) - len(seq.block_table)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"{seq.request_id} needs {needed} blocks, only {self.num_free_blocks} free"
            )
        for _ in range(needed):
            seq.block_table.append(self._take_fresh())

    def _take_fresh(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached.popitem(last=False)
            block = self.blocks[block_id]
            assert block.block_hash is not None, "only hashed blocks are kept as cached"
            del self._hash_to_block[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.append(KvBlockRemoved(block.block_hash))
            block.block_hash = None
        self.blocks[block_id].ref_count = 1
        return block_id

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._cached[block_id]
        else:
            self.num_shared_refs += 1
        block.ref_count += 1
