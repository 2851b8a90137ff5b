"""A minimal keep-alive HTTP/1.1 client for plain-``http://`` OpenAI-compatible upstreams.

aiohttp's client costs the gateway several times this one's CPU on the two things it does most
(``python bench/upstream_clients.py``): a whole answer (``post``) and, per relayed chunk of a
stream (``stream``), a trip through its ``StreamReader``, a timer rescheduled on every read and
a resume of the transport; a stream's connection is set up in Python (happy eyeballs) too.
Here each connection is one ``http1_answer.Answer``, a protocol reading the answer as it
arrives.

Scope, on purpose: one origin per pool, ``POST`` with a body. A request on a reused connection
that fails before any answer byte (the server closed an idle keep-alive connection) is sent
once more on a fresh connection. A connection goes back to the pool only after an answer read
to its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

from sluicegate.gateway.providers.http1_answer import Answer, UpstreamConnectionError


class Http1Pool:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_idle: int = 256,
    ) -> None:
        self.host = host
        self.port = port
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle: list[Answer] = []
        self._origin = f"{host}:{port}"

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """``(status, body)`` of a whole answer, within the pool's read timeout; raises
        ``UpstreamConnectionError`` or ``TimeoutError``."""
        deadline = time.time() + self._read_timeout_s
        async with self.stream(path, body, headers, idle_timeout_s=0.0, deadline=deadline) as a:
            return a.status, await a.read()

    @contextlib.asynccontextmanager
    async def stream(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        *,
        idle_timeout_s: float,
        deadline: float = 0.0,
    ) -> AsyncIterator[Answer]:
        """An answer whose head was read, its body still to come: no read waits longer than
        ``idle_timeout_s``, and it ends by ``deadline`` (a ``time.time()``; 0: none)."""
        loop = asyncio.get_running_loop()
        by = loop.time() + max(0.001, deadline - time.time()) if deadline else 0.0
        answer = await self._open(self._request(path, body, headers), idle_timeout_s, by)
        try:
            yield answer
        except BaseException:
            answer.close()
            raise
        self._release(answer)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for answer in idle:
            answer.close()

    def _request(self, path: str, body: bytes, headers: dict[str, str]) -> bytes:
        head = [f"POST {path} HTTP/1.1\r\nhost: {self._origin}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        head.append(f"content-length: {len(body)}\r\n\r\n")
        return "".join(head).encode("latin-1") + body

    async def _open(self, request: bytes, idle_timeout_s: float, deadline: float) -> Answer:
        """Sends ``request`` and reads the answer's head, on an idle connection if one is
        still open (the next one if the server had closed it), else on a new one."""
        while self._idle:
            answer = self._idle.pop()
            if not answer.reusable:
                answer.close()
                continue
            try:
                return await self._exchange(answer, request, idle_timeout_s, deadline)
            except UpstreamConnectionError:
                if answer.received_any:
                    raise
        return await self._exchange(await self._connect(), request, idle_timeout_s, deadline)

    async def _exchange(
        self, answer: Answer, request: bytes, idle_timeout_s: float, deadline: float
    ) -> Answer:
        answer.send(request, idle_timeout_s, deadline)
        try:
            await answer.head()
        except BaseException:
            answer.close()
            raise
        return answer

    async def _connect(self) -> Answer:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                transport, answer = await loop.create_connection(
                    lambda: Answer(loop, self._origin), self.host, self.port
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectionError(f"cannot connect to {self._origin}: {exc!r}") from exc
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return answer

    def _release(self, answer: Answer) -> None:
        if answer.reusable and len(self._idle) < self._max_idle:
            self._idle.append(answer)
        else:
            answer.close()
