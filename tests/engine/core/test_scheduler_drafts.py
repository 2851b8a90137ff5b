"""The scheduler's side of speculative decoding: draft tokens scheduled with a decode,
giving way to the budget and to free blocks, and rolled back to the accepted ones."""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.engine.core.block_manager import blocks_for, compute_block_hashes
from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.sequence import Sequence


@dataclass
class Params:
    max_tokens: int = 6
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None


def decoding(scheduler: Scheduler, request_id: str, prompt: list[int]) -> Sequence:
    """A sequence past its prompt, one sampled token appended (the next to feed)."""
    seq = Sequence(request_id, prompt, Params())
    scheduler.add(seq)
    output = scheduler.schedule()
    scheduler.postprocess(output, [9 if item.samples else None for item in output.scheduled])
    assert seq.num_tokens - seq.num_computed_tokens == 1
    return seq


def cached_hashes(scheduler: Scheduler) -> set[int]:
    manager = scheduler.block_manager
    return {h for h in (b.block_hash for b in manager.blocks) if h is not None}


def test_drafts_are_computed_with_the_decode_and_rejected_ones_roll_back() -> None:
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=8, max_model_len=128, block_size=4))
    seq = decoding(scheduler, "a", [1, 2, 3, 4, 5, 6])  # 7 tokens, 6 computed, 2 blocks
    free_before = scheduler.block_manager.num_free_blocks
    output = scheduler.schedule({"a": [11, 12, 13, 14]})
    (item,) = output.scheduled
    assert (item.num_new_tokens, item.num_drafts, item.start, item.samples) == (5, 4, 6, True)
    assert seq.token_ids[-5:] == [9, 11, 12, 13, 14]
    assert len(seq.block_table) == blocks_for(11, 4) == 3
    assert output.arrays is not None and output.arrays.num_tokens.tolist() == [11]

    scheduler.accept_drafts(item, 1)  # 11 accepted, 12 rejected: the step's token follows 11
    assert seq.token_ids[-2:] == [9, 11] and item.num_new_tokens == 2
    assert len(seq.block_table) == 2, "the block that held only rejected drafts is freed"
    assert scheduler.block_manager.num_free_blocks == free_before
    finished = scheduler.advance(output)
    scheduler.record(output, [20])
    assert not finished and seq.num_computed_tokens == 8 and seq.token_ids[-3:] == [9, 11, 20]
    # Only full blocks of accepted tokens reach the prefix cache.
    assert cached_hashes(scheduler) == set(compute_block_hashes(seq.token_ids[:8], 4))


def test_drafts_give_way_to_the_budget_and_to_free_blocks() -> None:
    config = SchedulerConfig(
        num_kv_blocks=3, max_model_len=128, block_size=4, max_num_batched_tokens=4
    )
    scheduler = Scheduler(config)
    seq = decoding(scheduler, "a", [1, 2, 3])
    output = scheduler.schedule({"a": [5, 6, 7, 8]})  # 5 tokens > budget 4
    assert [(i.num_new_tokens, i.num_drafts) for i in output.scheduled] == [(1, 0)]
    assert seq.num_tokens == 4

    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=2, max_model_len=128, block_size=4))
    decoding(scheduler, "a", [1, 2])  # decodes once more as b joins: 4 tokens, 3 computed
    other = decoding(scheduler, "b", [1, 2, 3])
    assert scheduler.block_manager.num_free_blocks == 0
    output = scheduler.schedule({"a": [5, 6], "b": [1]})  # each would need a second block
    assert [(i.num_new_tokens, i.num_drafts) for i in output.scheduled] == [(1, 0), (1, 0)]
    assert output.preempted == [] and other.num_tokens == 4


def test_a_prefill_chunk_never_takes_drafts() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_kv_blocks=8, max_model_len=128, block_size=4, max_num_batched_tokens=4)
    )
    seq = Sequence("a", list(range(1, 11)), Params())
    scheduler.add(seq)
    scheduler.postprocess(scheduler.schedule(), [None])
    output = scheduler.schedule({"a": [1, 2]})
    assert [(i.num_new_tokens, i.num_drafts) for i in output.scheduled] == [(4, 0)]
    assert seq.num_tokens == 10
