"""Each engine worker's prefix cache as the gateway knows it, followed from the worker's KV
events (``sluicegate.engine.kv_events``; docs/kv-events.md).

One task per provider reads every publishing worker's event stream with one blocking XREAD,
and routing reads once more, without blocking, right before each decision (so it sees what
was published up to then); each entry is applied once, whoever read it first.
A worker's index is *synced* while the batches it read are consecutive (same ``epoch``,
``seq`` one more each time); a gap (a trimmed stream, a reader that fell behind, a lost
batch) or a new epoch that does not start at 0 unsyncs it, and it syncs again from the
worker's latest snapshot: load its block set, read the stream after the snapshot's entry,
skip the batches it already covers. A worker that restarted starts a new epoch at seq 0 with
``KvAllCleared``, which needs no snapshot. Routing trusts synced indexes only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.kv_events.block_set import BlockSet
from sluicegate.gateway.providers.engine.call import text
from sluicegate.gateway.providers.engine.workers import EngineWorkers

logger = logging.getLogger(__name__)

_BLOCK_MS = 200
_IDLE_S = 0.2
_READ_COUNT = 1000


@dataclass
class WorkerIndex:
    worker_id: str
    blocks: BlockSet = field(default_factory=BlockSet)
    epoch: str = ""
    seq: int = -1
    after: str = "0-0"
    block_size: int = 0
    synced: bool = False
    gaps: int = 0
    """Times this index lost track (and resynced or waits to)."""

    def take(self, entry_id: str, batch: kv_messages.KvEventBatch) -> None:
        """One stream entry, in stream order; one read already (by a concurrent reader) is
        skipped."""
        if _entry_order(entry_id) <= _entry_order(self.after):
            return
        self.after = entry_id
        if batch.epoch != self.epoch and batch.seq == 0:
            # A worker (re)start: its cache begins empty, and so does our view of it.
            self.blocks = BlockSet()
            self.epoch, self.seq = batch.epoch, -1
        if batch.epoch != self.epoch or batch.seq > self.seq + 1:
            self._lost(f"expected batch {self.seq + 1} of {self.epoch}, read {batch.seq} of "
                       f"{batch.epoch}")  # fmt: skip
            return
        if batch.seq <= self.seq:
            return  # already in the snapshot this index started from
        self.blocks.apply(batch.events)
        self.seq, self.block_size = batch.seq, batch.block_size

    def load(self, snapshot: kv_messages.KvSnapshot) -> None:
        self.blocks = BlockSet()
        self.blocks.load(snapshot.block_hashes)
        self.epoch, self.seq, self.after = snapshot.epoch, snapshot.seq, snapshot.after
        self.block_size, self.synced = snapshot.block_size, True

    def _lost(self, why: str) -> None:
        logger.info("KV index of worker %s lost track (%s); resyncing", self.worker_id, why)
        self.synced = False
        self.gaps += 1


class KvIndex:
    def __init__(self, redis: Redis, model: str, workers: EngineWorkers) -> None:
        self._redis = redis
        self.model = model
        self._workers = workers
        self.indexes: dict[str, WorkerIndex] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Follow the workers from now on (idempotent; call on the provider's event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._follow())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # Bounded: a connection torn down mid-XREAD must not hold up the provider's close.
            await asyncio.wait({self._task}, timeout=2.0)

    def synced(self, worker_id: str) -> WorkerIndex | None:
        index = self.indexes.get(worker_id)
        return index if index is not None and index.synced else None

    async def _follow(self) -> None:
        while True:
            try:
                await self.read_once()
            except (RedisError, OSError, TimeoutError) as exc:
                logger.warning("KV events of %s unreadable (%s)", self.model, exc)
                for index in self.indexes.values():
                    index.synced = False  # what happened meanwhile is unknown
                await asyncio.sleep(1.0)

    async def read_once(self) -> None:
        """Sync what is unsynced, then read what the synced workers published since."""
        live = await self._workers.live_workers()
        publishing = {w for w, beat in live.items() if beat.kv_events}
        for worker_id in set(self.indexes) - publishing:
            del self.indexes[worker_id]
        for worker_id in publishing:
            index = self.indexes.setdefault(worker_id, WorkerIndex(worker_id))
            if not index.synced:
                await self._sync(index)
        await self.read_synced(block_ms=_BLOCK_MS)

    async def read_synced(self, block_ms: int | None) -> int:
        """Read the synced workers' streams once (waiting up to ``block_ms`` for a first
        entry; None: not at all); the batches read."""
        synced = {
            redis_names.kv_events_stream(self.model, w): index
            for w, index in self.indexes.items()
            if index.synced
        }
        if not synced:
            await asyncio.sleep(_IDLE_S if block_ms else 0)
            return 0
        streams = {stream: index.after for stream, index in synced.items()}
        reply = await self._redis.xread(streams, count=_READ_COUNT, block=block_ms)
        read = 0
        for stream, entries in reply or []:
            index = synced[text(stream)]
            read += len(entries)
            for entry_id, fields in entries:
                if not index.synced:
                    break
                batch = _decode(fields)
                if isinstance(batch, kv_messages.KvEventBatch):
                    index.take(text(entry_id), batch)
        return read

    async def _sync(self, index: WorkerIndex) -> None:
        raw = await self._redis.get(redis_names.kv_snapshot_key(self.model, index.worker_id))
        snapshot = _decode({redis_names.MESSAGE_FIELD: raw}) if raw is not None else None
        if isinstance(snapshot, kv_messages.KvSnapshot):
            index.load(snapshot)


def _entry_order(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)


def _decode(fields: dict[Any, Any]) -> kv_messages.KvMessage | None:
    raw = fields.get(redis_names.MESSAGE_FIELD)
    if raw is None:
        return None
    try:
        return kv_messages.decode_kv(raw)
    except protocol.MalformedMessage:
        return None
