"""The worker side of an engine core process: starts it, sends it commands and hands its
outputs to a callback on the event loop (the pipe is read by the loop itself: no thread).

The core's death, however it happens (a crash, the OOM killer, a failed start), closes its
end of the pipe; the loop sees end-of-file at once and ``on_exit`` gets a message naming the
exit code, so no request waits forever on a core that is gone."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from collections.abc import Callable
from pathlib import Path

from sluicegate.engine.options import EngineOptions
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving import channel as channel
from sluicegate.engine.serving.core_process import run_core
from sluicegate.engine.serving.request_options import RequestOptions

logger = logging.getLogger(__name__)


class CoreStartFailed(RuntimeError):
    """The engine core process could not load the model."""


class CoreClient:
    def __init__(
        self,
        model: str | Path,
        options: EngineOptions,
        on_output: Callable[[channel.StepOutput], None],
        on_exit: Callable[[str], None],
    ) -> None:
        self.model = model
        self.options = options
        self.on_output = on_output
        self.on_exit = on_exit
        # spawn, not fork: the worker holds threads (Redis, grammar, torch) a fork would copy
        # in whatever state they were in.
        context = multiprocessing.get_context("spawn")
        core_commands, self._commands = context.Pipe(duplex=False)  # (read end, write end)
        self._outputs, core_outputs = context.Pipe(duplex=False)
        self._core_ends = (core_commands, core_outputs)
        self.process = context.Process(
            target=run_core,
            args=(model, options, core_commands, core_outputs),
            kwargs={"log_level": logging.getLogger().getEffectiveLevel()},
            name="engine-core",
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = self._outputs.fileno()
        self._closed = False

    async def start(self) -> channel.Ready:
        """Start the process and wait until its model is loaded."""
        self.process.start()
        # The core's ends live on in the child; closing ours lets us see its death as EOF.
        for end in self._core_ends:
            end.close()
        loop = asyncio.get_running_loop()
        self._loop = loop
        first = await loop.run_in_executor(None, self._recv_first)
        if not isinstance(first, channel.Ready):
            self._closed = True
            raise CoreStartFailed(f"the engine core failed to start: {first}")
        loop.add_reader(self._fd, self._readable)
        return first

    def _recv_first(self) -> channel.FromCore | str:
        try:
            message = channel.from_core.decode(self._outputs.recv_bytes())
        except (EOFError, OSError):
            self.process.join(5.0)
            return f"exit code {self.process.exitcode}"
        if isinstance(message, channel.CoreFailed):
            self.process.join(5.0)
            return message.message
        return message

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        options: RequestOptions,
        *,
        chat: bool,
        resume_token_ids: list[int] | None,
    ) -> None:
        self._send(
            channel.AddRequest(
                request_id, prompt_token_ids, params, options, chat, resume_token_ids
            )
        )

    def abort(self, request_id: str) -> None:
        self._send(channel.AbortRequest(request_id))

    def control(self, token: int, name: str, path: str | None) -> None:
        self._send(channel.ControlCommand(token, name, path))

    def _send(self, message: channel.ToCore) -> None:
        # The core reads commands on a thread of its own, so this never waits for a step.
        try:
            self._commands.send_bytes(channel.encoder.encode(message))
        except (BrokenPipeError, OSError):
            pass  # the core is gone; reading its outputs reports it

    def _readable(self) -> None:
        # One step's output per callback: when the core runs ahead, the worker's other
        # tasks (pulling new requests, writing replies) still get their turn in between.
        self._read(limit=1)

    def _read(self, limit: int | None) -> None:
        try:
            while (limit is None or limit > 0) and self._outputs.poll():
                if limit is not None:
                    limit -= 1
                message = channel.from_core.decode(self._outputs.recv_bytes())
                if isinstance(message, channel.StepOutput):
                    self.on_output(message)
                elif isinstance(message, channel.CoreFailed):
                    logger.error("engine core failed: %s", message.message)
        except (EOFError, OSError):
            self._gone()

    def _gone(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        if self._closed:
            return
        self._closed = True
        self.process.join(1.0)
        reason = f"the engine core process exited unexpectedly (exit code {self.process.exitcode})"
        logger.error("%s", reason)
        self.on_exit(reason)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop (it aborts what is left and sends the final deltas), wait
        for it, and hand on every output it sent."""
        if self._closed:
            return
        self._closed = True
        self._send(channel.Shutdown())
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.process.join, timeout_s)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %gs; killing it", timeout_s)
            self.process.kill()
            await loop.run_in_executor(None, self.process.join, 5.0)
        self._read(limit=None)  # what it sent last; ends in EOF, which removes the reader
        self._commands.close()
        self._outputs.close()
