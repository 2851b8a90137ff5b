"""The request path's Redis commands, joined into one pipeline while others are in flight.

Each request sends two: its admission script, and its settle script with its usage event.
A lone request sends them at once, as does one that finds a single exchange in flight (a
sequential client's admission behind its previous request's settle). Under load, commands
issued while others are in flight wait for the end of the current event-loop turn and go out
together: one write and one read for the batch instead of one each per request, which on a
loaded gateway is a large share of its CPU (socket calls and redis-py's per-call connection
handling).
Replies come back per command, an error as its exception object, like a pipeline executed
with ``raise_on_error=False``; a failure of the whole exchange (connection lost, timeout)
is raised to every request of the batch, as it would have been to each alone.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

from sluicegate.gateway.redis.direct import DirectConnection

Command = tuple[Any, ...]


class CommandBatcher:
    def __init__(self, redis: Redis, direct: DirectConnection | None = None) -> None:
        self._redis = redis
        self._direct = direct
        """A single server's own connection (sluicegate.gateway.redis.direct), used instead of redis-py's."""
        self._in_flight = 0
        self._queued: list[tuple[tuple[Command, ...], asyncio.Future[list[Any]]]] = []
        self._sending: set[asyncio.Task[None]] = set()
        self.round_trips = 0

    def quiet(self) -> bool:
        """Nothing queued and at most one exchange in flight (a sequential client's previous
        settle): this replica is not under load."""
        return self._in_flight <= 1 and not self._queued

    async def execute(self, *commands: Command) -> list[Any]:
        """The replies to ``commands`` (each a command and its arguments), in order."""
        # One exchange in flight and none queued is a sequential client's previous settle:
        # waiting a loop turn to join it would only delay this one (~100 µs an admission).
        if not self.quiet():
            loop = asyncio.get_running_loop()
            future: asyncio.Future[list[Any]] = loop.create_future()
            self._queued.append((commands, future))
            if len(self._queued) == 1:
                loop.call_soon(self._flush)
            return await future
        self._in_flight += 1
        try:
            return await self._send(commands)
        finally:
            self._in_flight -= 1

    async def _send(self, commands: tuple[Command, ...]) -> list[Any]:
        self.round_trips += 1
        if self._direct is not None:
            return await self._direct.exchange(commands)
        if len(commands) == 1:
            try:
                return [await self._redis.execute_command(*commands[0])]
            except ResponseError as exc:
                return [exc]
        pipe = self._redis.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        replies = list(await pipe.execute(raise_on_error=False))
        # A cluster pipeline hands back a node's lost connection or timeout as those commands'
        # replies; a single server's raises it. Either way it is the exchange that failed.
        for reply in replies:
            if isinstance(reply, (ConnectionError, TimeoutError)):
                raise reply
        return replies

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        task = asyncio.ensure_future(self._send_queued(queued))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_queued(
        self, queued: list[tuple[tuple[Command, ...], asyncio.Future[list[Any]]]]
    ) -> None:
        self._in_flight += 1
        try:
            replies = await self._send(tuple(c for commands, _ in queued for c in commands))
        except Exception as exc:
            for _, future in queued:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:
            for _, future in queued:
                future.cancel()
            raise
        finally:
            self._in_flight -= 1
        at = 0
        for commands, future in queued:
            if not future.done():  # its request may have been cancelled meanwhile
                future.set_result(replies[at : at + len(commands)])
            at += len(commands)
