"""Our engine workers as a provider: requests over Redis Streams, deltas back the same way.

A request is XADDed to the model's stream (read by the workers' consumer group) or, when a
live and not overloaded worker served the same prompt prefix recently, to that worker's own
stream. Deltas come back on this provider's reply stream (one reader for all its requests).
The provider never waits blindly: every request has a deadline, a first-token timeout, and a
watch on the heartbeat of the worker serving it. When the client goes away the worker is told
to abort (pub/sub) and a request nobody picked up yet is deleted from its stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from engine import protocol
from engine.redis_client import async_client
from gateway.canonical import ChatRequest, Chunk, Usage
from gateway.providers.base import ProviderError, unsupported_field
from gateway.providers.engine_replies import TRANSPORT_DOWN, ReplyReader
from gateway.providers.engine_wire import choice_delta, unsupported, wire_request
from gateway.providers.prefix_affinity import prefix_hashes, render_prompt
from gateway.settings import Settings

logger = logging.getLogger(__name__)

_REDIS_TIMEOUT_S = 2.0
_WORKERS_CACHE_S = 0.25
_AFFINITY_TTL_S = 600
_AFFINITY_SLACK = 4
"""How many more queued requests the prefix-holding worker may have than the least busy one."""
_LIVENESS_CHECK_S = 1.0
_LOST_MESSAGE = "The engine worker serving this request was lost."
_TRANSPORT_GRACE_S = 10.0
"""How long a stream that already showed text waits for Redis to come back."""

_ERRORS: dict[str, tuple[int, str]] = {
    "context_length_exceeded": (400, "context_length_exceeded"),
    "invalid_request": (400, "invalid_request"),
    "deadline_exceeded": (504, "timeout"),
    "worker_lost": (502, "worker_lost"),
    "overloaded": (503, "overloaded"),
    "internal_error": (500, "engine_error"),
}


def _binary_client(redis: Redis, settings: Settings) -> Redis:
    """Our messages are msgpack: use a client that does not decode replies to str."""
    kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {})
    if kwargs.get("decode_responses"):
        return async_client(settings.redis_url, socket_connect_timeout=_REDIS_TIMEOUT_S)
    return redis


class EngineProvider:
    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        model: str,
        *,
        name: str | None = None,
        prefix_affinity: bool = True,
    ) -> None:
        self.name = name or f"engine:{model}"
        self.model = model
        self.settings = settings
        self.prefix_affinity = prefix_affinity
        self._redis = _binary_client(redis, settings)
        self._owns_client = self._redis is not redis
        reply_id = f"gw-{settings.instance_id}-{uuid.uuid4().hex[:8]}"
        self._replies = ReplyReader(self._redis, protocol.reply_stream(reply_id))
        self._workers: dict[str, protocol.Heartbeat] = {}
        self._workers_at = -1.0
        self._workers_refresh: asyncio.Task[dict[str, protocol.Heartbeat]] | None = None
        self._outstanding: dict[str, int] = {}
        self._background: set[asyncio.Task[Any]] = set()

    # ---- workers ---------------------------------------------------------------------------

    async def live_workers(self) -> dict[str, protocol.Heartbeat]:
        """Heartbeats of this model's live workers (cached briefly; shared by concurrent calls)."""
        if time.monotonic() - self._workers_at < _WORKERS_CACHE_S:
            return self._workers
        if self._workers_refresh is None or self._workers_refresh.done():
            self._workers_refresh = asyncio.create_task(self._read_workers())
        return await asyncio.shield(self._workers_refresh)

    async def _read_workers(self) -> dict[str, protocol.Heartbeat]:
        async with asyncio.timeout(_REDIS_TIMEOUT_S):
            ids = [
                _text(m) for m in await self._redis.smembers(protocol.worker_registry(self.model))
            ]
            beats = (
                await self._redis.mget([protocol.heartbeat_key(self.model, w) for w in ids])
                if ids
                else []
            )
        workers: dict[str, protocol.Heartbeat] = {}
        for raw in beats:
            if raw is None:
                continue
            try:
                beat = protocol.decode(raw)
            except protocol.MalformedMessage:
                continue
            if isinstance(beat, protocol.Heartbeat) and not beat.draining:
                workers[beat.worker_id] = beat
        self._workers, self._workers_at = workers, time.monotonic()
        return workers

    async def queue_ms(self) -> float:
        """How long a new request would wait for its first step: the shortest queue among the
        live workers (a heartbeat's queue keeps ageing until the next one)."""
        try:
            workers = await self.live_workers()
        except (RedisError, OSError, TimeoutError):
            return 0.0
        now = time.time()
        return min(
            (
                beat.queue_ms + max(0.0, now - beat.time) * 1000 if beat.queue_ms else 0.0
                for beat in workers.values()
            ),
            default=0.0,
        )

    async def is_available(self) -> bool:
        try:
            return bool(await self.live_workers())
        except (RedisError, OSError, TimeoutError):
            return False

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        workers = await self._workers_or_503()
        refusal = self._no_thinking_mode(request, workers)
        if refusal is not None:
            raise refusal
        deadline = request.deadline or time.time() + self.settings.request_timeout_s
        message = wire_request(
            request, self.model, deadline, self._replies.stream, self._default_max_tokens(request)
        )
        rendered = render_prompt(message.messages, request.prompt)
        hashes = prefix_hashes(rendered) if self.prefix_affinity and len(workers) > 1 else []
        call = _Call(request.request_id, deadline, request.sampling.n)
        try:
            stream = await self._pick_stream(hashes, workers)
            while True:
                try:
                    async for chunk in self._attempt(call, message, stream):
                        if call.first_delta:
                            call.first_delta = False
                            self._on_served(call, hashes)
                        yield chunk
                    return
                except _WorkerLost as lost:
                    message = self._resumption(call, message, lost)
                    stream = protocol.request_stream(self.model)
        finally:
            if call.counted_on:
                self._outstanding[call.counted_on] -= 1

    async def count_tokens(self, request: ChatRequest) -> int:
        """The prompt's tokens as a worker renders it (its chat template, the tools), with
        nothing generated: a count-only request, answered by one final delta."""
        await self._workers_or_503()
        deadline = request.deadline or time.time() + self.settings.request_timeout_s
        message = wire_request(request, self.model, deadline, self._replies.stream, 1)
        message = msgspec.structs.replace(
            message,
            count_only=True,
            # What a worker from before count_only does instead: a one-token generation.
            sampling=protocol.Sampling(max_tokens=1),
            n=1,
            structured=None,
        )
        call = _Call(request.request_id, deadline)
        async for chunk in self._attempt(call, message, protocol.request_stream(self.model)):
            if chunk.usage is not None:
                return chunk.usage.prompt_tokens
        return call.prompt_tokens

    async def _attempt(
        self, call: _Call, message: protocol.Request, stream: str
    ) -> AsyncIterator[Chunk]:
        """One submission of the request (the first, or a resumption) and its relayed reply."""
        queue = self._replies.open(message.request_id)
        call.entry = None
        try:
            try:
                async with asyncio.timeout(_REDIS_TIMEOUT_S):
                    entry_id = await self._redis.xadd(
                        stream, {protocol.MESSAGE_FIELD: protocol.encode(message)}
                    )
            except (RedisError, OSError, TimeoutError) as exc:
                if call.attempts:
                    raise call.error(502, "worker_lost", _LOST_MESSAGE) from exc
                raise _redis_down(exc) from exc
            call.entry = (stream, entry_id)
            async for chunk in self._relay(call, queue):
                yield chunk
        finally:
            self._replies.close(message.request_id)
            if not call.finished and call.entry is not None:
                self._spawn(self._cancel(message.request_id, call.entry))

    def _resumption(
        self, call: _Call, message: protocol.Request, lost: _WorkerLost
    ) -> protocol.Request:
        """The request again, as a new attempt that continues after what was delivered; or
        the client's error when it cannot be resumed."""
        if (
            message.n > 1  # the choices' tokens interleave; one resume list cannot hold them
            or call.attempts >= protocol.MAX_RESUMES
            or call.delivered >= message.sampling.max_tokens
        ):
            raise call.error(502, "worker_lost", str(lost))
        call.attempts += 1
        call.start_attempt()
        logger.warning(
            "resuming %s after %d tokens (attempt %d): %s",
            call.request_id,
            call.delivered,
            call.attempts,
            lost,
        )
        return msgspec.structs.replace(
            message,
            request_id=protocol.attempt_id(call.request_id, call.attempts),
            resume_token_ids=list(call.token_ids),
        )

    def _default_max_tokens(self, request: ChatRequest) -> int:
        # OpenAI's default for text completions is 16; chat has no cap there, ours is a setting.
        return self.settings.default_max_tokens if request.messages is not None else 16

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        return unsupported(request) or self._no_thinking_mode(request, self._workers)

    def _no_thinking_mode(
        self, request: ChatRequest, workers: dict[str, protocol.Heartbeat]
    ) -> ProviderError | None:
        """Anthropic's ``thinking`` asks for the checkpoint's thinking mode: a 400 when the
        workers (as their heartbeats say) serve one without."""
        thinking = request.thinking
        if thinking is None or thinking.type == "disabled" or not workers:
            return None
        if any(beat.thinking for beat in workers.values()):
            return None
        return unsupported_field(
            "thinking", f"The model '{self.model}' has no thinking mode; leave out 'thinking'."
        )

    async def _workers_or_503(self) -> dict[str, protocol.Heartbeat]:
        try:
            workers = await self.live_workers()
        except (RedisError, OSError, TimeoutError) as exc:
            raise _redis_down(exc) from exc
        if not workers:
            raise ProviderError(
                f"No engine worker is serving model '{self.model}' right now.",
                retryable=True,
                status_code=503,
                code="no_worker_available",
            )
        return workers

    async def _relay(self, call: _Call, queue: asyncio.Queue[Any]) -> AsyncIterator[Chunk]:
        taken_by = time.monotonic() + (
            self.settings.resume_timeout_s if call.attempts else self.settings.first_token_timeout_s
        )
        quiet_since = time.monotonic()
        while True:
            now = time.monotonic()
            left = call.deadline - time.time()
            if left <= 0:
                raise call.error(504, "timeout", "The request exceeded its deadline.")
            if not call.attempt_shown and now > taken_by:
                if call.attempts:
                    raise call.error(
                        502,
                        "worker_lost",
                        "The engine worker serving this request was lost and no other worker "
                        f"took it over within {self.settings.resume_timeout_s:g}s.",
                    )
                raise call.error(504, "timeout", "No engine worker started the request in time.")
            if queue.empty():
                # Arm a timer only when there is nothing to relay yet: while tokens flow, the
                # queue is rarely empty and a per-token timeout would be most of our cost.
                try:
                    async with asyncio.timeout(min(left, _LIVENESS_CHECK_S)):
                        item = await queue.get()
                except TimeoutError:
                    await self._check_liveness(call, time.monotonic() - quiet_since)
                    continue
                quiet_since = time.monotonic()
            else:
                item = queue.get_nowait()
                quiet_since = now
            if item is TRANSPORT_DOWN:
                self._transport_down(call)
                continue
            call.transport_down_since = None
            if isinstance(item, protocol.Error):
                if item.code == "worker_lost" and call.shown:
                    raise _WorkerLost(item.message)
                status, code = _ERRORS.get(item.code, (502, "engine_error"))
                raise call.error(status, code, item.message, retryable=item.code == "overloaded")
            if not isinstance(item, protocol.Delta):
                continue
            chunk = call.accept(item)
            if chunk is not None:
                yield chunk
                if call.finished:
                    return

    async def _check_liveness(self, call: _Call, quiet_s: float) -> None:
        """Fail a request whose worker died; the workers' own claim gives them a head start."""
        grace = 2 * self.settings.worker_heartbeat_ttl_s
        if quiet_s < grace:
            return
        try:
            workers = await self.live_workers()
            if not call.attempt_shown and call.entry is not None:
                await self._check_queued(call)
        except (RedisError, OSError, TimeoutError):
            self._transport_down(call)
            return
        if call.attempt_shown and call.worker_id not in workers:
            raise _WorkerLost(_LOST_MESSAGE)
        if not call.shown and not workers:
            raise call.error(
                503,
                "no_worker_available",
                f"No engine worker is serving model '{self.model}' right now.",
            )

    def _transport_down(self, call: _Call) -> None:
        """Redis is unreachable. A stream already showing text waits a while for it (the worker
        keeps generating and retries its writes, so nothing is lost when Redis returns); one
        that showed nothing fails at once, and can be retried elsewhere."""
        now = time.monotonic()
        if call.transport_down_since is None:
            call.transport_down_since = now
        if not call.shown or now - call.transport_down_since > _TRANSPORT_GRACE_S:
            raise call.error(503, "service_unavailable", "Lost the connection to Redis.")

    async def _check_queued(self, call: _Call) -> None:
        """A request no worker answered yet must still be in its stream (workers delete an
        entry only once its request ended); gone means Redis restarted empty: submit again."""
        assert call.entry is not None
        stream, entry_id = call.entry
        async with asyncio.timeout(_REDIS_TIMEOUT_S):
            entries = await self._redis.xrange(stream, entry_id, entry_id)
        if not entries:
            raise _WorkerLost("The queued request was lost (Redis restarted); submitted again.")

    async def _pick_stream(self, hashes: list[int], workers: dict[str, protocol.Heartbeat]) -> str:
        shared = protocol.request_stream(self.model)
        if not hashes:
            return shared
        try:
            async with asyncio.timeout(_REDIS_TIMEOUT_S):
                owners = await self._redis.mget(
                    [protocol.affinity_key(self.model, h) for h in hashes]
                )
        except (RedisError, OSError, TimeoutError) as exc:
            raise _redis_down(exc) from exc
        load = {w: beat.num_waiting + self._outstanding.get(w, 0) for w, beat in workers.items()}
        least = min(load.values())
        for owner in reversed(owners):
            if owner is None:
                continue
            worker = _text(owner)
            beat = workers.get(worker)
            if beat is None or beat.kv_usage > 0.95:
                continue
            if load[worker] <= least + _AFFINITY_SLACK:
                return protocol.worker_stream(self.model, worker)
            break
        return shared

    def _on_served(self, call: _Call, hashes: list[int]) -> None:
        worker = call.worker_id or ""
        call.counted_on = worker
        self._outstanding[worker] = self._outstanding.get(worker, 0) + 1
        if hashes and worker:
            self._spawn(self._remember_prefix(hashes, worker))

    async def _remember_prefix(self, hashes: list[int], worker: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.set(protocol.affinity_key(self.model, h), worker, ex=_AFFINITY_TTL_S)
        try:
            async with asyncio.timeout(_REDIS_TIMEOUT_S):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError):
            pass

    async def _cancel(self, request_id: str, entry: tuple[str, Any]) -> None:
        """Abort on the worker (if it has it) and unqueue it (if nobody has it yet)."""
        stream, entry_id = entry
        pipe = self._redis.pipeline(transaction=False)
        pipe.publish(
            protocol.cancel_channel(self.model), protocol.encode(protocol.Cancel(request_id))
        )
        pipe.xdel(stream, entry_id)
        try:
            async with asyncio.timeout(_REDIS_TIMEOUT_S):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning("could not cancel %s: %s", request_id, exc)

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await self._replies.aclose()
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        if self._owns_client:
            await self._redis.aclose()


class _Call:
    """One request's progress: who serves it, what reached the client, how to bill a failure."""

    def __init__(self, request_id: str, deadline: float, choices: int = 1) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.choices = choices
        self.ended: set[int] = set()
        """Choices that have their final delta; the request is over when all have."""
        self.entry: tuple[str, Any] | None = None
        self.worker_id: str | None = None
        self.counted_on = ""
        """The worker whose outstanding count includes this request."""
        self.first_delta = True
        self.next_seq = 0
        self.prompt_tokens = 0
        self.delivered = 0
        self.unshown = 0
        self.shown = False
        self.finished = False
        self.token_ids: list[int] = []
        """Every token received, in order: what a resumption continues after."""
        self.attempts = 0
        """Resumptions so far (each one a new engine request id)."""
        self.attempt_shown = False
        self.transport_down_since: float | None = None
        self._base = (0, 0)
        """(delivered, unshown) when the current attempt began."""

    def start_attempt(self) -> None:
        self.worker_id = None
        self.next_seq = 0
        self.attempt_shown = False
        self._base = (self.delivered, self.unshown)

    def accept(self, delta: protocol.Delta) -> Chunk | None:
        if delta.worker_id != self.worker_id:
            if self.attempt_shown:
                return None  # a second worker took over a request the first was still serving
            # Nothing of this attempt was shown yet, so another worker may take it over.
            self.worker_id = delta.worker_id
            self.next_seq = 0
            self.delivered, self.unshown = self._base
            self.ended.clear()
            del self.token_ids[self.delivered :]
        if delta.seq < self.next_seq:
            return None
        if delta.seq > self.next_seq:
            raise self.error(502, "worker_lost", "Part of the engine's reply was lost.")
        self.next_seq += 1
        if delta.usage is not None:
            self.prompt_tokens = delta.usage.prompt_tokens
        self.delivered += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)
        # A token whose text the detokenizer holds back (part of a UTF-8 character) travels
        # with the next chunk that has text, so counting chunks' tokens counts what was shown.
        self.unshown += len(delta.token_ids)
        usage = None
        if delta.finish_reason is not None:
            self.ended.add(delta.index)
            self.finished = len(self.ended) >= self.choices
            cached = delta.usage.cached_tokens if delta.usage else 0
            usage = Usage(self.prompt_tokens, self.delivered, cached)
        elif not (delta.text or delta.reasoning_text or delta.tool_calls or delta.logprobs):
            return None
        self.shown = self.attempt_shown = True
        chunk = Chunk(
            [choice_delta(delta)],
            usage=usage,
            num_tokens=self.unshown,
            prompt_tokens=self.prompt_tokens,
        )
        self.unshown = 0
        return chunk

    def error(self, status: int, code: str, message: str, retryable: bool = False) -> ProviderError:
        self.finished = code not in {"timeout", "service_unavailable", "no_worker_available"}
        return ProviderError(
            message,
            retryable=retryable or (not self.shown and status in {503, 504}),
            status_code=status,
            code=code,
            usage=Usage(self.prompt_tokens, self.delivered - self.unshown),
        )


class _WorkerLost(Exception):
    """The worker serving an attempt that had streamed text is gone: resume elsewhere."""


def _redis_down(exc: BaseException) -> ProviderError:
    return ProviderError(
        f"The engine transport (Redis) is unavailable: {exc or type(exc).__name__}",
        retryable=True,
        status_code=503,
        code="service_unavailable",
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)
