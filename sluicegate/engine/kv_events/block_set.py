"""One worker's prefix cache as its KV events describe it: the set of block hashes a request
could reuse there, and how long a prefix of a request's blocks it holds."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sluicegate.engine.kv_events import messages as kv_messages


class BlockSet:
    def __init__(self) -> None:
        self.parents: dict[int, int | None] = {}
        """Cached block hash -> its parent's hash (None for a first block)."""

    def apply(self, events: Iterable[kv_messages.KvEvent]) -> None:
        for event in events:
            if isinstance(event, kv_messages.KvBlockStored):
                self.parents[event.block_hash] = event.parent_hash
            elif isinstance(event, kv_messages.KvBlockRemoved):
                self.parents.pop(event.block_hash, None)
            else:
                self.parents.clear()

    def load(self, block_hashes: Iterable[int]) -> None:
        """Replace the contents by a snapshot's (parents unknown: they only place blocks)."""
        self.parents = dict.fromkeys(block_hashes)

    def hashes(self) -> set[int]:
        return set(self.parents)

    def __len__(self) -> int:
        return len(self.parents)

    def prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """How many of ``block_hashes`` (a request's chain, first block first) are cached, in
        a row from the first: the blocks its prefill would reuse here."""
        parents = self.parents
        for count, block_hash in enumerate(block_hashes):
            if block_hash not in parents:
                return count
        return len(block_hashes)
