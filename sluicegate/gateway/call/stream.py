"""A streamed answer: the first chunk decides between an HTTP error and a 200, then the
router's chunks are relayed through the controller's ``Renderer`` as server-sent events.

Everything after the first chunk runs inside one guard (``_relay``): whatever fails there,
renderer included, the client gets its API's error event and the stream ends normally, so the
background ``close`` settles the call — also when the client went away mid-stream. The relay
writes each chunk's events with ``send`` itself (``EventStream``): no task, cancel scope or
generator step of Litestar's between a chunk and its write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import anyio
from litestar.background_tasks import BackgroundTask
from litestar.types import Send

from sluicegate.gateway.call.call import Call, Renderer, public_error, with_headers
from sluicegate.gateway.canonical import Chunk, Usage
from sluicegate.gateway.errors import OpenAIError, UpstreamError
from sluicegate.gateway.http.event_stream import EventStream
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.telemetry import ADDED_LATENCY

logger = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


async def stream(call: Call, renderer: Renderer) -> EventStream:
    """Answer ``call`` as an event stream; its settlement runs after the response."""
    call.generation_started = time.perf_counter()
    generation = call.services.router.stream(call.route, call.request)
    chunks = aiter(generation)
    try:
        # The first chunk is awaited before answering, so failing to start is an HTTP
        # error (with fallback inside the router), not a 200 with an error event.
        first = await anext(chunks)
    except ProviderError as exc:
        call.deployment = generation.deployment
        call.status = "error"
        await generation.aclose()
        await call.finish()
        error = public_error(exc, call.prompt_param)
        raise with_headers(error, call.admission.headers) from None
    except (OpenAIError, StopAsyncIteration) as exc:
        call.status = "error"
        await generation.aclose()
        await call.finish()
        if isinstance(exc, OpenAIError):
            raise with_headers(exc, call.admission.headers) from None
        raise with_headers(
            UpstreamError("The deployment ended the stream without an answer."),
            call.admission.headers,
        ) from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await generation.aclose()
        await call.finish_shielded()
        raise
    call.deployment = generation.deployment
    call.chunk_received(first)
    ADDED_LATENCY.observe(call.generation_started - call.started)

    async def relay(send: Send) -> None:
        await _relay(call, renderer, chunks, first, send)

    async def close() -> None:
        # Runs after the response, also when the client went away: closing the generator
        # cancels the upstream call; finish bills what was delivered.
        await generation.aclose()
        await call.finish()

    return EventStream(
        relay,
        headers={**SSE_HEADERS, **call.response_headers()},
        background=BackgroundTask(close),
    )


async def _relay(
    call: Call, renderer: Renderer, chunks: AsyncIterator[Chunk], first: Chunk, send: Send
) -> None:
    """The stream's bytes; cancelled mid-way when the client disconnects (``finish`` bills
    that). Rendering is inside the guard too: whatever fails, the client gets its API's error
    event and the stream ends normally, so ``close`` settles it. The last events go out with
    the body's end."""
    chunk: Chunk | None = first
    leases = call.services.leases
    billable = False
    try:
        data = renderer.opening(call, first)
        while chunk is not None:
            data += renderer.chunk(call, chunk)
            if not billable and call.first_token_at is not None and leases is not None:
                # The lease says "billed if this replica dies" before the client sees output.
                await leases.first_tokens_stored()
                billable = True
            if data:
                await send({"type": "http.response.body", "body": data, "more_body": True})
                data = b""
            chunk = await anext(chunks, None)
            if chunk is not None:
                call.chunk_received(chunk)
        call.status = "ok"
        call.finish_reason = call.finish_reason or "stop"
        if call.usage is None:
            call.usage = Usage(call.prompt_tokens or call.prompt_estimate, call.delivered_tokens)
        last = renderer.closing(call)
    except ProviderError as exc:
        call.status = "error"
        if exc.usage is not None:
            call.usage = exc.usage
        last = renderer.error(call, public_error(exc, call.prompt_param))
    except Exception:
        # Whatever broke, the client gets its API's error event and the request is settled.
        logger.exception("stream %s failed", call.request_id)
        call.status = "error"
        failure = UpstreamError("The server had an error while streaming the response.")
        failure.error_type = "server_error"
        last = renderer.error(call, failure)
    await send({"type": "http.response.body", "body": last, "more_body": False})
