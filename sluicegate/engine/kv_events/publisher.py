"""The worker side of KV events: each engine step's prefix-cache changes go to the worker's
event stream as one ``KvEventBatch``; a ``KvSnapshot`` of the whole cache is kept beside it
for readers that lost track; the tokenizer is published once for gateways to hash with.

The publisher keeps its own copy of the cache's block set, updated from the same events it
sends, so a snapshot always matches the batch it names, without asking the engine core.
A batch that could not be written (Redis down) still takes its sequence number: readers see
the gap and heal from the snapshot, which is written again as soon as Redis answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.kv_events.block_set import BlockSet
from sluicegate.engine.kv_events.prompt_tokens import tokenizer_digest
from sluicegate.engine.kv_events.tokenizer_files import tokenizer_files

logger = logging.getLogger("sluicegate.worker")

MAX_STREAM_LEN = 10_000
"""Batches kept in a worker's stream (approximately: Redis trims whole nodes). A reader
further behind than this heals from the snapshot."""
SNAPSHOT_INTERVAL_S = 2.0
KEPT_S = 120.0
"""How long the stream, the snapshot and the tokenizer outlive the worker's last write."""
_FAILED_RETRY_S = 0.5


class KvEventPublisher:
    def __init__(
        self,
        redis: aioredis.Redis,
        model: str,
        worker_id: str,
        block_size: int,
        hf_tokenizer: Any = None,
        *,
        snapshot_interval_s: float = SNAPSHOT_INTERVAL_S,
        max_stream_len: int = MAX_STREAM_LEN,
    ) -> None:
        self.redis = redis
        self.model = model
        self.worker_id = worker_id
        self.block_size = block_size
        self.snapshot_interval_s = snapshot_interval_s
        self.max_stream_len = max_stream_len
        self.stream = redis_names.kv_events_stream(model, worker_id)
        self.snapshot_key = redis_names.kv_snapshot_key(model, worker_id)
        self.epoch = uuid.uuid4().hex[:16]
        """This start's name: a restarted worker's batches count from 0 again."""
        self.blocks = BlockSet()
        self.seq = -1
        self.after = "0-0"
        """The stream entry of the last batch written."""
        self.started = False
        """The start's first batch (the cache is empty), a snapshot and the tokenizer are in
        Redis: the heartbeat tells gateways they can follow this worker's cache."""
        self._pending: list[list[kv_messages.KvEvent]] = [[kv_messages.KvAllCleared()]]
        self._wake = asyncio.Event()
        self._snapshot_seq = -1
        self._snapshot_at = 0.0
        self._snapshot_due = False
        files = tokenizer_files(hf_tokenizer) if hf_tokenizer is not None else None
        self._tokenizer = protocol.encode(files) if files is not None else None
        self.tokenizer_digest = tokenizer_digest(files) if files is not None else ""

    def add(self, events: list[kv_messages.KvEvent]) -> None:
        """One engine step's changes (``AsyncEngine.on_kv_events``), on the event loop."""
        self._pending.append(events)
        self._wake.set()

    async def run(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.snapshot_interval_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
            except (RedisError, OSError, TimeoutError) as exc:
                logger.warning("KV events not published (%s); readers will resync", exc)
                await asyncio.sleep(_FAILED_RETRY_S)

    async def flush(self) -> None:
        """Write the batches taken so far, then the snapshot if one is due."""
        batches, self._pending = self._pending, []
        if batches:
            pipe = self.redis.pipeline(transaction=False)
            for events in batches:
                self.seq += 1
                self.blocks.apply(events)
                batch = kv_messages.KvEventBatch(
                    self.worker_id, self.epoch, self.seq, self.block_size, events
                )
                pipe.xadd(
                    self.stream,
                    {redis_names.MESSAGE_FIELD: protocol.encode(batch)},
                    maxlen=self.max_stream_len,
                    approximate=True,
                )
            try:
                entry_ids = await pipe.execute()
            except BaseException:
                self._snapshot_due = True
                raise
            self.after = _text(entry_ids[-1])
        now = time.monotonic()
        if self._snapshot_due or now - self._snapshot_at >= self.snapshot_interval_s:
            await self._write_snapshot(now)

    async def _write_snapshot(self, now: float) -> None:
        kept_ms = int(KEPT_S * 1000)
        pipe = self.redis.pipeline(transaction=False)
        rewrite = self.seq != self._snapshot_seq or self._snapshot_due
        if rewrite:
            snapshot = kv_messages.KvSnapshot(
                self.worker_id,
                self.epoch,
                self.seq,
                self.after,
                self.block_size,
                sorted(self.blocks.hashes()),
            )
            pipe.set(self.snapshot_key, protocol.encode(snapshot), px=kept_ms)
        else:
            pipe.pexpire(self.snapshot_key, kept_ms)
        pipe.pexpire(self.stream, kept_ms)
        tokenizer_key = redis_names.tokenizer_key(self.model, self.tokenizer_digest)
        if self._tokenizer is not None:
            pipe.pexpire(tokenizer_key, kept_ms)
        results = await pipe.execute()
        if self._tokenizer is not None and not results[-1]:
            # Not there yet, or Redis lost it: the files are large, so only then written.
            await self.redis.set(tokenizer_key, self._tokenizer, px=kept_ms)
        self._snapshot_seq, self._snapshot_at = self.seq, now
        # A snapshot that was gone when only its expiry was refreshed is written next time.
        self._snapshot_due = not rewrite and not results[0]
        self.started = self.started or self.seq >= 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)
