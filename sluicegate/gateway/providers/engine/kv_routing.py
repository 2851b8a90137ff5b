"""Routing by the workers' own prefix caches: hash the request's prompt blocks as a worker
would (its tokenizer and chat template, published in Redis), find on each worker's KV index
how many leading blocks it holds, and weigh that against its queue and KV pressure.

Applies only where every live worker publishes KV events with one tokenizer and block size,
every index is synced and the request has no LoRA adapter (whose blocks hash differently);
otherwise the provider keeps text-hash affinity (``prefix_affinity``). See docs/kv-events.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.core.block_manager import compute_block_hashes
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.kv_events.prompt_tokens import PromptTokenizer
from sluicegate.gateway.providers.engine.kv_index import KvIndex
from sluicegate.gateway.providers.engine.workers import AFFINITY_SLACK, KV_FULL, EngineWorkers

logger = logging.getLogger(__name__)

LOAD_WEIGHT = 1.0 / AFFINITY_SLACK
"""Score lost per queued request more than the least busy worker's: a worker holding the
whole prompt is preferred until it has ``AFFINITY_SLACK`` more (as with text affinity)."""
KV_WEIGHT = 0.25
"""Score lost at a full KV cache: there, new blocks evict others' prefixes or preempt."""
_INLINE_CHARS = 8192
"""Longer prompts are tokenized on a thread, off the event loop."""
_RETRY_TOKENIZER_S = 5.0


def choose_worker(
    prefix_blocks: dict[str, int],
    total_blocks: int,
    workers: dict[str, protocol.Heartbeat],
    load: dict[str, int],
) -> str | None:
    """The worker whose own stream the request goes to; None: the shared stream (no worker
    holds more of the prefix than the others, or the holders are too busy)."""
    room = {w: beat for w, beat in workers.items() if beat.kv_usage <= KV_FULL}
    if not room or total_blocks <= 0:
        return None
    held = [prefix_blocks.get(w, 0) for w in room]
    if max(held) == 0 or (len(room) > 1 and min(held) == max(held)):
        return None
    least = min(load.get(w, 0) for w in room)

    def score(worker: str) -> float:
        return (
            prefix_blocks.get(worker, 0) / total_blocks
            - LOAD_WEIGHT * (load.get(worker, 0) - least)
            - KV_WEIGHT * room[worker].kv_usage
        )

    best = max(sorted(room), key=score)
    return best if prefix_blocks.get(best, 0) else None


class KvRouter:
    def __init__(self, redis: Redis, model: str, workers: EngineWorkers) -> None:
        self._redis = redis
        self.model = model
        self.index = KvIndex(redis, model, workers)
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._missing: dict[str, float] = {}
        """Digests whose files were not found, and when: asked again after a while."""

    async def block_hashes(
        self, request: protocol.Request, workers: dict[str, protocol.Heartbeat]
    ) -> list[int] | None:
        """The request's full prompt blocks as the workers hash them (those a prefix cache
        can serve: never the last token's), or None where KV routing does not apply."""
        if request.lora is not None or not workers:
            return None
        beats = list(workers.values())
        if not all(beat.kv_events and beat.tokenizer_digest for beat in beats):
            return None
        self.index.start()
        if {beat.tokenizer_digest for beat in beats} != {beats[0].tokenizer_digest}:
            return None
        if {beat.block_size for beat in beats} != {beats[0].block_size}:
            return None
        if any(self.index.synced(w) is None for w in workers):
            return None
        tokenizer = await self._tokenizer(beats[0].tokenizer_digest)
        if tokenizer is None:
            return None
        size = len(request.prompt or "") + sum(len(m.content or "") for m in request.messages or [])
        if size > _INLINE_CHARS:
            ids = await asyncio.to_thread(tokenizer.prompt_token_ids, request)
        else:
            ids = tokenizer.prompt_token_ids(request)
        if ids is None:
            return None
        block_size = beats[0].block_size
        reusable = (len(ids) - 1) // block_size * block_size
        return compute_block_hashes(ids[:reusable], block_size)

    async def pick(
        self, hashes: list[int], workers: dict[str, protocol.Heartbeat], load: dict[str, int]
    ) -> str | None:
        """The worker to send the request to (None: the shared stream), by the caches as
        published up to now: the events since the follower's last read are read first (one
        round trip, in place of text affinity's lookup)."""
        try:
            await self.index.read_synced(block_ms=None)
        except (RedisError, OSError, TimeoutError):
            pass  # the follower finds Redis down too and unsyncs the indexes
        prefix = {}
        for worker in workers:
            index = self.index.synced(worker)
            prefix[worker] = index.blocks.prefix_blocks(hashes) if index is not None else 0
        return choose_worker(prefix, len(hashes), workers, load)

    async def _tokenizer(self, digest: str) -> PromptTokenizer | None:
        tokenizer = self._tokenizers.get(digest)
        if tokenizer is not None:
            return tokenizer
        if time.monotonic() - self._missing.get(digest, -_RETRY_TOKENIZER_S) < _RETRY_TOKENIZER_S:
            return None
        try:
            raw = await self._redis.get(redis_names.tokenizer_key(self.model, digest))
            files = kv_messages.decode_kv(raw) if raw is not None else None
        except (RedisError, OSError, TimeoutError, protocol.MalformedMessage) as exc:
            logger.warning("tokenizer %s of %s unreadable: %s", digest, self.model, exc)
            files = None
        if not isinstance(files, kv_messages.TokenizerFiles):
            self._missing[digest] = time.monotonic()
            return None
        tokenizer = await asyncio.to_thread(PromptTokenizer, files)
        self._tokenizers[digest] = tokenizer
        return tokenizer

    async def aclose(self) -> None:
        await self.index.aclose()
