"""AsyncEngine: concurrent streams equal offline output, the event loop stays responsive,
abort frees blocks within a step, rejection, load signals and shutdown — each with the engine
core in this process (a thread) and in a process of its own."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.core.scheduler import RequestRejected
from sluicegate.engine.serving.async_engine import EngineStopped, RequestDelta

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + n)) for n in (1, 9, 17, 40, 70, 130)]


@pytest.fixture(params=[False, True], ids=["thread", "process"])
def core_process(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


async def collect(stream) -> list[RequestDelta]:
    return [delta async for delta in stream]


async def test_concurrent_streams_equal_offline_generation(
    llama_dir: Path, core_process: bool
) -> None:
    expected = LLM(str(llama_dir), num_kv_blocks=128).generate(PROMPTS, GREEDY)
    async with AsyncEngine(llama_dir, num_kv_blocks=128, core_process=core_process) as engine:
        results = await asyncio.gather(
            *(
                collect(engine.add_request(f"r{i}", prompt_token_ids=p, params=GREEDY))
                for i, p in enumerate(PROMPTS)
            )
        )
    for deltas, want in zip(results, expected, strict=True):
        assert [t for d in deltas for t in d.token_ids] == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        assert all(d.finish_reason is None and d.usage is None for d in deltas[:-1])
        assert all(d.num_prompt_tokens == len(want.prompt_token_ids) for d in deltas)
        last = deltas[-1]
        assert last.finish_reason == "length"
        assert last.usage is not None
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
        assert last.usage.completion_tokens == 24


async def test_event_loop_stays_responsive(llama_dir: Path, core_process: bool) -> None:
    async with AsyncEngine(llama_dir, num_kv_blocks=128, core_process=core_process) as engine:
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.002)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        started = time.monotonic()
        rounds = 0
        # Rounds of generation until it has run for a while, however fast the engine is.
        while rounds == 0 or time.monotonic() - started < 0.5:
            await asyncio.gather(
                *(collect(engine.add_request(f"t{rounds}-{i}", prompt_token_ids=p, params=params))
                  for i, p in enumerate(PROMPTS))
            )  # fmt: skip
            rounds += 1
        elapsed = time.monotonic() - started
        task.cancel()
    # The loop kept ticking through the whole generation, never blocked for long.
    assert len(gaps) > 20
    assert max(gaps) < max(0.5, elapsed / 4)


async def test_abort_frees_blocks_within_one_step(llama_dir: Path, core_process: bool) -> None:
    async with AsyncEngine(llama_dir, num_kv_blocks=128, core_process=core_process) as engine:
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        deltas = []
        async for delta in engine.add_request(
            "long", prompt_token_ids=list(range(3, 60)), params=params
        ):
            deltas.append(delta)
            if len(deltas) == 3:
                assert engine.stats()["kv_blocks_used"] > 0
                if engine.core is not None:
                    generated_at_abort = engine.core.num_generated_tokens
                engine.abort("long")
        if engine.core is not None:
            # The step thread runs ahead of this consumer (its deltas wait on the event loop),
            # but after abort() at most the one step already running adds a token.
            assert deltas[-1].usage is not None
            assert deltas[-1].usage.completion_tokens <= generated_at_abort + 1
        else:
            # A core process runs ahead of the deltas it sent, by a few steps at most.
            assert len(deltas) <= 40
        assert deltas[-1].finish_reason == "abort"
        assert deltas[-1].usage is not None
        assert deltas[-1].usage.completion_tokens == sum(len(d.token_ids) for d in deltas)
        assert engine.stats()["kv_blocks_used"] == 0

        # Walking away from a stream aborts the request too.
        stream = engine.add_request("left", prompt_token_ids=list(range(3, 60)), params=params)
        async for _ in stream:
            break
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(200):
            if engine.stats()["num_running"] == 0 and engine.stats()["kv_blocks_used"] == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats()["num_running"] == 0
        assert engine.stats()["kv_blocks_used"] == 0


async def test_rejected_request_raises_from_its_stream(llama_dir: Path, core_process: bool) -> None:
    async with AsyncEngine(llama_dir, num_kv_blocks=128, core_process=core_process) as engine:
        with pytest.raises(RequestRejected, match="exceeds"):
            await collect(
                engine.add_request(
                    "big", prompt_token_ids=[5] * 1020, params=SamplingParams(max_tokens=10)
                )
            )
        with pytest.raises(ValueError, match="exactly one"):
            await collect(engine.add_request("none", params=GREEDY))
        # The engine carries on.
        deltas = await collect(engine.add_request("ok", "hello", params=GREEDY))
        assert deltas[-1].finish_reason == "length"


async def test_chat_messages_and_cached_tokens_in_usage(
    llama_dir: Path, core_process: bool
) -> None:
    messages = [{"role": "system", "content": "x" * 40}, {"role": "user", "content": "hello there"}]
    async with AsyncEngine(llama_dir, num_kv_blocks=128, core_process=core_process) as engine:
        first = await collect(engine.add_request("c1", messages=messages, params=GREEDY))
        second = await collect(engine.add_request("c2", messages=messages, params=GREEDY))
    expected_prompt = engine.tokenizer.apply_chat_template(messages)  # type: ignore[union-attr]
    assert first[-1].usage is not None and second[-1].usage is not None
    assert first[-1].usage.prompt_tokens == len(expected_prompt)
    assert first[-1].usage.cached_tokens == 0
    # The second request reuses every full block of the first's prompt.
    assert second[-1].usage.cached_tokens == (len(expected_prompt) - 1) // 16 * 16 > 0
    assert [t for d in first for t in d.token_ids] == [t for d in second for t in d.token_ids]


async def test_can_accept_tracks_the_waiting_queue(llama_dir: Path, core_process: bool) -> None:
    engine = AsyncEngine(
        llama_dir, num_kv_blocks=128, max_num_seqs=1, accept_limit=2, core_process=core_process
    )
    assert not engine.can_accept()  # not started
    await engine.start()
    try:
        assert engine.can_accept()
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        streams = [
            engine.add_request(f"q{i}", prompt_token_ids=[5, 6, 7], params=params) for i in range(4)
        ]
        assert not engine.can_accept()  # four queued, one can run at a time
        await asyncio.gather(*(collect(s) for s in streams))
        assert engine.can_accept()
    finally:
        await engine.shutdown()
    assert not engine.can_accept()


async def test_shutdown_ends_streams_in_flight(llama_dir: Path, core_process: bool) -> None:
    engine = AsyncEngine(llama_dir, num_kv_blocks=128, core_process=core_process)
    await engine.start()
    params = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
    stream = engine.add_request("s", prompt_token_ids=[5, 6, 7], params=params)
    first = await stream.__anext__()
    assert first.finish_reason is None
    await engine.shutdown()
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    with pytest.raises(EngineStopped):
        engine.add_request("late", "hi", params=GREEDY)
