"""Serving: one task per request runs it on the engine and turns each ``RequestDelta`` into
a wire ``Delta`` (or an ``Error``) queued for the reply writer; it also keeps the request's
metrics, its produced-token record and its "started" mark."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.serving.request_delta import RequestDelta
from sluicegate.engine.tracing import RequestTracer
from sluicegate.engine.worker.metrics import WorkerMetrics
from sluicegate.engine.worker.options import WorkerOptions
from sluicegate.engine.worker.prompt_count import count_reply
from sluicegate.engine.worker.replies import ReplyWriter, Write

if TYPE_CHECKING:
    from sluicegate.engine.serving.async_engine import AsyncEngine

logger = logging.getLogger("sluicegate.worker")

_PRODUCED_EVERY_S = 0.5


@dataclass
class InFlight:
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

    @property
    def batchable(self) -> bool:
        return self.request.v >= protocol.BATCH_VERSION

    @property
    def entry(self) -> tuple[str, bytes]:
        return self.stream, self.entry_id


class Server:
    def __init__(
        self,
        engine: AsyncEngine,
        options: WorkerOptions,
        writer: ReplyWriter,
        metrics: WorkerMetrics,
        room: asyncio.Event,
    ) -> None:
        self.engine = engine
        self.options = options
        self.writer = writer
        self.metrics = metrics
        self.room = room
        self.tracer = RequestTracer(options.model_name, options.worker_id)
        self.in_flight: dict[str, InFlight] = {}
        self.tokens_per_second: collections.Counter[int] = collections.Counter()
        """Generated tokens by whole second, for the heartbeat's tokens/s over the last 5 s."""
        self.finished_per_second: collections.Counter[int] = collections.Counter()
        """Choices (sequences) that finished by whole second: the rate seats free up at."""
        self.seat_ms: collections.Counter[int] = collections.Counter()
        """By the same seconds, the milliseconds those choices held a running slot, in all."""

    def start(self, item: InFlight) -> None:
        rid = item.request.request_id
        self.in_flight[rid] = item
        item.task = asyncio.create_task(self._serve(item), name=f"serve-{rid}")

    async def _serve(self, item: InFlight) -> None:
        request = item.request
        rid = request.request_id
        try:
            if request.count_only:
                self._finish(item, await count_reply(self.engine, request, self.options.worker_id))
                return
            async for output in self._start_request(request):
                self._publish_delta(item, output)
                if request.expired():
                    self.engine.abort(rid)
                    self.fail(item, "deadline_exceeded", "The request's deadline passed.")
                    return
            if rid in self.in_flight:
                # The engine ended the request without a final delta (e.g. aborted).
                self._finish(item, None)
        except asyncio.CancelledError:
            raise
        except ValueError as exc:
            self.fail(item, _rejection_code(exc), str(exc))
        except Exception as exc:
            if self.engine.failed.is_set():
                # The engine core process died: the gateway resumes the request elsewhere.
                self.fail(item, "worker_lost", f"The engine worker was lost: {exc}")
                return
            logger.exception("request %s failed", rid)
            self.fail(item, "internal_error", f"The engine failed: {type(exc).__name__}: {exc}")
        finally:
            self.in_flight.pop(rid, None)
            self.room.set()

    def _start_request(self, request: protocol.Request) -> AsyncIterator[RequestDelta]:
        from sluicegate.engine.sample.params import SamplingParams
        from sluicegate.engine.serving.request_options import RequestOptions

        params = SamplingParams(**msgspec.structs.asdict(request.sampling))
        options = RequestOptions(
            n=request.n,
            tools=request.tools,
            tool_choice=request.tool_choice,
            tool_choice_name=request.tool_choice_name,
            parallel_tool_calls=request.parallel_tool_calls,
            structured=request.structured,
            chat_template_kwargs=request.chat_template_kwargs,
            priority=request.priority,
            lora=request.lora,
        )
        rid = request.request_id
        resume = request.resume_token_ids or None
        if request.messages is not None:
            messages = msgspec.to_builtins(request.messages)
            return self.engine.add_request(
                rid, messages=messages, params=params, options=options, resume_token_ids=resume
            )
        if request.prompt_token_ids is not None:
            return self.engine.add_request(
                rid,
                prompt_token_ids=request.prompt_token_ids,
                params=params,
                options=options,
                resume_token_ids=resume,
            )
        if request.prompt is not None:
            return self.engine.add_request(
                rid, request.prompt, params=params, options=options, resume_token_ids=resume
            )
        raise ValueError("request has no prompt, prompt_token_ids or messages")

    def _publish_delta(self, item: InFlight, output: RequestDelta) -> None:
        self.room.set()
        now = time.monotonic()
        token_ids = output.token_ids
        finish_reason = output.finish_reason
        if output.usage is not None and output.usage.prompt_tokens:
            item.prompt_tokens = output.usage.prompt_tokens
        elif output.num_prompt_tokens > 0:
            item.prompt_tokens = output.num_prompt_tokens
        item.completion_tokens += len(token_ids)
        if finish_reason is not None:
            self._count_finish(output, now)
        if finish_reason is not None or now - item.produced_at >= _PRODUCED_EVERY_S:
            item.produced_at = now
            self._note_produced(item, done=finish_reason is not None)
        if token_ids:
            self.metrics.generation_tokens.inc(len(token_ids))
            self.tokens_per_second[int(now)] += len(token_ids)
            if item.last_delta_at:
                self.metrics.inter_token_latency.observe(now - item.last_delta_at)
            else:
                self.metrics.time_to_first_token.observe(now - item.pulled_at)
            item.last_delta_at = now
        text, reasoning_text, tool_calls = output.text, output.reasoning_text, output.tool_calls
        if finish_reason is None and not (token_ids or text or reasoning_text or tool_calls):
            return
        logprobs = self.engine.wire_logprobs(output.logprobs) if output.logprobs else []
        usage = None
        if item.seq == 0 or finish_reason is not None:
            cached = output.usage.cached_tokens if output.usage is not None else 0
            usage = protocol.Usage(
                prompt_tokens=item.prompt_tokens,
                completion_tokens=item.completion_tokens,
                cached_tokens=cached,
            )
        delta = protocol.Delta(
            request_id=item.request.request_id,
            seq=item.seq,
            text=text,
            token_ids=list(token_ids),
            finish_reason=finish_reason,
            usage=usage,
            worker_id=self.options.worker_id,
            index=output.index,
            reasoning_text=reasoning_text,
            tool_calls=list(tool_calls),
            logprobs=logprobs,
            stop_sequence=output.stop_sequence,
            produced=len(item.request.resume_token_ids or ()) + item.completion_tokens,
        )
        item.seq += 1
        # "Started" means the client may have been shown text: from then on the request
        # cannot move to another worker. Tokens without text yet are invisible to the client.
        started = None
        if not item.started and (text or reasoning_text or tool_calls or finish_reason):
            item.started = True
            started = redis_names.started_key(self.options.model_name, item.request.request_id)
        if output.done:
            self.tracer.request_finished(item.request, item.pulled_at, output)
            self._finish(item, delta, started)
        else:
            self.writer.put(Write(item.request.reply_key(), delta, item.batchable, started))

    def _count_finish(self, output: RequestDelta, now: float) -> None:
        self.finished_per_second[int(now)] += 1
        timings = output.timings
        if timings is not None and timings.first_scheduled is not None:
            held_s = max(0.0, timings.finished - timings.first_scheduled)
            self.seat_ms[int(now)] += round(held_s * 1000)

    def _finish(
        self, item: InFlight, delta: protocol.Delta | None, started: str | None = None
    ) -> None:
        self.in_flight.pop(item.request.request_id, None)
        self.metrics.prompt_tokens.inc(item.prompt_tokens)
        self.metrics.e2e_request_latency.observe(time.monotonic() - item.pulled_at)
        self.writer.put(Write(item.request.reply_key(), delta, item.batchable, started, item.entry))

    def _note_produced(self, item: InFlight, *, done: bool) -> None:
        resumed = len(item.request.resume_token_ids or ())
        self.writer.produced[item.request.request_id] = {
            "p": item.prompt_tokens,
            "n": resumed + item.completion_tokens,
            "m": self.options.model_name,
            "d": int(done),
        }

    def fail(self, item: InFlight, code: protocol.ErrorCode, message: str) -> None:
        """End the request with an error reply (and acknowledge its entry)."""
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
        self.writer.put(Write(item.request.reply_key(), error, item.batchable, None, item.entry))

    def stop(self, item: InFlight) -> None:
        """Stop serving silently: the engine's work ends, and no reply is written."""
        self.in_flight.pop(item.request.request_id, None)
        self.engine.abort(item.request.request_id)
        if item.task is not None:
            item.task.cancel()


def _rejection_code(exc: ValueError) -> protocol.ErrorCode:
    text = str(exc).lower()
    if "max_model_len" in text or "context" in text or "too long" in text or "exceed" in text:
        return "context_length_exceeded"
    return "invalid_request"
