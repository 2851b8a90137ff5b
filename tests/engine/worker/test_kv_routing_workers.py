"""Routing by KV events with two real workers on real Redis: the gateway's provider sends a
request to the worker that holds the longest prefix of its blocks, and the shared stream
takes requests whose prefix nobody holds more of."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.canonical import ChatRequest, Sampling
from sluicegate.gateway.providers.engine.provider import EngineProvider
from sluicegate.gateway.settings import Settings
from tests.engine.worker.worker_harness import WorkerHarness, kv_worker, redis_for_test


async def serve_on(harness: WorkerHarness, worker_id: str, prompt: list[int]) -> None:
    """One request on a given worker's own stream, as affinity routing sends it."""
    request = protocol.Request(
        request_id=f"direct-{uuid.uuid4().hex[:8]}",
        model=harness.model,
        prompt_token_ids=prompt,
        sampling=protocol.Sampling(max_tokens=1, temperature=0),
    )
    stream = redis_names.worker_stream(harness.model, worker_id)
    await harness.redis.xadd(stream, {redis_names.MESSAGE_FIELD: protocol.encode(request)})
    await harness.replies(request.request_id)


def cached(harness: WorkerHarness) -> set[int]:
    assert harness.engine.core is not None
    return harness.engine.core.scheduler.block_manager.cached_block_hashes()


def hits(harness: WorkerHarness) -> int:
    assert harness.engine.core is not None
    return harness.engine.core.scheduler.block_manager.prefix_cache_hits


async def test_a_request_goes_to_the_worker_with_its_longest_prefix(
    llama_dir: Path, redis_url: str
) -> None:
    rng = random.Random(7)
    prefix = [rng.randrange(3, 300) for _ in range(100)]
    async with (
        redis_for_test(redis_url) as (redis, model),
        kv_worker(llama_dir, redis, model, "w1", num_kv_blocks=64) as w1,
        kv_worker(llama_dir, redis, model, "w2", num_kv_blocks=64) as w2,
    ):
        provider = EngineProvider(redis, Settings(redis_url=redis_url), model)
        try:
            # w1 holds the whole prefix (6 blocks), w2 only its first 2 blocks.
            await serve_on(w1, "w1", [*prefix, 5])
            await serve_on(w2, "w2", prefix[:40])
            workers: dict[str, protocol.Heartbeat] = {}
            router = provider.kv_routing
            probe = protocol.Request(
                request_id="probe", model=model, prompt_token_ids=[*prefix, 9, 9]
            )
            async with asyncio.timeout(30):
                while True:
                    workers = await provider.live_workers()
                    blocks = await router.block_hashes(probe, workers)
                    indexes = [router.index.synced(w) for w in ("w1", "w2")]
                    if (
                        blocks is not None
                        and all(indexes)
                        and indexes[0].blocks.hashes() == cached(w1)  # type: ignore[union-attr]
                        and indexes[1].blocks.hashes() == cached(w2)  # type: ignore[union-attr]
                    ):
                        break
                    await router.index.read_once()
            assert len(blocks) == 6
            load = provider.workers.load(workers)
            assert await router.pick(blocks, workers, load) == "w1"
            other = protocol.Request(
                request_id="other",
                model=model,
                prompt_token_ids=[*prefix[:40], *(rng.randrange(3, 300) for _ in range(60))],
            )
            other_blocks = await router.block_hashes(other, workers)
            assert other_blocks is not None
            assert await router.pick(other_blocks, workers, load) is None  # both hold 2

            before = hits(w1), hits(w2)
            request = ChatRequest(
                request_id=uuid.uuid4().hex,
                model=model,
                prompt=[*prefix, 11, 12],
                sampling=Sampling(max_tokens=2, temperature=0, ignore_eos=True),
            )
            async for _ in provider.generate(request):
                pass
            assert hits(w1) - before[0] == 6 * 16
            assert hits(w2) == before[1]
        finally:
            await provider.close()
