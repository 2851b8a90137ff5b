"""``sluicegate engine``: one ``AsyncEngine`` fed from Redis Streams.

The worker is a consumer in the model's consumer group. It pulls only while the engine has
room (``can_accept``), so load spreads by capacity and a busy worker never hoards requests.
Deltas go to each request's reply stream in one pipelined round trip per batch; a request is
acknowledged when it finishes. Every second it publishes a heartbeat and re-claims its own
in-flight entries (resetting their idle time), so entries idle for longer than a few seconds
belong to a dead worker: any worker may take them over with XAUTOCLAIM. A taken-over request
that had not streamed a token yet is served again from scratch; one that had ends with a
``worker_lost`` error, upon which the gateway resubmits it with the tokens already streamed
(``Request.resume_token_ids``) so its client's stream goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import inspect
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from engine import protocol
from engine.metrics import HealthServer, WorkerMetrics
from engine.redis_client import async_client, pubsub_client
from engine.tracing import RequestTracer
from engine.worker_liveness import LivenessThread

logger = logging.getLogger("sluicegate.worker")

WORKER_VERSION = "0.1.0"
_REPLY_TTL_S = 120
_REPLY_MAXLEN = 100_000
_STARTED_TTL_S = 3600
_PRODUCED_EVERY_S = 0.5
_PRODUCED_TTL_S = 600


@dataclass
class WorkerOptions:
    model_name: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    claim_idle_s: float = 3.0
    """An entry nobody re-claimed for this long belongs to a dead worker."""
    max_pull: int = 16
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may run before they are handed back."""


@dataclass
class _InFlight:
    request: protocol.Request
    stream: str
    entry_id: bytes
    pulled_at: float
    task: asyncio.Task[None] | None = None
    seq: int = 0
    started: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_delta_at: float = 0.0
    produced_at: float = 0.0


@dataclass
class _Write:
    """One reply to publish; ``ack`` marks the request's entry done once it is written."""

    reply_to: str
    message: protocol.Delta | protocol.Error | None
    batchable: bool = False
    """The request's gateway reads ``Batch`` entries (protocol version 2 and later)."""
    started_key: str | None = None
    ack: tuple[str, bytes] | None = None


def _queue_ms(oldest_arrival: float | None) -> float:
    """Milliseconds the head of the engine's queue has waited (0 with no queue)."""
    if oldest_arrival is None:
        return 0.0
    return max(0.0, (time.monotonic() - oldest_arrival) * 1000)


class Worker:
    def __init__(
        self,
        engine: Any,
        redis: aioredis.Redis,
        options: WorkerOptions,
        metrics: WorkerMetrics | None = None,
        pubsub_redis: aioredis.Redis | None = None,
    ) -> None:
        self.engine = engine
        self.redis = redis
        self.pubsub_redis = pubsub_redis or redis
        """Where cancellations are subscribed to (one node of a cluster: ``pubsub_client``)."""
        self.options = options
        self.metrics = metrics or WorkerMetrics(options.model_name)
        self.tracer = RequestTracer(options.model_name, options.worker_id)
        model = options.model_name
        self.shared_stream = protocol.request_stream(model)
        self.own_stream = protocol.worker_stream(model, options.worker_id)
        self.in_flight: dict[str, _InFlight] = {}
        self._recent_cancels: dict[str, float] = {}
        self._writes: asyncio.Queue[_Write] = asyncio.Queue()
        self._room = asyncio.Event()
        self._draining = False
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._tokens_per_second: collections.Counter[int] = collections.Counter()
        """Generated tokens by whole second, for the heartbeat's tokens/s over the last 5 s."""
        self._expired_at: dict[str, float] = {}
        """When each reply stream's TTL was last refreshed."""
        self._unacked: dict[tuple[str, bytes], None] = {}
        """Entries answered (or dropped) whose XACK is not written yet: still vouched for, or
        another worker would take over a request this one already answered."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._produced: dict[str, dict[str, Any]] = {}
        """Produced-token records due to be written (``protocol.produced_key``)."""
        self.liveness = LivenessThread(
            options.redis_url,
            model,
            options.worker_id,
            self._in_flight_entries,
            self._entries_taken_over,
            interval_s=options.heartbeat_interval_s,
            ttl_s=options.heartbeat_ttl_s,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        await self._ensure_groups()
        await self._heartbeat_once()
        self.liveness.beat()
        self.liveness.start()
        self._tasks = [
            asyncio.create_task(self._pull_loop(), name="pull"),
            asyncio.create_task(self._claim_loop(), name="claim"),
            asyncio.create_task(self._heartbeat_loop(), name="heartbeat"),
            asyncio.create_task(self._cancel_listener(), name="cancels"),
            asyncio.create_task(self._write_loop(), name="writes"),
        ]
        await stop.wait()
        await self._drain()

    async def _drain(self) -> None:
        """Stop pulling, let in-flight requests finish (bounded), hand back the rest."""
        self._draining = True
        for task in self._tasks:
            if task.get_name() in {"pull", "claim"}:
                task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.options.drain_timeout_s):
                while self.in_flight:
                    self._room.clear()
                    await self._room.wait()
        if self.in_flight:
            logger.warning(
                "drain timeout (%gs) passed with %d requests in flight; handing them back",
                self.options.drain_timeout_s,
                len(self.in_flight),
            )
        for item in list(self.in_flight.values()):
            # Unstarted requests are simply not acknowledged: another worker claims them once
            # their idle time passes. Started ones cannot move; their client gets an error.
            with contextlib.suppress(Exception):
                self.engine.abort(item.request.request_id)
            if item.started:
                self._fail(item, "worker_lost", "The engine worker shut down mid-generation.")
            if item.task is not None:
                item.task.cancel()
        self.in_flight.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self._writes.join()
        self._stopped.set()
        for task in self._tasks:
            task.cancel()
        # Bounded: a Redis connection torn down mid-command must not keep us from exiting.
        await asyncio.wait(self._tasks, timeout=2.0)
        await asyncio.to_thread(self.liveness.stop)

    async def _ensure_groups(self) -> None:
        for stream in (self.shared_stream, self.own_stream):
            try:
                await self.redis.xgroup_create(
                    stream, protocol.REQUEST_GROUP, id="0", mkstream=True
                )
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # ---- pulling ---------------------------------------------------------------------------

    def _room_for(self) -> int:
        """How many requests to pull now: none unless the engine says it has room, and no
        more than its admission queue takes, so a busy worker leaves work to the others."""
        if self._draining or not self.engine.can_accept():
            return 0
        limit = getattr(self.engine, "accept_limit", None)
        if limit is None:
            return self.options.max_pull
        stats = self.engine.stats()
        queued = int(stats.get("num_waiting", 0) or 0) + int(stats.get("num_pending", 0) or 0)
        return max(1, min(self.options.max_pull, limit - queued))

    async def _pull_loop(self) -> None:
        backoff = _Backoff()
        while True:
            count = self._room_for()
            if count == 0:
                # Woken after every engine step (deltas) and every finished request, when
                # the engine may have admitted what waited; the timeout covers steps that
                # produce no delta (a long prefill in chunks).
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), 0.02)
                continue
            try:
                reply = await self.redis.xreadgroup(
                    protocol.REQUEST_GROUP,
                    self.options.worker_id,
                    {self.shared_stream: ">", self.own_stream: ">"},
                    count=count,
                    block=500,
                )
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # Redis lost its data (restart without persistence): start over.
                    await self._recreate_groups(backoff)
                    continue
                raise
            except (RedisError, OSError) as exc:
                await backoff.wait("pull", exc)
                continue
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    await self._admit(_text(stream), entry_id, fields, claimed=False)

    async def _recreate_groups(self, backoff: _Backoff) -> None:
        try:
            await self._ensure_groups()
        except (RedisError, OSError) as exc:
            await backoff.wait("recreate groups", exc)

    async def _claim_loop(self) -> None:
        backoff = _Backoff()
        while True:
            await asyncio.sleep(self.options.heartbeat_interval_s)
            try:
                await self._claim_dead_workers_entries()
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    logger.exception("claim failed")
                await self._recreate_groups(backoff)
            except (RedisError, OSError) as exc:
                await backoff.wait("claim", exc)

    async def _claim_dead_workers_entries(self) -> None:
        min_idle_ms = int(self.options.claim_idle_s * 1000)
        if self._draining:
            return
        # Even a full worker takes one a second: a dead worker's requests must not wait for
        # room that may never come, and those that had streamed only need an error reply.
        count = max(1, self._room_for())
        streams = [self.shared_stream, *await self._dead_worker_streams()]
        for stream in streams:
            reply = await self.redis.xautoclaim(
                stream,
                protocol.REQUEST_GROUP,
                self.options.worker_id,
                min_idle_time=min_idle_ms,
                start_id="0-0",
                count=count,
            )
            for entry_id, fields in reply[1] if len(reply) > 1 else []:
                if fields is None:
                    await self.redis.xack(stream, protocol.REQUEST_GROUP, entry_id)
                    continue
                await self._admit(stream, entry_id, fields, claimed=True)
            if stream != self.shared_stream:
                await self._take_unread_entries(stream, count)

    async def _dead_worker_streams(self) -> list[str]:
        model = self.options.model_name
        registry = protocol.worker_registry(model)
        members = [_text(m) for m in await self.redis.smembers(registry)]
        others = [m for m in members if m != self.options.worker_id]
        if not others:
            return []
        alive = await self.redis.mget([protocol.heartbeat_key(model, m) for m in others])
        return [
            protocol.worker_stream(model, wid)
            for wid, beat in zip(others, alive, strict=True)
            if beat is None
        ]

    async def _take_unread_entries(self, stream: str, count: int) -> None:
        """Serve what was routed to a dead worker but never read; forget its stream once empty."""
        try:
            reply = await self.redis.xreadgroup(
                protocol.REQUEST_GROUP, self.options.worker_id, {stream: ">"}, count=count
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            reply = []
        entries = [e for _, batch in reply or [] for e in batch]
        for entry_id, fields in entries:
            await self._admit(stream, entry_id, fields, claimed=True)
        if entries:
            return
        pending = await self._pending_count(stream)
        if pending == 0 and await self.redis.xlen(stream) == 0:
            dead = stream.rsplit(":w:", 1)[1]
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(stream)
            pipe.srem(protocol.worker_registry(self.options.model_name), dead)
            await pipe.execute()

    async def _pending_count(self, stream: str) -> int:
        try:
            summary = await self.redis.xpending(stream, protocol.REQUEST_GROUP)
        except ResponseError:
            return 0
        return int(summary.get("pending", 0) if isinstance(summary, dict) else summary[0])

    # ---- serving ---------------------------------------------------------------------------

    async def _admit(self, stream: str, entry_id: bytes, fields: Any, *, claimed: bool) -> None:
        raw = _field(fields, protocol.MESSAGE_FIELD)
        try:
            if raw is None:
                raise protocol.MalformedMessage("entry has no 'm' field")
            message = protocol.decode(raw)
            if not isinstance(message, protocol.Request):
                raise protocol.MalformedMessage(f"expected a request, got {type(message).__name__}")
        except protocol.MalformedMessage as exc:
            logger.warning("dropping malformed entry %s on %s: %s", entry_id, stream, exc)
            self._ack_now(stream, entry_id)
            return
        rid = message.request_id
        if rid in self.in_flight:
            if (self.in_flight[rid].stream, self.in_flight[rid].entry_id) != (stream, entry_id):
                # A second entry of a request already being served here (a gateway's retried
                # XADD): acknowledged unserved, or another worker would later take it over
                # and fail the live stream with worker_lost.
                logger.warning("dropping duplicate entry %s of request %s", entry_id, rid)
                self._ack_now(stream, entry_id)
            return
        item = _InFlight(message, stream, entry_id, time.monotonic())
        if rid in self._recent_cancels:
            self._ack_now(stream, entry_id)
            return
        if claimed:
            logger.info("took over request %s (entry %s on %s)", rid, entry_id, stream)
        if claimed and await self._already_started(message):
            self._fail(item, "worker_lost", "The engine worker serving this request was lost.")
            return
        if message.expired():
            self._fail(item, "deadline_exceeded", "The request's deadline passed before it ran.")
            return
        self.in_flight[rid] = item
        item.task = asyncio.create_task(self._serve(item), name=f"serve-{rid}")

    async def _already_started(self, request: protocol.Request) -> bool:
        key = protocol.started_key(self.options.model_name, request.request_id)
        return bool(await self.redis.exists(key))

    async def _serve(self, item: _InFlight) -> None:
        request = item.request
        rid = request.request_id
        try:
            outputs = await self._start_request(request)
            async for output in outputs:
                self._publish_delta(item, output)
                if request.expired():
                    self.engine.abort(rid)
                    self._fail(item, "deadline_exceeded", "The request's deadline passed.")
                    return
            if rid in self.in_flight:
                # The engine ended the request without a final delta (e.g. aborted).
                self._finish(item, None)
        except asyncio.CancelledError:
            raise
        except ValueError as exc:
            self._fail(item, _rejection_code(exc), str(exc))
        except Exception as exc:
            logger.exception("request %s failed", rid)
            self._fail(item, "internal_error", f"The engine failed: {type(exc).__name__}: {exc}")
        finally:
            self.in_flight.pop(rid, None)
            self._room.set()

    async def _start_request(self, request: protocol.Request) -> AsyncIterator[Any]:
        from engine.request_options import RequestOptions
        from engine.sampling import SamplingParams

        params = SamplingParams(**msgspec.structs.asdict(request.sampling))
        options = RequestOptions(
            n=request.n,
            tools=request.tools,
            tool_choice=request.tool_choice,
            tool_choice_name=request.tool_choice_name,
            parallel_tool_calls=request.parallel_tool_calls,
            structured=request.structured,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        kwargs: dict[str, Any] = {"params": params, "options": options}
        if request.messages is not None:
            kwargs["messages"] = msgspec.to_builtins(request.messages)
        elif request.prompt_token_ids is not None:
            kwargs["prompt_token_ids"] = request.prompt_token_ids
        elif request.prompt is not None:
            kwargs["prompt"] = request.prompt
        else:
            raise ValueError("request has no prompt, prompt_token_ids or messages")
        if request.resume_token_ids:
            kwargs["resume_token_ids"] = request.resume_token_ids
        outputs = self.engine.add_request(request.request_id, **kwargs)
        if inspect.isawaitable(outputs):
            outputs = await outputs
        return outputs

    def _publish_delta(self, item: _InFlight, output: Any) -> None:
        self._room.set()
        now = time.monotonic()
        token_ids = list(getattr(output, "token_ids", None) or [])
        finish_reason = getattr(output, "finish_reason", None)
        item.prompt_tokens = _prompt_tokens(output, item.prompt_tokens)
        item.completion_tokens += len(token_ids)
        if finish_reason is not None or now - item.produced_at >= _PRODUCED_EVERY_S:
            item.produced_at = now
            self._note_produced(item, done=finish_reason is not None)
        if token_ids:
            self.metrics.generation_tokens.inc(len(token_ids))
            self._tokens_per_second[int(now)] += len(token_ids)
            if item.last_delta_at:
                self.metrics.inter_token_latency.observe(now - item.last_delta_at)
            else:
                self.metrics.time_to_first_token.observe(now - item.pulled_at)
            item.last_delta_at = now
        text = getattr(output, "text", "") or ""
        reasoning_text = getattr(output, "reasoning_text", "") or ""
        tool_calls = list(getattr(output, "tool_calls", None) or [])
        if finish_reason is None and not (token_ids or text or reasoning_text or tool_calls):
            return
        logprobs = getattr(output, "logprobs", None)
        wire_logprobs = self.engine.wire_logprobs(logprobs) if logprobs else []
        usage = None
        if item.seq == 0 or finish_reason is not None:
            usage = protocol.Usage(
                prompt_tokens=item.prompt_tokens,
                completion_tokens=item.completion_tokens,
                cached_tokens=_cached_tokens(output),
            )
        delta = protocol.Delta(
            request_id=item.request.request_id,
            seq=item.seq,
            text=text,
            token_ids=token_ids,
            finish_reason=finish_reason,
            usage=usage,
            worker_id=self.options.worker_id,
            index=getattr(output, "index", 0),
            reasoning_text=reasoning_text,
            tool_calls=tool_calls,
            logprobs=wire_logprobs,
            stop_sequence=getattr(output, "stop_sequence", None),
        )
        item.seq += 1
        # "Started" means the client may have been shown text: from then on the request
        # cannot move to another worker. Tokens without text yet are invisible to the client.
        started = None
        if not item.started and (text or reasoning_text or tool_calls or finish_reason):
            item.started = True
            started = protocol.started_key(self.options.model_name, item.request.request_id)
        if getattr(output, "done", finish_reason is not None):
            self.tracer.request_finished(item.request, item.pulled_at, output)
            self._finish(item, delta, started)
        else:
            self._writes.put_nowait(
                _Write(item.request.reply_key(), delta, _batchable(item), started)
            )

    def _finish(
        self, item: _InFlight, delta: protocol.Delta | None, started: str | None = None
    ) -> None:
        self.in_flight.pop(item.request.request_id, None)
        self.metrics.prompt_tokens.inc(item.prompt_tokens)
        self.metrics.e2e_request_latency.observe(time.monotonic() - item.pulled_at)
        self._unacked[(item.stream, item.entry_id)] = None
        self._writes.put_nowait(
            _Write(
                item.request.reply_key(),
                delta,
                _batchable(item),
                started,
                (item.stream, item.entry_id),
            )
        )

    def _note_produced(self, item: _InFlight, *, done: bool) -> None:
        resumed = len(item.request.resume_token_ids or ())
        self._produced[item.request.request_id] = {
            "p": item.prompt_tokens,
            "n": resumed + item.completion_tokens,
            "m": self.options.model_name,
            "d": int(done),
        }

    def _fail(self, item: _InFlight, code: protocol.ErrorCode, message: str) -> None:
        self.in_flight.pop(item.request.request_id, None)
        if item.completion_tokens:
            self._note_produced(item, done=True)
        error = protocol.Error(
            request_id=item.request.request_id,
            code=code,
            message=message,
            usage=protocol.Usage(item.prompt_tokens, item.completion_tokens),
            worker_id=self.options.worker_id,
        )
        self._unacked[(item.stream, item.entry_id)] = None
        self._writes.put_nowait(
            _Write(
                item.request.reply_key(),
                error,
                _batchable(item),
                None,
                (item.stream, item.entry_id),
            )
        )

    def _ack_now(self, stream: str, entry_id: bytes) -> None:
        self._unacked[(stream, entry_id)] = None
        self._writes.put_nowait(_Write("", None, False, None, (stream, entry_id)))

    # ---- writing ---------------------------------------------------------------------------

    async def _write_loop(self) -> None:
        """Publish every queued reply in one pipelined round trip per batch."""
        backoff = _Backoff()
        while True:
            batch = [await self._writes.get()]
            while not self._writes.empty():
                batch.append(self._writes.get_nowait())
            while True:
                try:
                    await self._write_batch(batch)
                    backoff.reset()
                    break
                except (RedisError, OSError) as exc:
                    await backoff.wait("write", exc)
            for _ in batch:
                self._writes.task_done()

    async def _write_batch(self, batch: list[_Write]) -> None:
        now = time.monotonic()
        if len(self._expired_at) > 10_000:
            self._expired_at = {k: t for k, t in self._expired_at.items() if now - t < _REPLY_TTL_S}
        pipe = self.redis.pipeline(transaction=False)
        refreshed: list[str] = []
        replies: dict[str, list[_Write]] = {}
        for write in batch:
            if write.started_key:
                pipe.set(write.started_key, self.options.worker_id, ex=_STARTED_TTL_S)
            if write.message is not None:
                replies.setdefault(write.reply_to, []).append(write)
        for reply_to, writes in replies.items():
            if len(writes) > 1 and all(w.batchable for w in writes):
                payloads = [protocol.encode(protocol.Batch([w.message for w in writes]))]  # type: ignore[misc]
            else:
                payloads = [protocol.encode(w.message) for w in writes]  # type: ignore[arg-type]
            for payload in payloads:
                pipe.xadd(
                    reply_to,
                    {protocol.MESSAGE_FIELD: payload},
                    maxlen=_REPLY_MAXLEN,
                    approximate=True,
                )
            if now - self._expired_at.get(reply_to, 0.0) > _REPLY_TTL_S / 10:
                pipe.expire(reply_to, _REPLY_TTL_S)
                refreshed.append(reply_to)
        produced, self._produced = self._produced, {}
        for request_id, record in produced.items():
            pipe.hset(protocol.produced_key(request_id), mapping=record)
            pipe.expire(protocol.produced_key(request_id), _PRODUCED_TTL_S)
        for write in batch:
            if write.ack:
                stream, entry_id = write.ack
                pipe.xack(stream, protocol.REQUEST_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
        try:
            await pipe.execute()
        except (RedisError, OSError):
            self._produced = {**produced, **self._produced}  # newer records win
            raise
        for write in batch:
            if write.ack:
                self._unacked.pop(write.ack, None)
        for reply_to in refreshed:
            self._expired_at[reply_to] = now

    # ---- cancellation ----------------------------------------------------------------------

    async def _cancel_listener(self) -> None:
        backoff = _Backoff()
        channel = protocol.cancel_channel(self.options.model_name)
        while True:
            pubsub = self.pubsub_redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                backoff.reset()
                async for message in pubsub.listen():
                    self._on_cancel(message.get("data"))
            except (RedisError, OSError) as exc:
                await backoff.wait("cancel subscription", exc)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()

    def _on_cancel(self, data: Any) -> None:
        if not isinstance(data, bytes | bytearray):
            return
        try:
            message = protocol.decode(bytes(data))
        except protocol.MalformedMessage as exc:
            logger.warning("ignoring malformed cancel: %s", exc)
            return
        if not isinstance(message, protocol.Cancel):
            return
        rid = message.request_id
        item = self.in_flight.get(rid)
        if item is None:
            now = time.monotonic()
            self._recent_cancels[rid] = now
            if len(self._recent_cancels) > 10_000:
                cutoff = now - 120
                self._recent_cancels = {k: t for k, t in self._recent_cancels.items() if t > cutoff}
            return
        self.engine.abort(rid)

    # ---- heartbeats ------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.options.heartbeat_interval_s
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(interval)
            late = time.monotonic() - slept_from - interval
            if late > interval:
                logger.warning("the event loop was blocked for %.1fs", late)
            try:
                await self._heartbeat_once()
            except Exception:
                logger.exception("heartbeat snapshot failed")

    def heartbeat(self) -> protocol.Heartbeat:
        stats = dict(self.engine.stats())
        self.metrics.observe_engine_stats(stats)
        total = int(stats.get("kv_blocks_total", 0) or 0)
        used = int(stats.get("kv_blocks_used", 0) or 0)
        now = time.monotonic()
        recent = int(now) - 5
        for second in [s for s in self._tokens_per_second if s < recent]:
            del self._tokens_per_second[second]
        tokens = sum(self._tokens_per_second.values())
        return protocol.Heartbeat(
            worker_id=self.options.worker_id,
            model=self.options.model_name,
            served_model_name=self.options.model_name,
            version=WORKER_VERSION,
            time=time.time(),
            num_running=int(stats.get("num_running", 0) or 0),
            num_waiting=int(stats.get("num_waiting", 0) or 0),
            kv_blocks_total=total,
            kv_blocks_used=used,
            kv_usage=used / total if total else 0.0,
            tokens_per_s=tokens / 5.0,
            max_model_len=int(stats.get("max_model_len", 0) or 0),
            block_size=int(stats.get("kv_block_size", 16) or 16),
            draining=self._draining,
            queue_ms=_queue_ms(stats.get("oldest_waiting_arrival")),
            thinking=bool(stats.get("thinking")),
        )

    async def _heartbeat_once(self) -> None:
        """Hand a fresh snapshot to the liveness thread, which keeps it in Redis."""
        self.liveness.publish(self.heartbeat())

    def _in_flight_entries(self) -> list[tuple[str, bytes]]:
        # Called from the liveness thread: list() copies atomically under the GIL.
        serving = [(item.stream, item.entry_id) for item in list(self.in_flight.values())]
        return serving + list(self._unacked)

    def _entries_taken_over(self, stream: str, entry_ids: list[bytes]) -> None:
        """From the liveness thread: another worker owns these entries now."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_serving, stream, set(entry_ids))

    def _stop_serving(self, stream: str, entry_ids: set[bytes]) -> None:
        """Stop, silently, the requests another worker took over: it answers them now (as a
        resumption when text was already shown), and two writers would garble the stream."""
        for item in list(self.in_flight.values()):
            if item.stream == stream and item.entry_id in entry_ids:
                rid = item.request.request_id
                logger.warning("request %s was taken over by another worker; stopping it", rid)
                self.in_flight.pop(rid, None)
                with contextlib.suppress(Exception):
                    self.engine.abort(rid)
                if item.task is not None:
                    item.task.cancel()


class _Backoff:
    """Exponential reconnect delay (0.05 s doubling to 2 s), logged once per outage."""

    def __init__(self) -> None:
        self.delay = 0.0

    def reset(self) -> None:
        if self.delay:
            logger.info("redis is reachable again")
        self.delay = 0.0

    async def wait(self, what: str, exc: BaseException) -> None:
        if not self.delay:
            logger.warning("%s: redis unavailable (%s); retrying with backoff", what, exc)
        self.delay = min(2.0, max(0.05, self.delay * 2))
        await asyncio.sleep(self.delay)


def _batchable(item: _InFlight) -> bool:
    return item.request.v >= protocol.BATCH_VERSION


def _log_tasks() -> None:
    """SIGUSR1: log where every asyncio task of the worker is waiting (for a stuck worker)."""
    import io

    for task in asyncio.all_tasks():
        out = io.StringIO()
        task.print_stack(limit=6, file=out)
        logger.warning("task %s:\n%s", task.get_name(), out.getvalue())


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)


def _field(fields: Any, name: bytes) -> bytes | None:
    if not isinstance(fields, dict):
        return None
    value = fields.get(name)
    if value is None:
        value = fields.get(name.decode())
    if isinstance(value, str):
        return value.encode("latin-1", errors="replace")
    return value


def _prompt_tokens(output: Any, known: int) -> int:
    usage = getattr(output, "usage", None)
    if usage is not None and getattr(usage, "prompt_tokens", 0):
        return int(usage.prompt_tokens)
    for name in ("num_prompt_tokens", "prompt_tokens"):
        value = getattr(output, name, None)
        if isinstance(value, int) and value > 0:
            return value
    ids = getattr(output, "prompt_token_ids", None)
    return len(ids) if ids else known


def _cached_tokens(output: Any) -> int:
    usage = getattr(output, "usage", None)
    if usage is not None:
        return int(getattr(usage, "cached_tokens", 0) or 0)
    return int(getattr(output, "num_cached_tokens", 0) or 0)


def _rejection_code(exc: ValueError) -> protocol.ErrorCode:
    text = str(exc).lower()
    if "max_model_len" in text or "context" in text or "too long" in text or "exceed" in text:
        return "context_length_exceeded"
    return "invalid_request"


# ---- command line ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluicegate engine", description="run an engine worker fed over Redis Streams"
    )
    parser.add_argument("--model", required=True, help="local Hugging Face model folder")
    parser.add_argument("--served-model-name", help="model name clients use (default: folder name)")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLUICEGATE_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    parser.add_argument("--worker-id", help="consumer name in the group (default: host-pid)")
    parser.add_argument("--metrics-port", type=int, default=9100, help="0 picks a free port")
    parser.add_argument("--metrics-host", default="0.0.0.0")
    parser.add_argument("--heartbeat-ttl", type=float, default=3.0)
    parser.add_argument("--claim-idle", type=float, default=3.0)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--max-pull", type=int, default=16)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--block-size", type=int)
    engine.add_argument("--num-kv-blocks", type=int)
    engine.add_argument("--kv-cache-memory", type=int, help="bytes for the KV cache on CPU")
    engine.add_argument("--max-num-seqs", type=int)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--gpu-memory-utilization", type=float)
    engine.add_argument("--dtype")
    engine.add_argument("--device")
    engine.add_argument("--num-threads", type=int, help="CPU threads for the model (CPU only)")
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--model-impl",
        choices=("auto", "native", "transformers"),
        help="native code or the checkpoint's transformers class on our paged attention "
        "(default auto: native for Llama, Mistral, Qwen2, Qwen3, else transformers)",
    )
    engine.add_argument(
        "--tool-parser",
        help="tool-call format: hermes or llama3_json (default: detected from the chat template)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no torch.compile and no CUDA graphs (both are on by default on CUDA)",
    )
    engine.add_argument("--cpu-compile", action="store_true", help="torch.compile on CPU too")
    engine.add_argument("--log-level", default=os.environ.get("SLUICEGATE_LOG_LEVEL", "INFO"))
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = (
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "gpu_memory_utilization",
        "dtype",
        "device",
        "num_threads",
        "model_impl",
        "tool_parser",
    )
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.no_prefix_caching:
        kwargs["enable_prefix_caching"] = False
    if args.enforce_eager:
        kwargs["enforce_eager"] = True
    if args.cpu_compile:
        kwargs["cpu_compile"] = True
    return kwargs


async def serve(args: argparse.Namespace) -> int:
    served_name: str = args.served_model_name
    options = WorkerOptions(
        model_name=served_name,
        redis_url=args.redis_url,
        heartbeat_ttl_s=args.heartbeat_ttl,
        claim_idle_s=args.claim_idle,
        drain_timeout_s=args.drain_timeout,
        max_pull=args.max_pull,
    )
    if args.worker_id:
        options.worker_id = args.worker_id
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, _log_tasks)

    metrics = WorkerMetrics(served_name)
    health = HealthServer(metrics, args.metrics_host, args.metrics_port)
    await health.start()
    logger.info("worker %s: metrics on port %d", options.worker_id, health.port)

    from engine.async_engine import AsyncEngine

    logger.info("loading %s as %r", args.model, served_name)
    engine = AsyncEngine(args.model, **engine_kwargs(args))
    started = engine.start()
    if inspect.isawaitable(started):
        await started
    redis = async_client(args.redis_url, socket_connect_timeout=2.0, health_check_interval=10)
    cancels = pubsub_client(args.redis_url, socket_connect_timeout=2.0, health_check_interval=10)
    worker = Worker(engine, redis, options, metrics, pubsub_redis=cancels)
    health.refresh = lambda: metrics.observe_engine_stats(engine.stats())
    try:
        backoff = _Backoff()
        while not stop.is_set():
            try:
                await worker._ensure_groups()
                break
            except (RedisError, OSError) as exc:
                await backoff.wait("startup", exc)
        health.ready = True
        logger.info("worker %s ready, serving %r", options.worker_id, served_name)
        if not stop.is_set():
            await worker.run(stop)
    finally:
        health.ready = False
        closed = engine.shutdown()
        if inspect.isawaitable(closed):
            await closed
        await redis.aclose()
        await cancels.aclose()
        await health.stop()
    logger.info("worker %s stopped", options.worker_id)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.served_model_name = args.served_model_name or Path(args.model).resolve().name
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(serve(args))


if __name__ == "__main__":
    raise SystemExit(main())
