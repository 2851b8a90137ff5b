"""Acceptance 2 of LoRA, with real worker processes on the real Redis: adapters are loaded,
unloaded and swapped (device slots and host memory, least recently used) while traffic of
several adapters and of the base model runs; no request fails, and every answer is its own
adapter's (checked token for token against transformers + peft)."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from sluicegate.engine import protocol, redis_names
from tests.e2e.conftest import Cluster, model_name
from tests.engine.lora.adapters import make_adapter, peft_greedy

pytestmark = pytest.mark.timeout(300)

TOKENS = 10
PROMPTS = [[5, 71, 200, 13, 9], [300, 41, 41, 7, 88, 120, 3, 64, 250], [17] * 20]


async def replies(redis: aioredis.Redis, request_id: str) -> list[object]:
    stream = redis_names.reply_stream(request_id)
    messages: list[object] = []
    last_id = "0-0"
    async with asyncio.timeout(120):
        while True:
            reply = await redis.xread({stream: last_id}, block=200)
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id
                    message = protocol.decode(fields[redis_names.MESSAGE_FIELD])
                    batch = message.messages if isinstance(message, protocol.Batch) else [message]
                    messages.extend(batch)
            if any(isinstance(m, protocol.Error) for m in messages) or any(
                isinstance(m, protocol.Delta) and m.finish_reason for m in messages
            ):
                await redis.delete(stream)
                return messages


async def control(
    redis: aioredis.Redis, model: str, worker: str, message_of: object
) -> protocol.ControlReply:
    reply_to = f"sg:test:lora-ctl:{uuid.uuid4().hex[:8]}"
    message = message_of(reply_to)  # type: ignore[operator]
    stream = redis_names.control_stream(model, worker)
    await redis.xadd(stream, {redis_names.MESSAGE_FIELD: protocol.encode(message)})
    async with asyncio.timeout(60):
        while True:
            reply = await redis.xread({reply_to: "0-0"}, block=200)
            for _, entries in reply or []:
                await redis.delete(reply_to)
                answer = protocol.decode(entries[0][1][redis_names.MESSAGE_FIELD])
                assert isinstance(answer, protocol.ControlReply)
                return answer


async def heartbeat(redis: aioredis.Redis, model: str, worker: str) -> protocol.Heartbeat:
    beat = protocol.decode(await redis.get(redis_names.heartbeat_key(model, worker)))
    assert isinstance(beat, protocol.Heartbeat)
    return beat


def test_load_unload_and_swap_under_traffic(
    cluster: Cluster, redis_url: str, tmp_path: Path
) -> None:
    base = cluster.model_dir
    folders = {
        "a": make_adapter(base, tmp_path / "a", seed=31),
        "b": make_adapter(base, tmp_path / "b", seed=32, rank=4, targets=["q_proj", "v_proj"]),
        "c": make_adapter(base, tmp_path / "c", seed=33, rank=16, alpha=32, rslora=True),
    }
    expected = {
        name: peft_greedy(base, folders[name] if name else None, PROMPTS, TOKENS)
        for name in (None, "a", "b", "c")
    }
    assert len({str(v) for v in expected.values()}) == 4, "each adapter changes the tokens"
    model = model_name("lora")
    # Two adapters per step on w1, whose host memory holds all three (the traffic loads
    # them lazily: with room for two, "a" could leave as least recently used before the
    # command that unloads it); one per step on w2, whose host memory holds two of three.
    cluster.worker(model, redis_url, "--worker-id", "lora-w1", "--max-loras", "2",
                   "--max-cpu-loras", "3", "--max-lora-rank", "16",
                   "--lora-modules", f"a={folders['a']}")  # fmt: skip
    cluster.worker(model, redis_url, "--worker-id", "lora-w2", "--max-loras", "1",
                   "--max-cpu-loras", "2", "--max-lora-rank", "16")  # fmt: skip
    asyncio.run(_traffic(redis_url, model, folders, expected))


async def _traffic(
    redis_url: str,
    model: str,
    folders: dict[str, Path],
    expected: dict[str | None, list[list[int]]],
) -> None:
    redis = aioredis.from_url(redis_url)
    try:
        assert (await heartbeat(redis, model, "lora-w1")).loras == ["a"]
        assert (await heartbeat(redis, model, "lora-w2")).max_loras == 1
        adapters = {n: protocol.LoraAdapter(n, str(f)) for n, f in folders.items()}
        names = itertools.cycle(["a", None, "b", "c", "b", "a", "c", None])
        plan = [
            (worker, next(names), prompt)
            for _ in range(3)
            for worker in ("lora-w1", "lora-w2")
            for prompt in range(len(PROMPTS))
        ]

        async def one(worker: str, name: str | None, prompt: int) -> None:
            request_id = f"lora-{uuid.uuid4().hex[:10]}"
            sampling = protocol.Sampling(max_tokens=TOKENS, temperature=0, ignore_eos=True)
            request = protocol.Request(
                request_id, model, sampling, prompt_token_ids=PROMPTS[prompt],
                lora=adapters[name] if name else None,
            )  # fmt: skip
            await redis.xadd(
                redis_names.worker_stream(model, worker),
                {redis_names.MESSAGE_FIELD: protocol.encode(request)},
            )
            messages = await replies(redis, request_id)
            assert not [m for m in messages if isinstance(m, protocol.Error)], messages
            got = [t for m in messages if isinstance(m, protocol.Delta) for t in m.token_ids]
            assert got == expected[name][prompt], (worker, name, prompt)

        async def commands() -> list[protocol.ControlReply]:
            answers = []
            for worker, make in [
                ("lora-w1", lambda r: protocol.LoadLora(adapters["b"], r)),
                ("lora-w1", lambda r: protocol.UnloadLora("a", r)),
                ("lora-w2", lambda r: protocol.LoadLora(adapters["c"], r)),
                ("lora-w1", lambda r: protocol.LoadLora(adapters["c"], r)),
                ("lora-w2", lambda r: protocol.UnloadLora("c", r)),
            ]:
                answers.append(await control(redis, model, worker, make))
                await asyncio.sleep(0.2)
            return answers

        traffic = [one(*item) for item in plan]
        answers, *_ = await asyncio.gather(commands(), *traffic)
        assert [a.ok for a in answers] == [True] * 5, answers
        broken = protocol.LoraAdapter("broken", "/nonexistent/adapter")
        failed = await control(redis, model, "lora-w1", lambda r: protocol.LoadLora(broken, r))
        assert not failed.ok and "not found" in failed.message
        # Both serve on, each adapter still its own after all the swapping.
        await asyncio.gather(*(one(w, n, 1) for w in ("lora-w1", "lora-w2") for n in "abc"))
        # Host memory holds two of the three; the least recently used was dropped (seen in
        # a heartbeat after the last loads: published every second).
        for _ in range(50):
            held = (await heartbeat(redis, model, "lora-w2")).loras
            if len(held) == 2:
                break
            await asyncio.sleep(0.2)
        assert len(held) == 2, held
    finally:
        await redis.aclose()
