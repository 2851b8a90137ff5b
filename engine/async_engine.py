"""asyncio front of the engine: per-request delta streams, abort, and a step loop whose model
work runs in one worker thread so the event loop stays responsive.

All engine state is touched only by that thread: ``add_request`` and ``abort`` queue their
intent, and the thread applies it right before the next step, so an abort frees the request's
blocks within one step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import protocol
from engine.engine_core import EngineCore, EngineOptions, RequestDelta
from engine.logprobs import wire_logprobs
from engine.protocol import Usage
from engine.request_options import RequestOptions
from engine.sampler import TokenLogprobs
from engine.sampling import SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "RequestDelta"]


@dataclass
class _PendingRequest:
    request_id: str
    params: SamplingParams
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[Any] | None
    options: RequestOptions
    grammar: Future[Any] | None = None
    """The request's grammar, compiling off the step loop; it waits until this is done."""
    resume_token_ids: list[int] | None = None

    @property
    def ready(self) -> bool:
        return self.grammar is None or self.grammar.done()


class EngineStopped(RuntimeError):
    """The engine shut down (or failed) before the request finished."""


class AsyncEngine:
    """One model served to many concurrent asyncio callers.

    ``accept_limit`` is how many requests may wait for admission before ``can_accept`` says
    no (default: ``max_waiting`` if set, else 8); a worker pulls new work only while
    ``can_accept()``. Engine options are those of ``EngineOptions``.
    """

    def __init__(
        self,
        model: str | Path,
        options: EngineOptions | None = None,
        *,
        accept_limit: int | None = None,
        **option_overrides: Any,
    ) -> None:
        self.model = model
        self.options = options or EngineOptions(**option_overrides)
        self.accept_limit = accept_limit or self.options.max_waiting or 8
        self.core: EngineCore | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._streams: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._pending: list[_PendingRequest] = []
        self._aborts: set[str] = set()
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._stats: dict[str, Any] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (in the worker thread) and start the step loop."""
        if self._loop_task is not None:
            return
        loop = asyncio.get_running_loop()
        self.core = await loop.run_in_executor(self._executor, EngineCore, self.model, self.options)
        self._stats = self.core.stats()
        self._stopping = False
        self._loop_task = asyncio.create_task(self._run(), name="engine-step-loop")

    async def shutdown(self) -> None:
        """Stop stepping; every unfinished stream ends with an ``abort`` delta."""
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            await self._loop_task
            self._loop_task = None
        if self.core is not None:
            core = self.core
            loop = asyncio.get_running_loop()
            deltas = await loop.run_in_executor(
                self._executor, lambda: [d for r in list(self._streams) for d in core.abort(r)]
            )
            self._dispatch(deltas)
        for request_id in list(self._streams):
            self._dispatch([_abort_delta(request_id)])
        self._pending.clear()
        self._executor.shutdown(wait=True)
        if self.core is not None:
            self.core.grammars.shutdown()

    async def __aenter__(self) -> AsyncEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        params: SamplingParams | None = None,
        options: RequestOptions | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request (exactly one of prompt, prompt_token_ids, messages) and stream its
        deltas (with ``options.n`` choices, interleaved; the last one has ``done``). A request
        the engine cannot take (``RequestRejected``, a ``ValueError``, e.g. too long for the
        context, or a grammar that does not compile) raises, here or from the iterator.
        Leaving the iteration early aborts the request."""
        if self._loop_task is None or self._stopping:
            raise EngineStopped("the engine is not running; call start() first")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        assert self.core is not None
        options = options or RequestOptions()
        spec = self.core.grammar_spec(options)
        grammar = None
        if spec is not None:
            grammar = self.core.grammars.submit(spec)
            loop = asyncio.get_running_loop()
            grammar.add_done_callback(lambda _: loop.call_soon_threadsafe(self._wake.set))
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._pending.append(
            _PendingRequest(
                request_id,
                params or SamplingParams(),
                prompt,
                prompt_token_ids,
                messages,
                options,
                grammar,
                resume_token_ids,
            )
        )
        self._wake.set()
        return self._stream(request_id, queue)

    async def count_prompt_tokens(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        options: RequestOptions | None = None,
    ) -> int:
        """The prompt's length in tokens, rendered exactly as ``add_request`` renders it (chat
        template, tools), without scheduling anything. It runs on the step thread, between
        two steps, as everything that touches the engine does."""
        if self._loop_task is None or self._stopping:
            raise EngineStopped("the engine is not running; call start() first")
        core = self.core
        assert core is not None
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(
            self._executor, core.prompt_ids, prompt, prompt_token_ids, messages, options
        )
        return len(ids)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestDelta | BaseException]
    ) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.done
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed before the next step runs."""
        if request_id in self._streams:
            self._aborts.add(request_id)
            self._wake.set()

    # -- load -------------------------------------------------------------------------------

    def can_accept(self) -> bool:
        """Whether a worker should pull another request: the engine runs, few requests wait
        for admission and the KV cache has free blocks."""
        if self._loop_task is None or self._stopping:
            return False
        stats = self._stats
        waiting = stats.get("num_waiting", 0) + len(self._pending)
        free_blocks = stats.get("kv_blocks_total", 0) - stats.get("kv_blocks_used", 0)
        return waiting < self.accept_limit and free_blocks > 0

    def stats(self) -> dict[str, Any]:
        """Scheduler counters as of the last step, plus requests not yet handed to it."""
        return {**self._stats, "num_pending": len(self._pending), "num_streams": len(self._streams)}

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        core = self.core
        assert core is not None
        while not self._stopping:
            self._abort_compiling()
            if not (any(p.ready for p in self._pending) or self._aborts or core.has_unfinished()):
                self._wake.clear()
                await self._wake.wait()
                continue
            pending = [p for p in self._pending if p.ready]
            self._pending = [p for p in self._pending if not p.ready]
            aborts, self._aborts = self._aborts, set()
            try:
                deltas, errors = await loop.run_in_executor(
                    self._executor, self._step, core, pending, aborts
                )
            except Exception as exc:  # a failed step leaves no request in a known state
                logger.exception("engine step failed; failing every request in flight")
                await loop.run_in_executor(self._executor, _abort_all, core)
                for request_id in list(self._streams):
                    self._fail(request_id, EngineStopped(f"engine step failed: {exc!r}"))
                continue
            for request_id, error in errors:
                self._fail(request_id, error)
            self._dispatch(deltas)

    def _abort_compiling(self) -> None:
        """Requests aborted while their grammar still compiles never reach the engine."""
        aborted = [p for p in self._pending if not p.ready and p.request_id in self._aborts]
        for request in aborted:
            self._pending.remove(request)
            self._aborts.discard(request.request_id)
            self._dispatch([_abort_delta(request.request_id)])

    def wire_logprobs(self, entries: list[TokenLogprobs]) -> list[protocol.TokenLogprob]:
        """Logprob entries with each token's text and bytes, as the wire protocol carries them."""
        assert self.core is not None
        return wire_logprobs(entries, self.core.tokenizer)

    def _step(
        self, core: EngineCore, pending: list[_PendingRequest], aborts: set[str]
    ) -> tuple[list[RequestDelta], list[tuple[str, Exception]]]:
        """Runs in the worker thread: apply queued adds and aborts, then one engine step."""
        deltas: list[RequestDelta] = []
        errors: list[tuple[str, Exception]] = []
        for request in pending:
            if request.request_id in aborts:
                aborts.discard(request.request_id)
                deltas.append(_abort_delta(request.request_id))
                continue
            try:
                ids = core.prompt_ids(
                    request.prompt, request.prompt_token_ids, request.messages, request.options
                )
                grammar = request.grammar.result() if request.grammar is not None else None
                core.add_request(
                    request.request_id,
                    ids,
                    request.params,
                    request.options,
                    grammar,
                    chat=request.messages is not None,
                    resume_token_ids=request.resume_token_ids,
                )
            except ValueError as exc:
                errors.append((request.request_id, exc))
        for request_id in aborts:
            deltas.extend(core.abort(request_id))
        if core.has_unfinished():
            deltas.extend(core.step())
        self._stats = core.stats()
        return deltas, errors

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            queue = self._streams.get(delta.request_id)
            if queue is None:
                continue
            queue.put_nowait(delta)
            if delta.done:
                del self._streams[delta.request_id]

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)


def _abort_delta(request_id: str) -> RequestDelta:
    return RequestDelta(request_id, finish_reason="abort", usage=Usage(0, 0, 0), done=True)


def _abort_all(core: EngineCore) -> None:
    for request_id in list(core.live_request_ids()):
        core.abort(request_id)
