"""Scheduler: continuous batching, chunked prefill, preemption, rejection, abort, invariants.

The "model" here is a deterministic sampler: the token at position p of request r is a hash
of (r, p). A request's outputs are then fixed in advance whatever else is in the batch, so
preemption and recomputation must reproduce them exactly.
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from dataclasses import dataclass, field

import pytest

from sluicegate.engine.core.block_manager import compute_block_hashes
from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import RequestRejected, Scheduler
from sluicegate.engine.core.scheduler_output import SchedulerOutput
from sluicegate.engine.core.sequence import Sequence, SequenceStatus

VOCAB = 50
EOS = 0


@dataclass
class Params:
    max_tokens: int = 8
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = field(default=None)


def token_at(request_id: str, position: int) -> int:
    return zlib.crc32(f"{request_id}:{position}".encode()) % VOCAB


def expected_outputs(seq: Sequence) -> tuple[list[int], str]:
    """What the request must produce, computed without any scheduler."""
    tokens = list(seq.prompt_token_ids)
    params = seq.params
    stops = set(params.stop_token_ids or ())
    while True:
        token = token_at(seq.request_id, len(tokens))
        tokens.append(token)
        if token in stops or (token in seq.eos_token_ids and not params.ignore_eos):
            return tokens[seq.num_prompt_tokens :], "stop"
        if len(tokens) - seq.num_prompt_tokens >= params.max_tokens:
            return tokens[seq.num_prompt_tokens :], "length"


def make_seq(
    request_id: str, prompt: list[int], max_tokens: int = 8, ignore_eos: bool = True, **kw: object
) -> Sequence:
    params = Params(max_tokens=max_tokens, ignore_eos=ignore_eos, **kw)  # type: ignore[arg-type]
    return Sequence(request_id, prompt, params, eos_token_ids={EOS})


def make_scheduler(**overrides: object) -> Scheduler:
    settings: dict[str, object] = {
        "num_kv_blocks": 64,
        "block_size": 4,
        "max_model_len": 256,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
    }
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings))  # type: ignore[arg-type]


def sample(output: SchedulerOutput) -> list[int | None]:
    return [
        token_at(item.seq.request_id, item.seq.num_tokens) if item.samples else None
        for item in output.scheduled
    ]


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    output = scheduler.schedule()
    check_invariants(scheduler, output)
    finished = scheduler.postprocess(output, sample(output))
    check_invariants(scheduler)
    return output, finished


def run_to_completion(scheduler: Scheduler, max_steps: int = 10_000) -> list[Sequence]:
    finished: list[Sequence] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished
        finished += step(scheduler)[1]
    raise AssertionError("scheduler made no progress")


def check_invariants(scheduler: Scheduler, in_flight: SchedulerOutput | None = None) -> None:
    """Everything that must hold between any two scheduler calls."""
    manager = scheduler.block_manager
    size = scheduler.config.block_size
    new_tokens = {
        item.seq.request_id: item.num_new_tokens
        for item in (in_flight.scheduled if in_flight else [])
    }
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    # The queue's running sums are what a pass over it would find.
    assert scheduler.waiting.num_tokens == sum(seq.num_tokens for seq in scheduler.waiting)
    assert scheduler.waiting.num_blocks == sum(-(-s.num_tokens // size) for s in scheduler.waiting)
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    # Each running sequence holds its own batch row; nobody else holds one.
    rows = [seq.batch_row for seq in scheduler.running]
    assert len(set(rows)) == len(rows)
    assert all(0 <= row < scheduler.config.max_num_seqs for row in rows)
    assert all(seq.batch_row == -1 for seq in scheduler.waiting)
    # No block leaked: each block's refcount is the number of live tables holding it.
    references = Counter(block for seq in scheduler.running for block in seq.block_table)
    for block in manager.blocks:
        assert block.ref_count == references.get(block.block_id, 0), block.block_id
    assert manager.num_used_blocks == len(references)
    free_ids = list(manager._free) + list(manager._cached)
    assert len(free_ids) == len(set(free_ids)) == manager.num_free_blocks
    assert set(free_ids) == {b.block_id for b in manager.blocks if b.ref_count == 0}
    assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
    assert all(manager.blocks[b].block_hash is None for b in manager._free)
    for block_hash, block_id in manager._hash_to_block.items():
        assert manager.blocks[block_id].block_hash == block_hash
    assert sum(b.block_hash is not None for b in manager.blocks) == len(manager._hash_to_block)
    assert manager.num_shared_refs == sum(max(0, count - 1) for count in references.values())

    # Only the youngest running sequence may be mid-prefill (see Scheduler.schedule).
    if in_flight is None:
        for seq in scheduler.running[:-1]:
            assert seq.num_tokens - seq.num_computed_tokens == 1
    held_total = 0
    for seq in scheduler.running:
        assert seq.status is SequenceStatus.RUNNING
        held = seq.num_computed_tokens + new_tokens.get(seq.request_id, 0)
        assert held <= seq.num_tokens
        # On demand: a table holds exactly the blocks its computed (and in-flight) tokens need.
        assert len(seq.block_table) == -(-held // size)
        held_total += len(seq.block_table)
        # Prefix-cache bookkeeping matches the tokens, and only covers computed blocks.
        assert len(seq.block_hashes) <= seq.num_computed_tokens // size
        assert seq.block_hashes == compute_block_hashes(
            seq.token_ids[: len(seq.block_hashes) * size], size
        )
    # Shared prefix blocks counted once: the only waste is each table's partial last block.
    assert manager.num_used_blocks == held_total - manager.num_shared_refs
    for block_id, count in references.items():
        if count > 1:
            for seq in scheduler.running:
                if block_id in seq.block_table:
                    index = seq.block_table.index(block_id)
                    assert (index + 1) * size <= seq.num_computed_tokens
    if in_flight is not None:
        assert in_flight.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        for item in in_flight.scheduled:
            assert item.num_new_tokens >= 1  # a cache hit never covers the last token
            # Running, or aborted while the step is in flight; never preempted yet scheduled.
            assert item.seq.status is not SequenceStatus.WAITING
        assert len({item.seq.request_id for item in in_flight.scheduled}) == len(
            in_flight.scheduled
        )
        assert not {s.request_id for s in in_flight.preempted} & {
            i.seq.request_id for i in in_flight.scheduled
        }
    else:
        stored = sum(seq.num_computed_tokens for seq in scheduler.running)
        stored -= size * manager.num_shared_refs
        assert scheduler.kv_tokens_stored == stored


# -- rejection --------------------------------------------------------------------------------


def test_rejects_prompt_plus_max_tokens_over_max_model_len() -> None:
    scheduler = make_scheduler(max_model_len=20)
    with pytest.raises(RequestRejected, match=r"15 tokens\) \+ max_tokens \(6\) = 21 exceeds"):
        scheduler.add(make_seq("a", [1] * 15, max_tokens=6))
    scheduler.add(make_seq("b", [1] * 15, max_tokens=5))
    assert scheduler.num_waiting == 1


def test_rejects_a_request_that_could_never_fit_in_the_cache() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4)
    # 12 prompt + 6 outputs: the last output is never fed back, so 17 tokens = 5 blocks.
    with pytest.raises(RequestRejected, match=r"needs 5 KV blocks .* whole cache has 4"):
        scheduler.add(make_seq("a", [1] * 12, max_tokens=6))
    assert not scheduler.has_unfinished()


def test_a_request_needing_the_whole_cache_runs_alone_to_completion() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_num_batched_tokens=3)
    big = make_seq("big", [3] * 12, max_tokens=5)  # 16 tokens held at most: all 4 blocks
    scheduler.add(big)
    scheduler.add(make_seq("small", [4] * 5, max_tokens=3))
    finished = run_to_completion(scheduler)
    assert {seq.request_id for seq in finished} == {"big", "small"}
    assert big.output_token_ids == expected_outputs(big)[0]


def test_rejects_zero_max_tokens_duplicate_ids_and_full_queue() -> None:
    scheduler = make_scheduler(max_waiting=1)
    with pytest.raises(RequestRejected, match="max_tokens must be at least 1"):
        scheduler.add(make_seq("z", [1], max_tokens=0))
    scheduler.add(make_seq("a", [1]))
    assert not scheduler.can_accept()
    with pytest.raises(RequestRejected, match="already in flight"):
        scheduler.add(make_seq("a", [2]))
    with pytest.raises(RequestRejected, match="waiting queue is full"):
        scheduler.add(make_seq("b", [2]))
    step(scheduler)
    assert scheduler.can_accept()
    assert issubclass(RequestRejected, ValueError)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        make_seq("a", [])


# -- batching ---------------------------------------------------------------------------------


def test_prefill_then_decode_one_token_per_step() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", [5, 6, 7, 8, 9], max_tokens=3)
    scheduler.add(seq)
    output, _ = step(scheduler)
    assert [(i.seq, i.start, i.num_new_tokens, i.samples) for i in output.scheduled] == [
        (seq, 0, 5, True)
    ]
    output, _ = step(scheduler)
    assert [(i.start, i.num_new_tokens, i.samples) for i in output.scheduled] == [(5, 1, True)]
    _, finished = step(scheduler)
    assert finished == [seq]
    assert seq.finish_reason == "length"
    assert seq.output_token_ids == expected_outputs(seq)[0]
    assert scheduler.block_manager.num_used_blocks == 0
    assert not scheduler.has_unfinished()


def test_long_prompt_is_prefilled_in_chunks_alongside_decodes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    short = make_seq("short", [1, 2, 3], max_tokens=10)
    scheduler.add(short)
    step(scheduler)
    long = make_seq("long", list(range(1, 15)), max_tokens=2)
    scheduler.add(long)
    chunks = []
    while long.num_output_tokens == 0:
        output, _ = step(scheduler)
        # The decode always comes first and takes one token of the budget.
        assert output.scheduled[0].seq is short and output.scheduled[0].num_new_tokens == 1
        chunk = output.scheduled[1]
        chunks.append((chunk.start, chunk.num_new_tokens, chunk.samples))
    assert chunks == [(0, 5, False), (5, 5, False), (10, 4, True)]
    run_to_completion(scheduler)
    assert long.output_token_ids == expected_outputs(long)[0]
    assert short.output_token_ids == expected_outputs(short)[0]


def test_a_prompt_still_prefilling_holds_back_admissions_behind_it() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    old = make_seq("old", list(range(1, 20)), max_tokens=2)
    scheduler.add(old)
    step(scheduler)  # old: 4 of 19 prompt tokens
    young = make_seq("young", [7], max_tokens=5)
    scheduler.add(young)
    for _ in range(3):  # old's chunks take the whole budget; young waits its turn
        output, _ = step(scheduler)
        assert [i.seq.request_id for i in output.scheduled] == ["old"]
        assert young.status is SequenceStatus.WAITING
    output, _ = step(scheduler)  # old's last 3 prompt tokens, then young with the remainder
    assert [(i.seq.request_id, i.num_new_tokens) for i in output.scheduled] == [
        ("old", 3),
        ("young", 1),
    ]


def test_admission_is_fcfs_and_bounded_by_max_num_seqs() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(str(i), [i + 1] * 3, max_tokens=4) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    output, _ = step(scheduler)
    assert [i.seq for i in output.scheduled] == seqs[:2]
    assert list(scheduler.waiting) == seqs[2:]
    finished = run_to_completion(scheduler)
    assert [seq.request_id for seq in finished] == ["0", "1", "2", "3"]


def test_head_of_queue_that_does_not_fit_blocks_later_arrivals() -> None:
    scheduler = make_scheduler(num_kv_blocks=6, block_size=4)
    scheduler.add(make_seq("running", [1] * 12, max_tokens=4))
    step(scheduler)  # holds 3 blocks
    big = make_seq("big", [2] * 16, max_tokens=2)  # needs 4, only 3 free
    small = make_seq("small", [3] * 2, max_tokens=2)
    scheduler.add(big)
    scheduler.add(small)
    output, _ = step(scheduler)
    assert [i.seq.request_id for i in output.scheduled] == ["running"]
    assert list(scheduler.waiting) == [big, small]


# -- stopping ---------------------------------------------------------------------------------


def first_position_of(request_id: str, start: int, token: int) -> int:
    return next(p for p in range(start, start + 10_000) if token_at(request_id, p) == token)


def test_eos_stops_unless_ignored_and_stop_token_ids_always_stop() -> None:
    prompt = [9, 9]
    request_id = next(r for r in map(str, range(1000)) if token_at(r, 2) == EOS)
    scheduler = make_scheduler()
    stopped = make_seq(request_id, prompt, max_tokens=5, ignore_eos=False)
    scheduler.add(stopped)
    run_to_completion(scheduler)
    assert stopped.finish_reason == "stop" and stopped.output_token_ids == [EOS]

    scheduler = make_scheduler()
    ignored = make_seq(request_id, prompt, max_tokens=5, ignore_eos=True)
    scheduler.add(ignored)
    run_to_completion(scheduler)
    assert ignored.finish_reason == "length" and ignored.num_output_tokens == 5

    stop_token = token_at(request_id, 4)
    scheduler = make_scheduler()
    custom = make_seq(request_id, prompt, max_tokens=5, stop_token_ids=[stop_token])
    scheduler.add(custom)
    run_to_completion(scheduler)
    assert custom.finish_reason == "stop"
    assert custom.num_output_tokens == first_position_of(request_id, 2, stop_token) - 1


def test_finish_ends_a_sequence_and_frees_its_blocks() -> None:
    scheduler = make_scheduler()
    seq = make_seq("a", [1, 2, 3], max_tokens=8)
    scheduler.add(seq)
    step(scheduler)
    scheduler.finish(seq, "stop")
    assert seq.finish_reason == "stop" and seq.is_finished
    assert scheduler.block_manager.num_used_blocks == 0 and scheduler.num_running == 0
    scheduler.finish(seq, "length")  # idempotent
    assert seq.finish_reason == "stop"
    check_invariants(scheduler)


# -- abort ------------------------------------------------------------------------------------


def test_abort_frees_blocks_immediately_for_running_and_waiting() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_seq("run", [1] * 9), make_seq("wait", [2] * 3)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    assert scheduler.block_manager.num_used_blocks == 3
    assert scheduler.abort("run") is running
    assert running.finish_reason == "abort"
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.abort("wait") is waiting and scheduler.num_waiting == 0
    assert scheduler.abort("missing") is None
    assert not scheduler.has_unfinished()
    check_invariants(scheduler)


def test_abort_while_a_step_is_in_flight_is_skipped_by_postprocess() -> None:
    scheduler = make_scheduler()
    doomed, survivor = make_seq("doomed", [1] * 6), make_seq("survivor", [2] * 6)
    scheduler.add(doomed)
    scheduler.add(survivor)
    output = scheduler.schedule()
    scheduler.abort("doomed")
    finished = scheduler.postprocess(output, sample(output))
    assert finished == []
    assert doomed.block_table == [] and doomed.num_output_tokens == 0
    assert survivor.num_output_tokens == 1
    check_invariants(scheduler)


def test_postprocess_checks_its_samples() -> None:
    scheduler = make_scheduler()
    scheduler.add(make_seq("a", [1, 2]))
    output = scheduler.schedule()
    with pytest.raises(ValueError, match="0 samples for 1"):
        scheduler.postprocess(output, [])
    with pytest.raises(ValueError, match="got no sample"):
        scheduler.postprocess(output, [None])


# -- preemption -------------------------------------------------------------------------------


def test_the_most_recently_admitted_is_preempted_and_recomputed_identically() -> None:
    scheduler = make_scheduler(num_kv_blocks=6, block_size=4, max_num_batched_tokens=64)
    old, young = make_seq("old", [1] * 7, max_tokens=9), make_seq("young", [2] * 7, max_tokens=9)
    scheduler.add(old)
    scheduler.add(young)
    preemptions: list[Sequence] = []
    finished: list[Sequence] = []
    while scheduler.has_unfinished():
        output, done = step(scheduler)
        preemptions += output.preempted
        finished += done
        if output.preempted:
            assert scheduler.waiting[0] is young  # back to the front, outputs kept
            assert young.num_output_tokens > 0 and young.num_computed_tokens == 0
    assert preemptions and all(seq is young for seq in preemptions)
    assert scheduler.num_preemptions == len(preemptions)
    assert finished[0] is old
    for seq in (old, young):
        assert (seq.output_token_ids, seq.finish_reason) == expected_outputs(seq)


def test_a_decode_that_needs_a_block_preempts_the_youngest_not_yet_scheduled() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4, max_num_batched_tokens=4)
    old = make_seq("old", [1] * 8, max_tokens=6)
    scheduler.add(old)
    step(scheduler)
    step(scheduler)  # old prefilled: 8 tokens, 2 blocks, one sampled
    young = make_seq("young", [2] * 3, max_tokens=8)
    scheduler.add(young)
    step(scheduler)  # old decodes, young admitted: 4 blocks in use
    assert young.status is SequenceStatus.RUNNING
    for _ in range(20):
        output, _ = step(scheduler)
        if output.preempted:
            break
    assert output.preempted == [young]
    assert [item.seq for item in output.scheduled] == [old]
    run_to_completion(scheduler)
    for seq in (old, young):
        assert (seq.output_token_ids, seq.finish_reason) == expected_outputs(seq)


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_kv_blocks=4, block_size=4)
    scheduler.add(make_seq("a", [1] * 7, max_tokens=9))
    scheduler.add(make_seq("b", [2] * 7, max_tokens=9))
    for _ in range(30):
        if not scheduler.has_unfinished():
            break
        output = scheduler.schedule()
        if output.preempted:
            admitted = [i.seq for i in output.scheduled if i.start == 0]
            assert not admitted
        scheduler.postprocess(output, sample(output))
        check_invariants(scheduler)
    assert scheduler.num_preemptions > 0


# -- prefix caching through the scheduler -----------------------------------------------------


def test_shared_prefix_is_reused_and_counted_in_tokens() -> None:
    scheduler = make_scheduler(block_size=4)
    system = list(range(1, 13))  # three full blocks
    first = make_seq("first", [*system, 20, 21], max_tokens=4)
    scheduler.add(first)
    step(scheduler)
    second = make_seq("second", [*system, 30], max_tokens=2)
    scheduler.add(second)
    output, _ = step(scheduler)
    item = next(i for i in output.scheduled if i.seq is second)
    assert second.num_cached_tokens == 12 and (item.start, item.num_new_tokens) == (12, 1)
    assert second.block_table[:3] == first.block_table[:3]
    stats = scheduler.stats()
    assert stats["prefix_cache_queries"] == 14 + 13 and stats["prefix_cache_hits"] == 12
    run_to_completion(scheduler)
    assert second.output_token_ids == expected_outputs(second)[0]


def test_identical_prompt_recomputes_its_last_block() -> None:
    scheduler = make_scheduler(block_size=4)
    prompt = list(range(1, 9))
    scheduler.add(make_seq("a", prompt, max_tokens=1))
    run_to_completion(scheduler)
    again = make_seq("b", prompt, max_tokens=1)
    scheduler.add(again)
    output, _ = step(scheduler)
    assert again.num_cached_tokens == 4
    assert (output.scheduled[0].start, output.scheduled[0].num_new_tokens) == (4, 4)


# -- stats ------------------------------------------------------------------------------------


def test_stats_report_usage_and_peak_utilization() -> None:
    scheduler = make_scheduler(block_size=4)
    scheduler.add(make_seq("a", [1] * 6, max_tokens=3))
    step(scheduler)
    stats = scheduler.stats()
    assert stats == {
        "kv_blocks_total": 64,
        "kv_blocks_used": 2,
        "kv_tokens_stored": 6,
        "peak_kv_utilization": 6 / 8,
        "num_running": 1,
        "num_waiting": 0,
        "num_preemptions": 0,
        "prefix_cache_queries": 6,
        "prefix_cache_hits": 0,
        "oldest_waiting_arrival": None,
        "waiting_tokens": 0,
        "waiting_blocks": 0,
        "prefill_tokens_running": 0,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "max_model_len": 256,
    }
    step(scheduler)
    step(scheduler)
    assert scheduler.stats()["peak_kv_utilization"] == 7 / 8
    assert scheduler.stats()["kv_blocks_used"] == 0


def test_stats_report_the_work_ahead_of_a_new_request() -> None:
    scheduler = make_scheduler(block_size=4, max_num_seqs=1, max_num_batched_tokens=8)
    long, a, b = make_seq("long", [1] * 20), make_seq("a", [2] * 6), make_seq("b", [3] * 9)
    for seq in (long, a, b):
        scheduler.add(seq)
    stats = scheduler.stats()
    assert stats["waiting_tokens"] == 35 and stats["waiting_blocks"] == 5 + 2 + 3
    assert stats["oldest_waiting_arrival"] == long.arrival_time
    assert stats["prefill_tokens_running"] == 0
    step(scheduler)  # "long" admitted, 8 of its 20 prompt tokens computed
    stats = scheduler.stats()
    assert (stats["waiting_tokens"], stats["waiting_blocks"]) == (15, 5)
    assert stats["prefill_tokens_running"] == 12
    assert stats["oldest_waiting_arrival"] == a.arrival_time
    step(scheduler)
    step(scheduler)  # the prompt is in: decoding leaves nothing to prefill
    assert scheduler.stats()["prefill_tokens_running"] == 0
    scheduler.abort("b")
    assert (scheduler.stats()["waiting_tokens"], scheduler.stats()["waiting_blocks"]) == (6, 2)
    assert scheduler.stats()["max_num_seqs"] == 1
    assert scheduler.stats()["max_num_batched_tokens"] == 8


# -- randomised -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seed", "prefix_caching", "blocks", "budget"),
    [(0, True, 24, 16), (1, False, 24, 16), (2, True, 16, 7), (3, True, 12, 64)],
)
def test_random_operations_keep_every_invariant(
    seed: int, prefix_caching: bool, blocks: int, budget: int
) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_kv_blocks=blocks,
        block_size=4,
        max_model_len=40,
        max_num_seqs=6,
        max_num_batched_tokens=budget,
        enable_prefix_caching=prefix_caching,
    )
    system_prompts = [
        [rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 14))] for _ in range(3)
    ]
    submitted: dict[str, Sequence] = {}
    aborted: set[str] = set()
    finished: dict[str, Sequence] = {}
    stopped_by_engine: set[str] = set()
    for op_index in range(4000):
        op = rng.random()
        if op < 0.25:
            prefix = rng.choice(system_prompts) if rng.random() < 0.7 else []
            prompt = prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 10))]
            seq = make_seq(
                f"r{op_index}",
                prompt,
                max_tokens=rng.randint(1, 16),
                ignore_eos=rng.random() < 0.5,
                stop_token_ids=[rng.randrange(VOCAB)] if rng.random() < 0.2 else None,
            )
            try:
                scheduler.add(seq)
            except RequestRejected:
                assert seq.num_prompt_tokens + seq.params.max_tokens > 40
                continue
            submitted[seq.request_id] = seq
        elif op < 0.8:
            output, done = step(scheduler)
            for seq in done:
                finished[seq.request_id] = seq
        elif op < 0.87:
            output = scheduler.schedule()
            check_invariants(scheduler, output)
            if output.scheduled:  # abort one of the batch while the "model" runs
                victim = rng.choice(output.scheduled).seq
                assert scheduler.abort(victim.request_id) is victim
                aborted.add(victim.request_id)
                check_invariants(scheduler, output)
            for seq in scheduler.postprocess(output, sample(output)):
                finished[seq.request_id] = seq
            check_invariants(scheduler)
        elif op < 0.94 and submitted:
            request_id = rng.choice(list(submitted))
            seq = scheduler.abort(request_id)
            if seq is not None:
                aborted.add(request_id)
            check_invariants(scheduler)
        elif scheduler.running:
            seq = rng.choice(scheduler.running)
            scheduler.finish(seq, "stop")  # as the engine does on a stop string
            stopped_by_engine.add(seq.request_id)
            check_invariants(scheduler)
    for seq in run_to_completion(scheduler):
        finished[seq.request_id] = seq
    assert scheduler.block_manager.num_used_blocks == 0
    assert scheduler.block_manager.num_free_blocks == blocks
    assert scheduler.num_preemptions > 0
    for request_id, seq in submitted.items():
        assert seq.is_finished
        outputs, reason = expected_outputs(seq)
        if request_id in aborted:
            assert seq.finish_reason == "abort"
        elif request_id in stopped_by_engine:
            assert outputs[: seq.num_output_tokens] == seq.output_token_ids
        else:
            assert finished[request_id] is seq
            assert (seq.output_token_ids, seq.finish_reason) == (outputs, reason)
    if prefix_caching:
        assert scheduler.stats()["prefix_cache_hits"] > 0
