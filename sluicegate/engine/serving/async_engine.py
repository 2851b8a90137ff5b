"""asyncio front of the engine: per-request delta streams, abort, and the engine stepping on a
thread of its own (``sluicegate.engine.serving.step_thread``) so the event loop stays responsive.

All engine state is touched only by that thread: ``add_request`` and ``abort`` queue their
intent, and the thread applies it right before the next step, so an abort frees the request's
blocks within one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sluicegate.engine import protocol
from sluicegate.engine.core.scheduler import RequestRejected
from sluicegate.engine.kv_events import messages as kv_messages
from sluicegate.engine.options import EngineOptions
from sluicegate.engine.parallel.ranks import RankLost
from sluicegate.engine.sample.logprobs import wire_logprobs
from sluicegate.engine.sample.output import TokenLogprobs
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving import channel as core_channel
from sluicegate.engine.serving.core import EngineCore
from sluicegate.engine.serving.core_client import CoreClient
from sluicegate.engine.serving.core_steps import PendingRequest, abort_delta, control
from sluicegate.engine.serving.delta_streams import DeltaStreams
from sluicegate.engine.serving.request_delta import RequestDelta
from sluicegate.engine.serving.request_options import RequestOptions
from sluicegate.engine.serving.step_thread import Errors, StepThread
from sluicegate.engine.text.prompts import prompt_ids
from sluicegate.engine.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "RequestDelta"]


class EngineStopped(RuntimeError):
    """The engine shut down (or failed) before the request finished."""


class AsyncEngine:
    """One model served to many concurrent asyncio callers.

    ``accept_limit`` is how many requests may wait for admission before ``can_accept`` says
    no (default: ``max_waiting`` if set, else 8); a worker pulls new work only while
    ``can_accept()``. Engine options are those of ``EngineOptions``.

    ``core_process`` runs the engine core (scheduler, block manager, model runner, sampling,
    detokenizing) in a process of its own (``sluicegate.engine.serving.core_process``); this process then only
    tokenizes prompts, routes deltas and whatever its caller does (a worker's Redis I/O), on
    another CPU core in parallel with the steps. If that process dies, every request in
    flight fails with ``EngineStopped`` and ``failed`` is set.
    """

    def __init__(
        self,
        model: str | Path,
        options: EngineOptions | None = None,
        *,
        accept_limit: int | None = None,
        core_process: bool = False,
        **option_overrides: Any,
    ) -> None:
        self.model = model
        self.options = options or EngineOptions(**option_overrides)
        self.accept_limit = accept_limit or self.options.max_waiting or 8
        self.core: EngineCore | None = None
        # Loads the model and, after the last step, aborts what is left (never beside a step).
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-load")
        self._streams = DeltaStreams(self.abort)
        self._steps: StepThread | None = None
        self._stopping = False
        self._stats: dict[str, Any] = {}
        self.core_process = core_process
        self._client: CoreClient | None = None
        self.tokenizer: Tokenizer | None = None
        self._vocab_size = 0
        self._controls: dict[int, asyncio.Future[None]] = {}
        """LoRA loads and unloads sent to the core process, by token, awaiting its reply."""
        self._control_tokens = itertools.count()
        self._in_transit = 0
        """Requests sent to the core process that its outputs have not counted yet."""
        self.failed = asyncio.Event()
        """Set when the engine core process died: a supervisor should restart us."""
        self.on_kv_events: Callable[[list[kv_messages.KvEvent]], None] | None = None
        """Called on the event loop with each step's prefix-cache changes, in step order
        (``EngineOptions.kv_events``): the worker publishes them."""

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model (in the worker thread) and start the step loop."""
        if self._running:
            return
        if self.core_process:
            await self._start_process()
            return
        loop = asyncio.get_running_loop()
        self.core = await loop.run_in_executor(self._executor, EngineCore, self.model, self.options)
        self.tokenizer = self.core.tokenizer
        self._stats = self.core.stats()
        self._stopping = False
        self._steps = StepThread(
            self.core, loop, self._deliver, self._step_failed, self._kv_events_arrived
        )
        self._steps.start()

    async def _start_process(self) -> None:
        loop = asyncio.get_running_loop()
        client = CoreClient(self.model, self.options, self._on_output, self._on_core_exit)
        # The worker's own tokenizer loads while the core loads the model.
        tokenizer = loop.run_in_executor(self._executor, Tokenizer, self.model)
        try:
            ready = await client.start()
        finally:
            self.tokenizer = await tokenizer
        # The token bytes table (for logprobs), built once, off the event loop.
        threading.Thread(target=self.tokenizer.token_bytes, args=(0,), daemon=True).start()
        self._vocab_size = ready.vocab_size
        self._stats = ready.stats
        self._stopping = False
        self._client = client

    @property
    def _running(self) -> bool:
        return self._steps is not None or self._client is not None

    async def shutdown(self) -> None:
        """Stop stepping; every unfinished stream ends with an ``abort`` delta."""
        self._stopping = True
        if self._client is not None:
            await self._client.shutdown()  # its last outputs end every stream it knew
            self._client = None
        if self._steps is not None:
            await self._steps.stop()
            self._steps = None
        if self.core is not None:
            core = self.core
            loop = asyncio.get_running_loop()
            deltas = await loop.run_in_executor(
                self._executor,
                lambda: [d for r in self._streams.request_ids() for d in core.abort(r)],
            )
            self._streams.dispatch(deltas)
        for request_id in self._streams.request_ids():
            self._streams.dispatch([abort_delta(request_id)])
        self._executor.shutdown(wait=True)
        if self.core is not None:
            self.core.grammars.shutdown()
            self.core.close()

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
        if not self._running or self._stopping:
            raise EngineStopped("the engine is not running; call start() first")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        options = options or RequestOptions()
        if self._client is not None:
            return self._add_to_process(
                self._client,
                request_id,
                prompt,
                prompt_token_ids,
                messages,
                params or SamplingParams(),
                options,
                resume_token_ids,
            )
        assert self.core is not None and self._steps is not None
        steps = self._steps
        spec = self.core.grammar_spec(options)
        grammar = None
        if spec is not None:
            grammar = self.core.grammars.submit(spec)
            grammar.add_done_callback(lambda _: steps.wake())
        stream = self._streams.open(request_id)
        steps.add(
            PendingRequest(
                request_id,
                params or SamplingParams(),
                options,
                prompt,
                prompt_token_ids,
                messages,
                grammar=grammar,
                resume_token_ids=resume_token_ids,
            )
        )
        return stream

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
        if not self._running or self._stopping:
            raise EngineStopped("the engine is not running; call start() first")
        loop = asyncio.get_running_loop()
        if self._client is not None:  # tokenized here, as the core process's requests are
            assert self.tokenizer is not None
            tokenizer, vocab = self.tokenizer, self._vocab_size
            ids = await loop.run_in_executor(
                None,
                lambda: prompt_ids(tokenizer, vocab, prompt, prompt_token_ids, messages, options),
            )
            return len(ids)
        core, steps = self.core, self._steps
        assert core is not None and steps is not None
        ids = await steps.call(lambda: core.prompt_ids(prompt, prompt_token_ids, messages, options))
        return len(ids)

    def _add_to_process(
        self,
        client: CoreClient,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        messages: list[Any] | None,
        params: SamplingParams,
        options: RequestOptions,
        resume_token_ids: list[int] | None,
    ) -> AsyncIterator[RequestDelta]:
        try:
            ids = self.prompt_ids(prompt, prompt_token_ids, messages, options)
        except ValueError as exc:
            stream = self._streams.open(request_id)
            self._streams.fail(request_id, exc)  # raised from the iterator, as in-process
            return stream
        return self._submit(
            client, request_id, ids, params, options, messages is not None, resume_token_ids
        )

    def prompt_ids(
        self,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[Any] | None = None,
        options: RequestOptions | None = None,
    ) -> list[int]:
        """The prompt as the engine will see it (with a core process: tokenized here)."""
        if self._client is None:
            assert self.core is not None
            return self.core.prompt_ids(prompt, prompt_token_ids, messages, options)
        assert self.tokenizer is not None
        return prompt_ids(
            self.tokenizer, self._vocab_size, prompt, prompt_token_ids, messages, options
        )

    def _submit(
        self,
        client: CoreClient,
        request_id: str,
        ids: list[int],
        params: SamplingParams,
        options: RequestOptions,
        chat: bool,
        resume_token_ids: list[int] | None = None,
    ) -> AsyncIterator[RequestDelta]:
        """Send a tokenized request to the core process; its deltas stream back."""
        stream = self._streams.open(request_id)
        self._in_transit += 1
        client.add(request_id, ids, params, options, chat=chat, resume_token_ids=resume_token_ids)
        return stream

    async def load_lora(self, name: str, path: str) -> None:
        """Load (or reload) the LoRA adapter ``name`` from ``path`` between two steps;
        raises ``ValueError`` with the reason it cannot (the engine serves on)."""
        await self._control(name, path)

    async def unload_lora(self, name: str) -> None:
        """Drop the LoRA adapter ``name``; requests running with it finish with it."""
        await self._control(name, None)

    async def _control(self, name: str, path: str | None) -> None:
        if not self._running or self._stopping:
            raise EngineStopped("the engine is not running; call start() first")
        if self._client is not None:
            token = next(self._control_tokens)
            future = self._controls[token] = asyncio.get_running_loop().create_future()
            self._client.control(token, name, path)
            await future
            return
        core, steps = self.core, self._steps
        assert core is not None and steps is not None
        self._stats = await steps.call(lambda: control(core, name, path))

    def _on_output(self, output: core_channel.StepOutput) -> None:
        self._in_transit -= output.added
        self._stats = output.stats
        if output.kv_events:
            self._kv_events_arrived(output.kv_events)
        for done in output.replies:
            future = self._controls.pop(done.token, None)
            if future is None or future.done():
                continue
            if done.error is None:
                future.set_result(None)
            else:
                future.set_exception(ValueError(done.error))
        for failed in output.failed:
            error = _FAILURES.get(failed.kind, EngineStopped)
            self._streams.fail(failed.request_id, error(failed.message))
        self._streams.dispatch(output.deltas)

    def _kv_events_arrived(self, events: list[kv_messages.KvEvent]) -> None:
        if self.on_kv_events is not None:
            self.on_kv_events(events)

    def _on_core_exit(self, reason: str) -> None:
        self._stopping = True
        for future in self._controls.values():
            if not future.done():
                future.set_exception(EngineStopped(reason))
        self._controls.clear()
        for request_id in self._streams.request_ids():
            self._streams.fail(request_id, EngineStopped(reason))
        self.failed.set()

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed before the next step runs."""
        if request_id in self._streams:
            if self._client is not None:
                self._client.abort(request_id)
                return
            if self._steps is not None:
                self._steps.abort(request_id)

    # -- load -------------------------------------------------------------------------------

    def can_accept(self) -> bool:
        """Whether a worker should pull another request: the engine runs, few requests wait
        for admission and the KV cache has free blocks."""
        if not self._running or self._stopping:
            return False
        stats = self._stats
        waiting = stats.get("num_waiting", 0) + self._num_pending()
        free_blocks = stats.get("kv_blocks_total", 0) - stats.get("kv_blocks_used", 0)
        return waiting < self.accept_limit and free_blocks > 0

    def stats(self) -> dict[str, Any]:
        """Scheduler counters as of the last step, plus requests not yet handed to it."""
        return {
            **self._stats,
            "num_pending": self._num_pending(),
            "num_streams": len(self._streams),
        }

    def _num_pending(self) -> int:
        """Requests not in the scheduler yet: queued here, on their way to the core process,
        or compiling their grammar there."""
        queued = self._steps.num_pending() if self._steps is not None else 0
        return queued + self._in_transit + self._stats.get("num_pending", 0)

    # -- the step thread's results ----------------------------------------------------------

    def _deliver(self, deltas: list[RequestDelta], errors: Errors, stats: dict[str, Any]) -> None:
        self._stats = stats
        for request_id, error in errors:
            self._streams.fail(request_id, error)
        self._streams.dispatch(deltas)

    def _step_failed(self, exc: Exception) -> None:
        for request_id in self._streams.request_ids():
            self._streams.fail(request_id, EngineStopped(f"engine step failed: {exc!r}"))
        # Under tensor parallelism a failed step leaves the ranks out of lockstep (a rank died
        # mid-collective, say): no later step can run, so the worker exits.
        if isinstance(exc, RankLost) or (self.core is not None and self.core.ranks is not None):
            self.failed.set()

    def wire_logprobs(self, entries: list[TokenLogprobs]) -> list[protocol.TokenLogprob]:
        """Logprob entries with each token's text and bytes, as the wire protocol carries them."""
        assert self.tokenizer is not None
        return wire_logprobs(entries, self.tokenizer)


_FAILURES: dict[str, type[Exception]] = {"rejected": RequestRejected, "invalid": ValueError}
