"""One plain connection to a single Redis server for the request path's own commands.

Each request sends two commands (``sluicegate.gateway.redis.batch``): its admission script, and its
settle script with its usage event. Through redis-py's asyncio client a lone ``EVALSHA`` of
twenty keys costs about twice the round trip itself on this machine kind (167 µs against 81 µs
on a bare connection: its pool, retry wrapper, timeout context and stream reader). This
connection writes commands packed by hiredis and reads the replies with hiredis's parser, in
order, several exchanges in flight at once; replies come back raw, as ``EVALSHA`` and ``XADD``
return them through redis-py too.

Used for a single server reached in plain TCP or by a Unix socket (``redis://``, ``unix://``);
Sentinel and Cluster keep redis-py's clients, which follow failovers and slots, and TLS
(``rediss://``) keeps redis-py's certificate handling. As with those clients, a command is
never sent twice: when the connection breaks or an exchange times out, every exchange in
flight fails (it may or may not have run) and the next one connects afresh.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

import hiredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = tuple[Any, ...]
_Exchange = tuple[asyncio.Future[list[Any]], list[Any], int, float]
"""An exchange in flight: its future, the replies read so far, how many it awaits, and the
loop time by which they must all have come."""
DEADLINE_SLACK_S = 0.001


@dataclass(frozen=True)
class Address:
    host: str = "127.0.0.1"
    port: int = 6379
    path: str | None = None
    """A Unix socket's path (``unix://``), instead of host and port."""
    username: str | None = None
    password: str | None = None
    db: int = 0

    @classmethod
    def from_url(cls, url: str) -> Address | None:
        """The server of a plain single-server URL; ``None`` for TLS, Sentinel or Cluster URLs
        and for URLs with connection options other than ``db`` (redis-py's client honours
        those)."""
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        if parts.scheme not in ("redis", "unix") or set(query) - {"db"}:
            return None
        unix = parts.scheme == "unix"
        db = query.get("db", [""])[0] or ("" if unix else parts.path.strip("/"))
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or 6379,
            path=parts.path if unix else None,
            username=unquote(parts.username) if parts.username else None,
            password=unquote(parts.password) if parts.password else None,
            db=int(db or 0),
        )


def reply_error(error: hiredis.ReplyError) -> ResponseError:
    """A server's error reply as redis-py raises it (callers tell NOSCRIPT apart)."""
    message = str(error)
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    return ResponseError(message)


class _Protocol(asyncio.Protocol):
    """Replies come back in the order the commands went out, so the exchanges in flight form
    a queue whose head is always the longest waiting: one timer, watching the head's deadline,
    times out every exchange (``asyncio.timeout`` per exchange cost ~10 µs of each request)."""

    def __init__(self, timeout_s: float) -> None:
        self.reader = hiredis.Reader(replyError=hiredis.ReplyError)
        self.transport: asyncio.Transport | None = None
        self.timeout_s = timeout_s
        self.waiting: collections.deque[_Exchange] = collections.deque()
        self.watch: asyncio.TimerHandle | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream connection's transport (uvloop's is no subclass of asyncio's classes).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiting:
            future, replies, expected, _ = self.waiting[0]
            while len(replies) < expected:
                reply = self.reader.gets()
                if reply is False:
                    return
                replies.append(
                    reply_error(reply) if isinstance(reply, hiredis.ReplyError) else reply
                )
            self.waiting.popleft()
            if not future.done():
                future.set_result(replies)

    def closing(self) -> bool:
        """Closed, or closing after the server's EOF (its ``connection_lost`` not yet run)."""
        return self.transport is None or self.transport.is_closing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"connection to Redis lost: {exc!r}"))

    def expect(self, future: asyncio.Future[list[Any]], replies: int) -> None:
        """Queue ``future`` for the next ``replies`` replies, failing them all if they are late."""
        loop = future.get_loop()
        self.waiting.append((future, [], replies, loop.time() + self.timeout_s))
        if self.watch is None:
            self.watch = loop.call_at(self.waiting[0][3], self._check_deadline)

    def _check_deadline(self) -> None:
        self.watch = None
        if not self.waiting:
            return
        loop = asyncio.get_running_loop()
        deadline = self.waiting[0][3]
        # Timers may fire up to a clock tick early: within a millisecond is due.
        if deadline - loop.time() <= DEADLINE_SLACK_S:
            # What it and those behind it ran is unknown: none of them may be read as answered.
            self.fail(RedisTimeoutError("Redis did not answer in time"))
        else:
            self.watch = loop.call_at(deadline, self._check_deadline)

    def fail(self, error: Exception) -> None:
        self.lost = True
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        waiting, self.waiting = self.waiting, collections.deque()
        for future, _, _, _ in waiting:
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class DirectConnection:
    """``exchange(commands)``: their replies, in order (an error reply as its exception)."""

    def __init__(self, address: Address, *, connect_timeout_s: float, timeout_s: float) -> None:
        self._address = address
        self._connect_timeout_s = connect_timeout_s
        self._timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None

    async def exchange(self, commands: tuple[Command, ...]) -> list[Any]:
        protocol = await self._connected()
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        protocol.expect(future, len(commands))
        assert protocol.transport is not None
        protocol.transport.write(b"".join(hiredis.pack_command(c) for c in commands))
        return await future

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and not protocol.lost and not protocol.closing():
            return protocol
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        # Shielded: one caller's cancellation must not drop the connection the others await.
        self._protocol = await asyncio.shield(self._connecting)
        return self._protocol

    def _new_protocol(self) -> _Protocol:
        return _Protocol(self._timeout_s)

    async def _connect(self) -> _Protocol:
        address, loop = self._address, asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                if address.path is not None:
                    _, protocol = await loop.create_unix_connection(
                        self._new_protocol, address.path
                    )
                else:
                    _, protocol = await loop.create_connection(
                        self._new_protocol, address.host, address.port
                    )
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis: {exc!r}") from exc
        setup: list[Command] = []
        if address.password is not None:
            setup.append(("AUTH", *filter(None, (address.username, address.password))))
        if address.db:
            setup.append(("SELECT", address.db))
        if setup:
            self._protocol = protocol
            for reply in await self.exchange(tuple(setup)):
                if isinstance(reply, Exception):
                    protocol.fail(RedisConnectionError(str(reply)))
                    raise RedisConnectionError(f"Redis refused the connection's setup: {reply}")
        return protocol

    async def aclose(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
