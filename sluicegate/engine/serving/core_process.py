"""The engine core in a process of its own: scheduler, block manager and model runner step
here while the worker process does Redis I/O, tokenizing, logprob text and reply encoding on
another core, so neither waits on the other's Python.

Two threads beside the step loop keep the core from ever waiting on I/O: one reads and
decodes commands from the worker as they come (a long prefill never stalls the worker's
writes), one writes encoded outputs (a busy worker never stalls a step). The step loop takes
every queued command, applies it, steps while there is work, and blocks only when idle.

The core exits when told to, or when the worker's end of the pipe closes (the worker died):
it must never outlive the process that serves its results.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from sluicegate.engine.core.scheduler import RequestRejected
from sluicegate.engine.options import EngineOptions
from sluicegate.engine.serving import channel as channel
from sluicegate.engine.serving.core import EngineCore
from sluicegate.engine.serving.core_steps import PendingRequest, abort_delta, apply, control

logger = logging.getLogger("sluicegate.core")

_GRAMMAR_READY = object()
"""Queued when a grammar finishes compiling, to wake an idle step loop."""


def run_core(
    model: str | Path,
    options: EngineOptions,
    commands: Connection,
    outputs: Connection,
    log_level: int = logging.INFO,
) -> None:
    """The core process's entry point (``multiprocessing`` target)."""
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s"
    )
    # Ctrl-C reaches the whole process group; the worker decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = EngineCore(model, options)
    except BaseException as exc:
        logger.exception("engine core failed to start")
        outputs.send_bytes(
            channel.encoder.encode(channel.CoreFailed(f"{type(exc).__name__}: {exc}"))
        )
        os._exit(1)
    outputs.send_bytes(
        channel.encoder.encode(channel.Ready(core.model.config.vocab_size, core.stats()))
    )
    code = CoreLoop(core, commands, outputs).run()
    core.close()
    outputs.close()
    # os._exit: the model's threads (oneDNN, grammar compiler) must not hold up the exit.
    os._exit(code)


class CoreLoop:
    def __init__(self, core: EngineCore, commands: Connection, outputs: Connection) -> None:
        self.core = core
        self.inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.pending: list[PendingRequest] = []
        self.aborts: set[str] = set()
        self.added = 0
        self.replies: list[channel.ControlDone] = []
        self.stopping = False
        self._sent_stats: dict[str, Any] = {}
        self._reader = threading.Thread(
            target=self._read, args=(commands,), name="core-commands", daemon=True
        )
        self._writer = threading.Thread(
            target=self._write, args=(outputs,), name="core-outputs", daemon=True
        )

    def run(self) -> int:
        self._reader.start()
        self._writer.start()
        code = 0
        try:
            while not self.stopping:
                self._take_commands(block=not self._has_work())
                if self.stopping:
                    break
                self._step()
        except BaseException:
            logger.exception("engine core loop failed")
            code = 1
        self._close()
        return code

    def _has_work(self) -> bool:
        return bool(self.aborts) or self.core.has_unfinished() or any(p.ready for p in self.pending)

    def _take_commands(self, block: bool) -> None:
        try:
            message = self.inbox.get() if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(message)
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, message: object) -> None:
        if isinstance(message, channel.AddRequest):
            self.added += 1
            spec = self.core.grammar_spec(message.options)
            grammar = None
            if spec is not None:
                grammar = self.core.grammars.submit(spec)
                grammar.add_done_callback(lambda _: self.inbox.put(_GRAMMAR_READY))
            self.pending.append(
                PendingRequest(
                    message.request_id,
                    message.params,
                    message.options,
                    prompt_token_ids=message.prompt_token_ids,
                    chat=message.chat,
                    grammar=grammar,
                    resume_token_ids=message.resume_token_ids,
                )
            )
        elif isinstance(message, channel.AbortRequest):
            self.aborts.add(message.request_id)
        elif isinstance(message, channel.ControlCommand):
            try:
                control(self.core, message.name, message.path)
            except ValueError as exc:
                self.replies.append(channel.ControlDone(message.token, str(exc)))
            else:
                self.replies.append(channel.ControlDone(message.token))
        elif isinstance(message, channel.Shutdown):
            self.stopping = True

    def _step(self) -> None:
        core = self.core
        ready = [p for p in self.pending if p.ready or p.request_id in self.aborts]
        if ready:
            # Identity, not readiness again: a grammar may finish between the two lines.
            self.pending = [p for p in self.pending if p not in ready]
        deltas, errors = apply(core, ready, self.aborts)
        failed = [channel.RequestFailed(rid, str(exc), _kind(exc)) for rid, exc in errors]
        try:
            if core.has_unfinished():
                deltas.extend(core.step())
        except Exception as exc:  # a failed step leaves no request in a known state
            logger.exception("engine step failed; failing every request in flight")
            message = f"engine step failed: {exc!r}"
            for request_id in core.live_request_ids():
                core.abort(request_id)
                failed.append(channel.RequestFailed(request_id, message, "failed"))
        stats = core.stats()
        stats["num_pending"] = len(self.pending)
        kv_events = core.take_kv_events()
        # A step that changed nothing (say, nothing fit in the cache) sends nothing.
        if deltas or failed or self.added or self.replies or kv_events or stats != self._sent_stats:
            output = channel.StepOutput(deltas, failed, stats, self.added, self.replies, kv_events)
            self._send(output)
            self._sent_stats = stats
            self.added = 0
            self.replies = []

    def _send(self, message: channel.StepOutput | channel.CoreFailed) -> None:
        self.outbox.put(channel.encoder.encode(message))

    def _close(self) -> None:
        """Abort what is left (the worker gets each request's final delta), then flush."""
        deltas = [d for r in self.core.live_request_ids() for d in self.core.abort(r)]
        deltas += [abort_delta(p.request_id) for p in self.pending]
        self._send(channel.StepOutput(deltas, [], self.core.stats(), self.added))
        self.outbox.put(None)
        self._writer.join(timeout=5.0)
        self.core.grammars.shutdown()

    def _read(self, commands: Connection) -> None:
        try:
            while True:
                self.inbox.put(channel.to_core.decode(commands.recv_bytes()))
        except (EOFError, OSError):
            # The worker is gone (or closed its end): stop; nobody reads our outputs.
            self.inbox.put(channel.Shutdown())

    def _write(self, outputs: Connection) -> None:
        while (data := self.outbox.get()) is not None:
            try:
                outputs.send_bytes(data)
            except (BrokenPipeError, OSError):
                self.inbox.put(channel.Shutdown())
                return


def _kind(exc: ValueError) -> str:
    return "rejected" if isinstance(exc, RequestRejected) else "invalid"
