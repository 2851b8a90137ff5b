"""An in-process engine worker on the real local Redis, for tests that speak the wire protocol."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.serving.async_engine import AsyncEngine
from sluicegate.engine.worker import Worker, WorkerOptions

REDIS_URL = "redis://127.0.0.1:6379/0"


class WorkerHarness:
    def __init__(
        self, redis: aioredis.Redis, model: str, engine: AsyncEngine, worker: Worker
    ) -> None:
        self.redis = redis
        self.model = model
        self.engine = engine
        self.worker = worker

    async def send(self, request: protocol.Request) -> None:
        await self.redis.xadd(
            redis_names.request_stream(self.model),
            {redis_names.MESSAGE_FIELD: protocol.encode(request)},
        )

    async def replies(self, request_id: str, timeout_s: float = 60.0) -> list[Any]:
        """Every reply of a request, up to its last one (a final delta per choice, or an error)."""
        stream = redis_names.reply_stream(request_id)
        messages: list[Any] = []
        last_id = "0-0"
        async with asyncio.timeout(timeout_s):
            while True:
                reply = await self.redis.xread({stream: last_id}, block=200)
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        message = protocol.decode(fields[redis_names.MESSAGE_FIELD])
                        if isinstance(message, protocol.Batch):
                            messages.extend(message.messages)
                        else:
                            messages.append(message)
                if _complete(messages):
                    return messages


def _complete(messages: list[Any]) -> bool:
    if any(isinstance(m, protocol.Error) for m in messages):
        return True
    finals = [m for m in messages if isinstance(m, protocol.Delta) and m.finish_reason]
    return bool(finals) and finals[-1].usage is not None and _all_choices_done(messages)


def _all_choices_done(messages: list[Any]) -> bool:
    choices = {m.index for m in messages if isinstance(m, protocol.Delta)}
    done = {m.index for m in messages if isinstance(m, protocol.Delta) and m.finish_reason}
    return done == choices and len(done) >= max(choices, default=0) + 1


@asynccontextmanager
async def running_worker(model_dir: Path, **engine_options: Any) -> AsyncIterator[WorkerHarness]:
    model = f"test-{uuid.uuid4().hex[:10]}"
    redis = aioredis.from_url(REDIS_URL)
    engine = AsyncEngine(model_dir, num_kv_blocks=128, **engine_options)
    await engine.start()
    worker = Worker(engine, redis, WorkerOptions(model_name=model, worker_id="w1"))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield WorkerHarness(redis, model, engine, worker)
    finally:
        stop.set()
        await task
        await engine.shutdown()
        keys = [k async for k in redis.scan_iter(f"*{model}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()


@asynccontextmanager
async def kv_worker(
    model_dir: Path,
    redis: aioredis.Redis,
    model: str,
    worker_id: str = "w1",
    num_kv_blocks: int = 24,
) -> AsyncIterator[WorkerHarness]:
    """A worker publishing KV events (a snapshot every 0.2 s) with a small cache."""
    engine = AsyncEngine(model_dir, num_kv_blocks=num_kv_blocks, kv_events=True)
    await engine.start()
    # A long heartbeat TTL: a loaded test machine must not make the worker look gone (its
    # index would be dropped and built afresh, hiding what a test watches).
    options = WorkerOptions(model_name=model, worker_id=worker_id, heartbeat_ttl_s=30.0)
    worker = Worker(engine, redis, options)
    assert worker.kv_events is not None
    worker.kv_events.snapshot_interval_s = 0.2
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield WorkerHarness(redis, model, engine, worker)
    finally:
        stop.set()
        await task
        await engine.shutdown()


@asynccontextmanager
async def redis_for_test(redis_url: str) -> AsyncIterator[tuple[aioredis.Redis, str]]:
    """A client and a fresh model name; every key of that model is deleted afterwards."""
    model = f"test-kv-{uuid.uuid4().hex[:8]}"
    redis = aioredis.from_url(redis_url)
    try:
        yield redis, model
    finally:
        keys = [k async for k in redis.scan_iter(f"*{model}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
