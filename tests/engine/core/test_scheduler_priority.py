"""Priority classes (vLLM's ``priority``: lower runs first): the waiting queue orders by it,
first come first served within one value; a more urgent request without a batch row or KV
blocks preempts the least urgent running ones at once; the engine's greedy tokens do not
depend on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.core.waiting_queue import WaitingQueue
from sluicegate.engine.protocol import BATCH_PRIORITY
from sluicegate.engine.serving.request_options import RequestOptions


@dataclass
class Params:
    max_tokens: int = 6
    ignore_eos: bool = True
    stop_token_ids: list[int] | None = None


def seq(name: str, priority: int, length: int = 6) -> Sequence:
    """A sequence whose prompt shares no block with another's (no prefix-cache hits)."""
    start = 100 * (sum(map(ord, name)) % 50)
    return Sequence(name, list(range(start, start + length)), Params(), priority=priority)


def names(sequences: object) -> list[str]:
    return [s.request_id for s in sequences]  # type: ignore[attr-defined]


def test_the_queue_orders_by_priority_then_arrival() -> None:
    queue = WaitingQueue(block_size=4)
    for name, priority in [("b1", 9), ("i1", 0), ("b2", 9), ("i2", 0), ("m", 5)]:
        queue.append(seq(name, priority))
    assert names(queue) == ["i1", "i2", "m", "b1", "b2"]
    # A preempted sequence goes back in front of its own class, behind more urgent ones.
    queue.appendleft(seq("b0", 9))
    queue.appendleft(seq("i0", 0))
    assert names(queue) == ["i0", "i1", "i2", "m", "b0", "b1", "b2"]
    assert queue.num_tokens == 7 * 6
    while queue:
        queue.popleft()
    assert (queue.num_tokens, queue.num_blocks) == (0, 0)


def run_step(scheduler: Scheduler) -> list[str]:
    output = scheduler.schedule()
    scheduler.postprocess(output, [9 if item.samples else None for item in output.scheduled])
    return names(item.seq for item in output.scheduled)


def test_an_urgent_request_takes_the_row_of_the_youngest_batch_request() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_kv_blocks=64, max_model_len=128, block_size=4, max_num_seqs=2)
    )
    old, young = seq("batch-old", BATCH_PRIORITY), seq("batch-young", BATCH_PRIORITY)
    scheduler.add(old)
    scheduler.add(young)
    run_step(scheduler)
    urgent = seq("interactive", 0)
    scheduler.add(urgent)
    output = scheduler.schedule()
    assert names(output.preempted) == ["batch-young"]
    assert "interactive" in names(item.seq for item in output.scheduled)
    assert names(scheduler.running) == ["interactive", "batch-old"]
    assert names(scheduler.waiting) == ["batch-young"]


def test_an_urgent_request_takes_the_kv_blocks_of_batch_requests() -> None:
    # 6 blocks of 4 tokens: two 10-token batch requests hold 3 each; the interactive one
    # needs 3 of its own.
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=6, max_model_len=24, block_size=4))
    for name in ("b1", "b2"):
        scheduler.add(seq(name, BATCH_PRIORITY, length=10))
    run_step(scheduler)
    scheduler.add(seq("interactive", 0, length=10))
    output = scheduler.schedule()
    assert names(output.preempted) == ["b2"]
    assert names(scheduler.running) == ["interactive", "b1"]


def test_equal_priorities_never_preempt_to_admit() -> None:
    scheduler = Scheduler(
        SchedulerConfig(num_kv_blocks=64, max_model_len=128, block_size=4, max_num_seqs=1)
    )
    scheduler.add(seq("first", 0))
    run_step(scheduler)
    scheduler.add(seq("second", 0))
    output = scheduler.schedule()
    assert output.preempted == [] and names(scheduler.running) == ["first"]


def test_greedy_tokens_do_not_depend_on_priority_or_yielding(llama_dir: Path) -> None:
    """Two batch requests hold both rows when an interactive one arrives; every output is
    what it is alone, and the interactive one is admitted at once."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [list(range(5, 30)), list(range(40, 52)), list(range(60, 71))]
    plain = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, max_num_seqs=2)
    engine = llm.engine
    batch = RequestOptions(priority=BATCH_PRIORITY)
    for index in (0, 1):
        engine.add_request(f"b{index}", prompt_token_ids=prompts[index], params=params,
                           options=batch)  # fmt: skip
    finished: list[str] = []
    tokens: dict[str, list[int]] = {"b0": [], "b1": [], "i": []}
    first = engine.step()
    engine.add_request("i", prompt_token_ids=prompts[2], params=params, options=RequestOptions())
    while engine.has_unfinished() or first:
        for delta in first or engine.step():
            tokens[delta.request_id].extend(delta.token_ids)
            if delta.finish_reason:
                finished.append(delta.request_id)
        first = []
    assert [tokens["b0"], tokens["b1"], tokens["i"]] == want
    # The interactive request took the younger batch request's row and finished before it.
    assert finished.index("i") < finished.index("b1")
    assert engine.stats()["num_preemptions"] >= 1
