"""The offline ``LLM`` API contract: prompts as text or ids, chat, outputs, stats, rejection,
and the on-demand block invariant checked at every step of a real run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.core.scheduler import RequestRejected
from sluicegate.engine.core.scheduler_output import SchedulerOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=128, max_num_seqs=8)


def test_text_and_token_id_prompts_in_order(llm: LLM) -> None:
    ids = [5, 6, 7, 8, 9]
    outputs = llm.generate(["The quick brown fox", ids, "café"], GREEDY)
    assert [o.prompt for o in outputs] == ["The quick brown fox", None, "café"]
    assert outputs[0].prompt_token_ids == llm.tokenizer.encode("The quick brown fox")
    assert outputs[1].prompt_token_ids == ids
    for output in outputs:
        assert len(output.token_ids) == 12
        assert output.finish_reason == "length"
        assert llm.tokenizer.decode(output.token_ids).startswith(output.text)
    # A lone prompt (text or ids) is one request, not a batch of characters or tokens.
    assert len(llm.generate("The quick brown fox", GREEDY)) == 1
    (alone,) = llm.generate(ids, GREEDY)
    assert alone.token_ids == outputs[1].token_ids


def test_per_prompt_params_and_stop_token_ids(llm: LLM) -> None:
    prompt = [10, 11, 12, 13]
    (full,) = llm.generate(prompt, GREEDY)
    stop_token = full.token_ids[4]
    first = full.token_ids.index(stop_token)
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]
    )
    short, stopped = llm.generate(
        [prompt, prompt], [SamplingParams(max_tokens=3, temperature=0), params]
    )
    assert short.token_ids == full.token_ids[:3] and short.finish_reason == "length"
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"


def test_chat_applies_the_template(llm: LLM) -> None:
    (output,) = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    expected = llm.tokenizer.hf.encode(
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    assert output.prompt_token_ids == expected
    batch = llm.chat(
        [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"}]], GREEDY
    )
    assert batch[0].token_ids == output.token_ids
    assert len(batch) == 2


def test_logprobs_follow_the_tokens(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    (output,) = llm.generate([20, 21, 22], params)
    assert output.logprobs is not None and len(output.logprobs) == 6
    for token, entry in zip(output.token_ids, output.logprobs, strict=True):
        assert entry.token_id == token
        assert entry.top[0] == (token, pytest.approx(entry.logprob))
        assert len(entry.top) == 3


def test_too_long_request_is_rejected_and_the_engine_stays_clean(llm: LLM) -> None:
    with pytest.raises(RequestRejected, match="exceeds"):
        llm.generate([list(range(3, 200)), [5] * 1000], SamplingParams(max_tokens=100))
    stats = llm.stats()
    assert stats["num_running"] == stats["num_waiting"] == stats["kv_blocks_used"] == 0
    assert len(llm.generate([5, 6], GREEDY)[0].token_ids) == 12


def test_stats_keys(llm: LLM) -> None:
    stats = llm.stats()
    for key in (
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_tokens_stored",
        "peak_kv_utilization",
        "num_running",
        "num_waiting",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
    ):
        assert key in stats
    assert stats["kv_blocks_total"] == 128


def test_blocks_are_allocated_on_demand_at_every_step(llama_dir: Path) -> None:
    """Acceptance 5: at every step the blocks in use equal the blocks the live requests'
    tokens need (shared prefix blocks once), so the only waste is each request's partly
    filled last block. Run with shared prefixes, chunked prefill and preemptions."""
    llm = LLM(
        str(llama_dir), num_kv_blocks=40, max_num_batched_tokens=64, enable_prefix_caching=True
    )
    scheduler = llm.engine.scheduler
    block_size = scheduler.config.block_size
    schedule = scheduler.schedule
    checked = 0

    def checked_schedule(drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        nonlocal checked
        output = schedule(drafts)
        new_tokens = {item.seq.request_id: item.num_new_tokens for item in output.scheduled}
        in_use: set[int] = set()
        for seq in scheduler.running:
            held = seq.num_computed_tokens + new_tokens.get(seq.request_id, 0)
            assert len(seq.block_table) == blocks_for(held, block_size), seq
            in_use.update(seq.block_table)
        for seq in scheduler.waiting:
            assert not seq.block_table
        assert scheduler.block_manager.num_used_blocks == len(in_use)
        checked += 1
        return output

    scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    shared = list(range(3, 83))
    prompts = [shared + [100 + i] * (1 + 7 * i) for i in range(8)] + [[7] * 5, [9] * 50]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == 30 for o in outputs)
    stats = llm.stats()
    assert checked > 30
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0
