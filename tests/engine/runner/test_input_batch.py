"""The persistent batch builds, step after step, exactly the inputs a from-scratch build of
each step's lists gives, through joins, chunked prefill, decode, finishes, aborts and
preemption, with block tables only as wide as the step's longest request needs."""

from __future__ import annotations

import random

from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.scheduler_output import SchedulerOutput
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.runner.input_batch import InputBatch
from sluicegate.engine.sample.params import SamplingParams

BLOCK = 4


def from_scratch(output: SchedulerOutput) -> dict[str, list[int] | list[list[int]]]:
    """Each step's inputs built from the sequences alone, the obvious way."""
    ids, positions, slots, seq_lens, cu, sample_rows, tables = [], [], [], [], [0], [], []
    for item in output.scheduled:
        seq, start, end = item.seq, item.start, item.start + item.num_new_tokens
        ids += seq.token_ids[start:end]
        positions += list(range(start, end))
        slots += [seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
        seq_lens.append(end)
        cu.append(cu[-1] + item.num_new_tokens)
        if item.samples:
            sample_rows.append(cu[-1] - 1)
        tables.append(seq.block_table[: blocks_for(end, BLOCK)])
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": seq_lens,
        "cu_seqlens_q": cu,
        "sample_rows": sample_rows,
        "tables": tables,
    }


def test_persistent_batch_matches_a_fresh_build_every_step() -> None:
    rng = random.Random(3)
    config = SchedulerConfig(
        num_kv_blocks=40,
        max_model_len=128,
        block_size=BLOCK,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    scheduler = Scheduler(config)
    batch = InputBatch(6, 128, BLOCK, 24)
    shared = [rng.randrange(100) for _ in range(9)]
    pending = [
        Sequence(
            f"r{i}",
            (shared if i % 2 else []) + [rng.randrange(100) for _ in range(rng.randint(1, 30))],
            SamplingParams(max_tokens=rng.randint(1, 25), ignore_eos=True),
        )
        for i in range(14)
    ]
    steps = preempted = 0
    while pending or scheduler.has_unfinished():
        if pending and rng.random() < 0.5:
            scheduler.add(pending.pop(0))
        output = scheduler.schedule()
        if output.is_empty:
            continue
        steps += 1
        preempted += len(output.preempted)
        got = batch.prepare(output)
        want = from_scratch(output)
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "cu_seqlens_q"):
            assert getattr(got, name).tolist() == want[name], (steps, name)
        assert got.sample_rows.tolist() == want["sample_rows"]
        width = max(len(t) for t in want["tables"])
        assert got.block_tables.shape == (len(output.scheduled), width)
        for row, table in zip(got.block_tables.tolist(), want["tables"], strict=True):
            assert row[: len(table)] == table
        sampled = [rng.randrange(100) for item in output.scheduled if item.samples]
        batch.mark_pending(got)
        batch.record_sampled(got, sampled)
        tokens = iter(sampled)
        scheduler.postprocess(
            output, [next(tokens) if item.samples else None for item in output.scheduled]
        )
        if steps % 7 == 0 and scheduler.running:
            scheduler.abort(scheduler.running[0].request_id)
    assert preempted > 0, "the workload should have preempted someone"
