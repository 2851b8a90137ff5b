"""``n`` choices: one prefill shared by every choice (the partly filled last block copied),
independent sampling (seeded: reproducible), interleaved streams, the prompt billed once."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.serving.async_engine import RequestDelta
from sluicegate.engine.serving.request_options import RequestOptions


def prompt(length: int) -> list[int]:
    return [3 + (i * 37) % 250 for i in range(length)]


async def run(engine: AsyncEngine, rid: str, ids: list[int], params: SamplingParams, n: int):
    deltas: list[RequestDelta] = []
    async for delta in engine.add_request(
        rid, prompt_token_ids=ids, params=params, options=RequestOptions(n=n)
    ):
        deltas.append(delta)
    return deltas


def choices(deltas: list[RequestDelta], n: int) -> list[list[int]]:
    return [[t for d in deltas if d.index == i for t in d.token_ids] for i in range(n)]


@pytest.mark.parametrize(
    ("kind", "model_impl"), [("llama", "native"), ("qwen3", "native"), ("llama", "transformers")]
)
@pytest.mark.parametrize("length", [16, 21])
async def test_greedy_choices_equal_single_generation(
    model_dirs: dict[str, Path], kind: str, model_impl: str, length: int
) -> None:
    """Token-exact: a choice forked from the shared prefill (full blocks shared, the partial
    one copied) continues exactly as a request of its own."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=64, model_impl=model_impl)
    (want,) = llm.generate(prompt(length), params)
    async with AsyncEngine(model_dirs[kind], num_kv_blocks=64, model_impl=model_impl) as engine:
        deltas = await run(engine, "g", prompt(length), params, 3)
        stats = engine.core.stats()  # type: ignore[union-attr]
    assert choices(deltas, 3) == [want.token_ids] * 3
    assert stats["prefix_cache_queries"] == length, "the prompt was admitted (computed) once"
    assert stats["kv_blocks_used"] == 0
    finals = [d for d in deltas if d.finish_reason]
    assert sorted(d.index for d in finals) == [0, 1, 2] and deltas[-1].done
    assert sum(d.done for d in deltas) == 1
    usage = deltas[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (length, 60)


async def test_seeded_choices_differ_and_reproduce(model_dirs: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=42, ignore_eos=True)
    async with AsyncEngine(model_dirs["llama"], num_kv_blocks=64) as engine:
        first = choices(await run(engine, "a", prompt(21), params, 3), 3)
        second = choices(await run(engine, "b", prompt(21), params, 3), 3)
    assert first == second
    assert len({tuple(c) for c in first}) == 3
    single = LLM(str(model_dirs["llama"]), num_kv_blocks=64).generate(prompt(21), params)
    assert first[0] == single[0].token_ids, "choice 0 keeps the request's own seed"


async def test_choices_stream_interleaved_and_abort_ends_them_all(
    model_dirs: dict[str, Path],
) -> None:
    params = SamplingParams(max_tokens=200, temperature=1.0, ignore_eos=True)
    async with AsyncEngine(model_dirs["llama"], num_kv_blocks=64) as engine:
        deltas: list[RequestDelta] = []
        options = RequestOptions(n=2)
        async for delta in engine.add_request(
            "x", prompt_token_ids=prompt(21), params=params, options=options
        ):
            deltas.append(delta)
            if len(deltas) == 6:
                engine.abort("x")
        assert engine.stats()["kv_blocks_used"] == 0
    assert {d.index for d in deltas[:6]} == {0, 1}
    finals = [d for d in deltas if d.finish_reason is not None]
    assert sorted((d.index, d.finish_reason) for d in finals) == [(0, "abort"), (1, "abort")]
    assert deltas[-1].done and deltas[-1].usage is not None
    assert deltas[-1].usage.completion_tokens == sum(len(d.token_ids) for d in deltas)


async def test_when_no_block_is_free_the_choices_compute_their_own_prompt(
    model_dirs: dict[str, Path],
) -> None:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    (want,) = LLM(str(model_dirs["llama"]), num_kv_blocks=64).generate(prompt(21), params)
    # 21 + 4 tokens need 2 blocks of 16: the fork finds no free block for a copy.
    async with AsyncEngine(model_dirs["llama"], num_kv_blocks=2) as engine:
        deltas = await run(engine, "tight", prompt(21), params, 2)
    assert choices(deltas, 2) == [want.token_ids] * 2
