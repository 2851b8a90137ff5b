"""A server-sent event stream whose body a coroutine writes with ``send`` itself.

Litestar's ``Stream`` runs its iterator in a child task of an anyio task group while the parent
waits for the client to go away, and wraps every piece in another async-generator step; with
thousands of open streams that was a task, a cancel scope and a generator hop per stream and
per chunk for nothing the relay needs. ``EventStream`` runs its ``relay`` in the response's own
task; a done callback of one small task waiting on ``receive`` cancels it when the client
disconnects, as Litestar's did, and the relay's last body message (``more_body=False``) carries
its final events, so the end of a stream is one write, not two.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask, BackgroundTasks
from litestar.datastructures import Cookie
from litestar.response.base import ASGIResponse
from litestar.types import Receive, Send

Relay = Callable[[Send], Awaitable[None]]
"""Writes the body: ``http.response.body`` messages, the last with ``more_body=False``."""

MEDIA_TYPE = "text/event-stream"


class EventStream(Response[bytes]):
    """A ``text/event-stream`` response whose body ``relay`` sends."""

    def __init__(
        self,
        relay: Relay,
        *,
        headers: dict[str, str],
        background: BackgroundTask | BackgroundTasks | None = None,
    ) -> None:
        super().__init__(b"", headers=headers, background=background, media_type=MEDIA_TYPE)
        self.relay = relay

    def to_asgi_response(  # type: ignore[override]
        self,
        app: Any,
        request: Request[Any, Any, Any],
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        status_code: int | None = None,
        **_: Any,
    ) -> ASGIResponse:
        """As ``Stream`` builds its ASGI response: the handler's headers under our own."""
        return ASGIEventStream(
            self.relay,
            background=self.background or background,
            cookies=itertools.chain(self.cookies, cookies or ()),
            headers={**headers, **self.headers} if headers is not None else self.headers,
            encoding=self.encoding,
            is_head_response=is_head_response,
            media_type=MEDIA_TYPE,
            status_code=self.status_code or status_code,
        )


class ASGIEventStream(ASGIResponse):
    __slots__ = ("relay",)

    _should_set_content_length = False

    def __init__(self, relay: Relay, **kwargs: Any) -> None:
        super().__init__(content_length=0, **kwargs)
        self.relay = relay

    async def send_body(self, send: Send, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        relaying = True
        gone = False

        def on_disconnect(watcher: asyncio.Task[None]) -> None:
            nonlocal gone
            # Only while relaying: once the relay is done, the response's end also reads as
            # a disconnect, and the task has moved on to the background work.
            if relaying and not watcher.cancelled() and watcher.exception() is None:
                gone = True
                task.cancel()

        watcher = asyncio.ensure_future(_until_disconnect(receive))
        watcher.add_done_callback(on_disconnect)
        try:
            await self.relay(send)
        except asyncio.CancelledError:
            # Our own cancel ends the relay as a disconnect ended Litestar's stream: quietly,
            # the background work (settlement) still to run. Anyone else's goes on up.
            if not gone or task.uncancel() > 0:
                raise
        finally:
            relaying = False
            watcher.cancel()


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
