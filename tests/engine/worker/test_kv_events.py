"""KV events end to end on real Redis: an in-process worker with a small KV cache publishes its
prefix cache's changes, and the gateway's index rebuilt from them equals the worker's block
set after a random workload with evictions, heals from a gap in the stream, follows a worker
restart, and hashes a request's blocks as the worker does."""

from __future__ import annotations

import asyncio
import random
import uuid
from pathlib import Path

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.core.block_manager import compute_block_hashes
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.kv_events.prompt_tokens import PromptTokenizer
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving.async_engine import AsyncEngine
from sluicegate.gateway.providers.engine.kv_index import KvIndex
from sluicegate.gateway.providers.engine.workers import EngineWorkers
from tests.engine.worker.worker_harness import WorkerHarness, kv_worker, redis_for_test

BLOCK_SIZE = 16


def cached(harness: WorkerHarness) -> set[int]:
    assert harness.engine.core is not None
    return harness.engine.core.scheduler.block_manager.cached_block_hashes()


async def run_workload(harness: WorkerHarness, seed: int, count: int) -> None:
    """Requests sharing a few prefixes, with random tails and lengths, four at a time: more
    blocks than the cache holds, so blocks are evicted all along."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 70))] for _ in range(5)]
    limit = asyncio.Semaphore(4)

    async def one(index: int) -> None:
        prompt = rng.choice(prefixes) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]
        request = protocol.Request(
            request_id=f"kv-{seed}-{index}-{uuid.uuid4().hex[:6]}",
            model=harness.model,
            prompt_token_ids=prompt,
            sampling=protocol.Sampling(
                max_tokens=rng.randrange(1, 12), temperature=0, ignore_eos=True
            ),
        )
        async with limit:
            await harness.send(request)
            replies = await harness.replies(request.request_id)
        assert not any(isinstance(r, protocol.Error) for r in replies), replies

    await asyncio.gather(*(one(i) for i in range(count)))


async def caught_up(harness: WorkerHarness, index: KvIndex, timeout_s: float = 20.0) -> None:
    """Until the index has read every batch the worker published, synced."""
    publisher = harness.worker.kv_events
    assert publisher is not None
    async with asyncio.timeout(timeout_s):
        while True:
            state = index.indexes.get(harness.worker.options.worker_id)
            flushed = not publisher._pending and publisher.started
            if flushed and state is not None and state.synced and state.seq == publisher.seq:
                return
            await index.read_once()


async def test_the_index_equals_the_worker_cache_after_evictions_and_heals_a_gap(
    llama_dir: Path, redis_url: str
) -> None:
    async with redis_for_test(redis_url) as (redis, model):
        async with kv_worker(llama_dir, redis, model) as harness:
            index = KvIndex(redis, model, EngineWorkers(redis, model, heartbeat_ttl_s=3.0))
            await run_workload(harness, seed=1, count=30)
            await caught_up(harness, index)
            state = index.indexes["w1"]
            assert state.blocks.hashes() == cached(harness)
            assert state.gaps == 0
            entries = await redis.xrange(redis_names.kv_events_stream(model, "w1"))
            events = [e for _, f in entries for e in kv_messages.decode_kv(f[b"m"]).events]
            assert any(isinstance(e, kv_messages.KvBlockRemoved) for e in events), "no eviction"

            # The reader falls behind and the stream is trimmed past it: a gap.
            await run_workload(harness, seed=2, count=12)
            await asyncio.sleep(0.3)
            await redis.xtrim(
                redis_names.kv_events_stream(model, "w1"), maxlen=1, approximate=False
            )
            await run_workload(harness, seed=3, count=6)
            await caught_up(harness, index)
            assert state is index.indexes["w1"] and state.gaps >= 1
            assert state.blocks.hashes() == cached(harness)

        # The same worker id starts again, with an empty cache: a new epoch from seq 0.
        async with kv_worker(llama_dir, redis, model) as restarted:
            await run_workload(restarted, seed=4, count=4)
            await caught_up(restarted, index)
            assert index.indexes["w1"].epoch == restarted.worker.kv_events.epoch  # type: ignore[union-attr]
            assert index.indexes["w1"].blocks.hashes() == cached(restarted)


async def test_the_gateway_hashes_a_chat_request_as_the_worker_does(
    llama_dir: Path, redis_url: str
) -> None:
    async with redis_for_test(redis_url) as (redis, model):
        async with kv_worker(llama_dir, redis, model) as harness:
            publisher = harness.worker.kv_events
            assert publisher is not None and publisher.tokenizer_digest
            for _ in range(200):
                if harness.worker.heartbeat().kv_events:
                    break
                await asyncio.sleep(0.05)
            assert harness.worker.heartbeat().kv_events
            raw = await redis.get(redis_names.tokenizer_key(model, publisher.tokenizer_digest))
            files = kv_messages.decode_kv(raw)
            assert isinstance(files, kv_messages.TokenizerFiles)
            request = protocol.Request(
                request_id=f"chat-{uuid.uuid4().hex[:8]}",
                model=model,
                messages=[
                    protocol.ChatMessage("system", "Paged attention stores keys in blocks."),
                    protocol.ChatMessage("user", "What is the capital of France? " * 3),
                ],
                sampling=protocol.Sampling(max_tokens=2, temperature=0),
            )
            ids = PromptTokenizer(files).prompt_token_ids(request)
            assert ids is not None
            hashes = compute_block_hashes(ids[: (len(ids) - 1)], BLOCK_SIZE)
            assert len(hashes) >= 2
            await harness.send(request)
            await harness.replies(request.request_id)
            assert set(hashes) <= cached(harness)


async def test_events_cross_from_an_engine_core_process(llama_dir: Path) -> None:
    """With the core in its own process, each step's events come over its pipe in order."""
    engine = AsyncEngine(llama_dir, num_kv_blocks=32, kv_events=True, core_process=True)
    events: list[kv_messages.KvEvent] = []
    engine.on_kv_events = events.extend
    await engine.start()
    try:
        prompt = [(7 * i) % 290 + 3 for i in range(50)]
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        outputs = [
            d async for d in engine.add_request("p1", prompt_token_ids=prompt, params=params)
        ]
    finally:
        await engine.shutdown()
    generated = [t for d in outputs for t in d.token_ids]
    # Every computed full block (the last output token is never computed), in chain order.
    computed = (prompt + generated)[: len(prompt) + len(generated) - 1]
    stored = [e for e in events if isinstance(e, kv_messages.KvBlockStored)]
    assert [e.block_hash for e in stored] == compute_block_hashes(computed, BLOCK_SIZE)
    assert [e.parent_hash for e in stored] == [None, *(e.block_hash for e in stored[:-1])]
    assert all(len(e.token_ids) == BLOCK_SIZE for e in stored)
