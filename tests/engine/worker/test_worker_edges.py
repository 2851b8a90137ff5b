"""Worker edge cases around ownership of request-stream entries, on the real local Redis.

- The liveness thread re-claims only entries still pending for its own worker: one another
  worker took over stays there, and this worker is told to stop serving it. Its heartbeat
  also drops models stamped in the model registry too long ago, and after a Redis outage it
  is back within a fraction of its interval, not a whole one.
- An entry answered but whose XACK has not been written yet (Redis slow or unreachable from
  the worker's event loop) is still vouched for, so nobody takes it over and fails it.
- A second entry carrying the id of a request already being served is acknowledged at once,
  rather than left pending until another worker takes it over and fails the live stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.serving.async_engine import AsyncEngine
from sluicegate.engine.worker import Worker, WorkerOptions
from sluicegate.engine.worker.liveness import RETRY_AFTER_FAILURE_S, LivenessThread
from tests.gateway.private_redis import PrivateRedis

from .worker_harness import REDIS_URL, WorkerHarness

CLAIM_IDLE_S = 1.0
INTERVAL_S = 0.2


def _model() -> str:
    return f"test-edges-{uuid.uuid4().hex[:10]}"


def _cleanup(client: redis.Redis, model: str) -> None:
    keys = list(client.scan_iter(f"*{model}*"))
    if keys:
        client.delete(*keys)


def _owners(client: redis.Redis, stream: str) -> dict[bytes, tuple[bytes, int]]:
    pending = client.xpending_range(stream, redis_names.REQUEST_GROUP, "-", "+", 100)
    return {p["message_id"]: (p["consumer"], p["time_since_delivered"]) for p in pending}


def test_liveness_reclaims_only_entries_still_its_own() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    model = _model()
    stream = redis_names.request_stream(model)
    client.xgroup_create(stream, redis_names.REQUEST_GROUP, id="0", mkstream=True)
    mine = client.xadd(stream, {redis_names.MESSAGE_FIELD: b"a"})
    taken = client.xadd(stream, {redis_names.MESSAGE_FIELD: b"b"})
    client.xreadgroup(redis_names.REQUEST_GROUP, "w1", {stream: ">"})
    lost: list[tuple[str, list[bytes]]] = []
    thread = LivenessThread(
        REDIS_URL,
        model,
        "w1",
        lambda: [(stream, mine), (stream, taken)],
        on_lost=lambda s, ids: lost.append((s, ids)),
    )
    try:
        thread.publish(protocol.Heartbeat("w1", model, model, "test", time.time()))
        time.sleep(0.3)
        # w1 was presumed dead (a partition, say) and w2 took this entry over.
        client.xclaim(stream, redis_names.REQUEST_GROUP, "w2", 0, [taken], justid=True)
        thread.beat()
        owners = _owners(client, stream)
        assert owners[taken][0] == b"w2", "an entry another worker took over stays with it"
        assert owners[mine][0] == b"w1"
        assert owners[mine][1] < 250, "its own entry's idle time was reset"
        assert lost == [(stream, [taken])]
    finally:
        thread.stop()
        _cleanup(client, model)
        client.close()


class PausableProxy:
    """A TCP relay to Redis that a test can pause: bytes wait in the kernel, as on a stalled
    network path, until it resumes."""

    def __init__(self, port: int = 6379) -> None:
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.paused = threading.Event()
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        # The opposite direction's pump closes both sockets when its side ends; select() on a
        # closed socket (fileno -1) then raises ValueError, which ends this pump just the same.
        with contextlib.suppress(OSError, ValueError):
            while not self.closed.is_set():
                if self.paused.is_set():
                    time.sleep(0.01)
                    continue
                ready, _, _ = select.select([src], [], [], 0.01)
                if not ready or self.paused.is_set():
                    continue
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


@contextlib.contextmanager
def _proxy() -> Iterator[PausableProxy]:
    proxy = PausableProxy()
    try:
        yield proxy
    finally:
        proxy.close()


@contextlib.asynccontextmanager
async def _worker(model_dir: Path, model: str, loop_redis_url: str) -> AsyncIterator[Worker]:
    """A worker whose event loop talks to Redis at ``loop_redis_url``; its liveness thread
    always talks to Redis directly."""
    loop_redis = aioredis.from_url(loop_redis_url)
    engine = AsyncEngine(model_dir, num_kv_blocks=128)
    await engine.start()
    options = WorkerOptions(
        model_name=model,
        redis_url=REDIS_URL,
        worker_id="w1",
        heartbeat_interval_s=INTERVAL_S,
        claim_idle_s=CLAIM_IDLE_S,
    )
    worker = Worker(engine, loop_redis, options)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await task
        await engine.shutdown()
        await loop_redis.aclose()


def _request(model: str, max_tokens: int) -> protocol.Request:
    return protocol.Request(
        request_id=uuid.uuid4().hex,
        model=model,
        prompt="The quick brown fox",
        sampling=protocol.Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _replies(harness: WorkerHarness, request_id: str) -> list[Any]:
    return await harness.replies(request_id, timeout_s=60)


async def _eventually(check: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_an_answered_entry_is_not_taken_over_while_its_ack_lags(llama_dir: Path) -> None:
    model = _model()
    direct = aioredis.from_url(REDIS_URL)
    sync = redis.Redis.from_url(REDIS_URL)
    stream = redis_names.request_stream(model)
    try:
        with _proxy() as proxy:
            async with _worker(llama_dir, model, proxy.url) as worker:
                harness = WorkerHarness(direct, model, worker.engine, worker)
                # Long enough to be seen in flight (see the duplicate-entry test below).
                request = _request(model, max_tokens=512)
                await harness.send(request)
                await _eventually(lambda: bool(worker.in_flight))
                # The event loop's Redis path stalls; the engine finishes regardless.
                proxy.paused.set()
                await _eventually(lambda: not worker.in_flight, timeout_s=60)
                await asyncio.sleep(CLAIM_IDLE_S * 2)
                claimed = sync.xautoclaim(
                    stream, redis_names.REQUEST_GROUP, "w2", int(CLAIM_IDLE_S * 1000), justid=True
                )
                assert claimed == [], "the answered entry was left for others to take over"
                proxy.paused.clear()
                replies = await _replies(harness, request.request_id)
                assert not any(isinstance(m, protocol.Error) for m in replies), replies
                await _eventually(lambda: sync.xlen(stream) == 0)
                assert _owners(sync, stream) == {}
    finally:
        _cleanup(sync, model)
        sync.close()
        await direct.aclose()


async def test_a_duplicate_entry_is_acked_and_never_fails_the_live_stream(
    llama_dir: Path,
) -> None:
    model = _model()
    direct = aioredis.from_url(REDIS_URL)
    sync = redis.Redis.from_url(REDIS_URL)
    stream = redis_names.request_stream(model)
    try:
        async with _worker(llama_dir, model, REDIS_URL) as worker:
            harness = WorkerHarness(direct, model, worker.engine, worker)
            # Long enough to still be in flight when the copy arrives (the tiny model makes
            # several tokens between two of _eventually's looks).
            request = _request(model, max_tokens=512)
            await harness.send(request)
            await _eventually(lambda: bool(worker.in_flight))
            await harness.send(request)  # a gateway's retried XADD
            replies = await _replies(harness, request.request_id)
            assert not any(isinstance(m, protocol.Error) for m in replies), replies
            # Long enough for a stranded entry to go idle and be taken over by a claim loop.
            await asyncio.sleep(CLAIM_IDLE_S + 4 * INTERVAL_S)
            everything = await direct.xrange(redis_names.reply_stream(request.request_id))
            messages = [protocol.decode(f[redis_names.MESSAGE_FIELD]) for _, f in everything]
            flat = [
                x for m in messages for x in (m.messages if isinstance(m, protocol.Batch) else [m])
            ]
            assert not any(isinstance(m, protocol.Error) for m in flat), flat
            assert sync.xlen(stream) == 0
            assert _owners(sync, stream) == {}
    finally:
        _cleanup(sync, model)
        sync.close()
        await direct.aclose()


def test_a_heartbeat_drops_models_stamped_long_ago() -> None:
    client = redis.Redis.from_url(REDIS_URL)
    model, gone, recent = _model(), _model(), _model()
    now = time.time()
    client.zadd(redis_names.MODEL_REGISTRY, {gone: now - redis_names.MODEL_STAMP_KEPT_S - 60})
    client.zadd(redis_names.MODEL_REGISTRY, {recent: now - 3600})
    thread = LivenessThread(REDIS_URL, model, "w1", list, on_lost=lambda s, ids: None)
    try:
        thread.publish(protocol.Heartbeat("w1", model, model, "test", now))
        thread.beat()
        stamped = {m.decode() for m in client.zrange(redis_names.MODEL_REGISTRY, 0, -1)}
        assert model in stamped and recent in stamped
        assert gone not in stamped
    finally:
        thread.stop()
        client.zrem(redis_names.MODEL_REGISTRY, model, gone, recent)
        _cleanup(client, model)
        client.close()


def test_heartbeat_is_back_soon_after_a_redis_outage() -> None:
    """Redis comes back empty (a restart without persistence, a failover that outlasted the
    key's TTL): the heartbeat must reappear well before the next regular beat would write it."""
    interval_s = 1.0
    server = PrivateRedis()
    server.start()
    model = _model()
    thread = LivenessThread(server.url, model, "w1", list, interval_s=interval_s, ttl_s=3.0)
    client = redis.Redis.from_url(server.url)
    try:
        thread.publish(protocol.Heartbeat("w1", model, model, "test", time.time()))
        thread.start()
        server.crash()
        time.sleep(interval_s + 0.2)  # the first beat has failed
        server.start()
        back_at = time.monotonic()
        key = redis_names.heartbeat_key(model, "w1")
        while not client.exists(key):
            assert time.monotonic() - back_at < interval_s / 2, "no heartbeat after the outage"
            time.sleep(RETRY_AFTER_FAILURE_S / 4)
    finally:
        thread.stop(remove_key=False)
        client.close()
        server.close()
