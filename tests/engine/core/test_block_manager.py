"""Block manager: on-demand allocation, reference counts, prefix caching and LRU eviction."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from sluicegate.engine.core.block_manager import BlockManager, compute_block_hashes, hash_block
from sluicegate.engine.core.sequence import Sequence

BS = 4


@dataclass
class Params:
    max_tokens: int = 8
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = field(default=None)


def make_seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, tokens, Params())


def admit(manager: BlockManager, seq: Sequence, num_tokens: int | None = None) -> list[int]:
    """Admit like the scheduler does: reuse the cached prefix, allocate the rest, compute it."""
    cached = manager.match_prefix(seq)
    total = seq.num_tokens if num_tokens is None else num_tokens
    assert manager.can_allocate(cached, total)
    manager.allocate(seq, cached, total)
    seq.num_computed_tokens = total
    manager.cache_full_blocks(seq)
    return cached


def test_block_hashes_chain_over_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, BS)
    assert len(hashes) == 2  # the trailing 2 tokens form no full block
    assert hashes[0] == hash_block(None, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # Same second block after a different first block: the chain makes it differ.
    other = compute_block_hashes([99, 1, 2, 3, *tokens[4:8]], BS)
    assert other[1] != hashes[1]
    assert compute_block_hashes(tokens[:8], BS) == hashes
    assert compute_block_hashes(tokens[:3], BS) == []


def test_block_hashes_are_stable_across_processes() -> None:
    code = "from sluicegate.engine.core.block_manager import compute_block_hashes as c; print(c(list(range(40)), 16))"
    outputs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(run.stdout.strip())
    assert outputs == {str(compute_block_hashes(list(range(40)), 16))}


def test_allocation_is_on_demand_and_grows_with_the_sequence() -> None:
    manager = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq("a", list(range(6)))
    manager.allocate(seq, [], 3)  # a first prefill chunk of 3 tokens needs one block
    assert len(seq.block_table) == 1 and manager.num_used_blocks == 1
    seq.num_computed_tokens = 3
    manager.append_slots(seq, 3)
    assert len(seq.block_table) == 2
    seq.num_computed_tokens = 6
    for token in range(6, 9):
        seq.append_token(token)
        manager.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == -(-seq.num_computed_tokens // BS)
    assert manager.num_used_blocks == 3 and manager.num_free_blocks == 5
    manager.free(seq)
    assert seq.block_table == [] and manager.num_free_blocks == 8


def test_can_append_slots_and_exhaustion() -> None:
    manager = BlockManager(2, BS, enable_prefix_caching=False)
    seq = make_seq("a", list(range(8)))
    manager.allocate(seq, [], 8)
    seq.num_computed_tokens = 8
    assert not manager.can_append_slots(seq, 1)
    with pytest.raises(RuntimeError, match="needs 1 blocks"):
        manager.append_slots(seq, 1)
    assert manager.num_used_blocks == 2


def test_prefix_hit_shares_blocks_and_counts_references() -> None:
    manager = BlockManager(16, BS)
    prefix = list(range(100, 108))  # two full blocks
    first = make_seq("a", [*prefix, 1, 2, 3])
    admit(manager, first)
    second = make_seq("b", [*prefix, 7, 8])
    cached = admit(manager, second)
    assert cached == first.block_table[:2]
    assert second.num_cached_tokens == 8
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    assert manager.num_shared_refs == 2
    assert manager.num_used_blocks == 3 + 1  # the shared prefix counted once
    assert manager.prefix_cache_queries == 11 + 10
    assert manager.prefix_cache_hits == 8
    manager.free(first)
    assert [manager.blocks[b].ref_count for b in second.block_table] == [1, 1, 1]
    assert manager.num_shared_refs == 0
    manager.free(second)
    assert manager.num_used_blocks == 0


def test_freed_blocks_stay_reusable_until_evicted() -> None:
    manager = BlockManager(4, BS)
    tokens = list(range(9))
    first = make_seq("a", tokens)
    admit(manager, first)
    table = list(first.block_table)
    manager.free(first)
    assert manager.num_free_blocks == 4
    assert manager.num_cached_free_blocks == 2  # the two full blocks, not the partial third
    again = make_seq("b", tokens)
    assert admit(manager, again) == table[:2]
    assert manager.num_cached_free_blocks == 0


def test_cache_hit_never_covers_the_last_prompt_token() -> None:
    manager = BlockManager(8, BS)
    tokens = list(range(8))  # exactly two full blocks
    admit(manager, make_seq("a", tokens))
    repeat = make_seq("b", tokens)
    cached = manager.match_prefix(repeat)
    assert len(cached) == 1  # the second block holds the last token: it must be computed
    assert len(manager.match_prefix(make_seq("c", [*tokens, 50]))) == 2


def test_lru_eviction_takes_the_least_recently_freed_first() -> None:
    manager = BlockManager(6, BS)
    old = make_seq("old", [*range(8), 0])
    new = make_seq("new", [*range(20, 28), 0])
    admit(manager, old)
    admit(manager, new)
    old_full, new_full = old.block_table[:2], new.block_table[:2]
    manager.free(old)
    manager.free(new)
    # Tail first within a sequence, then sequences in the order they were freed.
    assert manager.cached_block_ids_lru() == [old_full[1], old_full[0], new_full[1], new_full[0]]

    # Two truly free blocks go first, then the oldest cached ones are evicted.
    filler = make_seq("filler", list(range(50, 62)))
    manager.allocate(filler, [], 12)
    assert manager.cached_block_ids_lru() == [old_full[0], new_full[1], new_full[0]]
    assert manager.match_prefix(make_seq("x", [*range(8), 1])) == [old_full[0]]
    assert manager.match_prefix(make_seq("y", [*range(20, 28), 1])) == new_full
    manager.free(filler)


def test_reusing_a_cached_block_refreshes_its_place_in_the_lru() -> None:
    manager = BlockManager(4, BS)
    a = make_seq("a", [*range(4), 0])
    b = make_seq("b", [*range(10, 14), 0])
    admit(manager, a)
    admit(manager, b)
    block_a, block_b = a.block_table[0], b.block_table[0]
    manager.free(a)
    manager.free(b)
    assert manager.cached_block_ids_lru() == [block_a, block_b]
    reuse = make_seq("a2", [*range(4), 9])
    assert admit(manager, reuse) == [block_a]
    manager.free(reuse)
    # a's block was freed again after b's, so b's is now the one to evict.
    assert manager.cached_block_ids_lru() == [block_b, block_a]


def test_can_allocate_counts_reclaimed_cached_blocks() -> None:
    manager = BlockManager(3, BS)
    first = make_seq("a", [*range(8), 0])
    admit(manager, first)
    manager.free(first)
    hit = make_seq("b", [*range(8), 5, 6, 7, 8, 9])
    cached = manager.match_prefix(hit)
    assert len(cached) == 2
    # 13 tokens need 4 blocks: 2 reused + 2 fresh, but only 1 block would remain free.
    assert not manager.can_allocate(cached, 13)
    assert manager.can_allocate(cached, 12)


def test_twin_blocks_computed_side_by_side_do_not_corrupt_the_cache() -> None:
    manager = BlockManager(8, BS)
    tokens = [*range(8), 0]
    one, two = make_seq("one", tokens), make_seq("two", tokens)
    for seq in (one, two):  # both admitted before either block is published
        manager.allocate(seq, [], seq.num_tokens)
    for seq in (one, two):
        seq.num_computed_tokens = seq.num_tokens
        manager.cache_full_blocks(seq)
    assert one.block_hashes == two.block_hashes
    assert manager.match_prefix(make_seq("three", tokens)) == one.block_table[:2]
    manager.free(one)
    manager.free(two)
    assert manager.num_free_blocks == 8
    assert manager.num_cached_free_blocks == 2


def test_prefix_caching_off_never_hits_or_keeps_blocks() -> None:
    manager = BlockManager(4, BS, enable_prefix_caching=False)
    tokens = [*range(8), 0]
    admit(manager, make_seq("a", tokens))
    repeat = make_seq("b", tokens)
    assert manager.match_prefix(repeat) == []
    assert manager.num_cached_free_blocks == 0
    assert manager.prefix_cache_queries == 0


def test_allocate_refuses_a_sequence_that_already_holds_blocks() -> None:
    manager = BlockManager(4, BS)
    seq = make_seq("a", [1, 2])
    manager.allocate(seq, [], 2)
    with pytest.raises(RuntimeError, match="already holds"):
        manager.allocate(seq, [], 2)
