"""HTTP plumbing shared by the hosted-API providers (Anthropic, Gemini, Azure OpenAI, Bedrock).

One aiohttp session (``Sessions``, the router's) carries plain and TLS, streamed and whole
calls; ``HostedProvider`` is what the adapters share (name, model, whole answers read alike).
Failures map onto ``ProviderError`` the same way for every hosted API: connect errors,
timeouts, 5xx, 529 and 429 are ``retryable`` (a ``retry-after`` is kept so the router can honour
it); 401/403/404 mean this deployment is misconfigured (as does any answer an adapter's
``Refusal`` recognises: Gemini's bad key is a 400), so they are retryable too and the
upstream's words go to the operator's log, not to the client; any other 4xx is the client's
request at fault and its message is passed on. A stream that breaks, sends an unreadable event
or ends early is retryable until output reached the client (``StreamGuard``). Messages name the
deployment, never its URL or key. The headers helpers serve the OpenAI-compatible provider too.
"""

from __future__ import annotations

import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from email.utils import parsedate_to_datetime
from typing import Any, TypeVar

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from sluicegate.gateway.canonical import ChatRequest, Chunk
from sluicegate.gateway.errors import redact
from sluicegate.gateway.providers.base import ProviderError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
SSE_MAX_LINE_BYTES = 8 * 1024 * 1024
"""The longest line of a server-sent-events body. An event is one ``data:`` line, and Gemini
sends a function call whole in one event (a file's contents as an argument can be megabytes);
aiohttp's own limit, twice its 256 KiB read buffer, would fail such a call."""
_CONTEXT_HINTS = ("context length", "context window", "too long", "prompt is too long")
T = TypeVar("T")


def json_headers(
    key_header: str,
    api_key: str | None,
    *,
    prefix: str = "",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """A JSON call's headers, with the deployment's key (after ``prefix``, e.g. ``Bearer ``) in
    ``key_header``; no key header when the deployment has no key."""
    headers = {"content-type": "application/json", **(extra or {})}
    if api_key:
        headers[key_header] = prefix + api_key
    return headers


def with_traceparent(headers: dict[str, str], traceparent: str | None) -> dict[str, str]:
    """``headers`` plus the request's W3C ``traceparent``, for upstreams that join the trace."""
    if traceparent:
        return {**headers, "traceparent": traceparent}
    return headers


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from a ``retry-after`` (or ``retry-after-ms``) header, if there is one."""
    millis = headers.get("retry-after-ms")
    if millis:
        try:
            return max(0.0, float(millis) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def status_error(
    deployment: str,
    status: int,
    message: str,
    headers: Mapping[str, str] | None = None,
    *,
    refused: bool = False,
) -> ProviderError:
    """The ``ProviderError`` for an upstream's non-2xx answer. ``refused``: the upstream said,
    whatever its status, that it refuses this deployment (its key, project or billing)."""
    message = redact(message.strip())[:500]
    if refused or status in {401, 403, 404}:
        logger.warning("deployment %s refused the call (%d): %s", deployment, status, message)
        return ProviderError(
            f"deployment {deployment} refused the gateway's call ({status})",
            retryable=True,
            status_code=502,
        )
    if status == 429 or status == 408 or status >= 500:
        return ProviderError(
            f"deployment {deployment} answered {status}: {message}",
            retryable=True,
            status_code=429 if status == 429 else 502,
            code="rate_limited" if status == 429 else "upstream_error",
            retry_after_s=retry_after(headers) if headers is not None else None,
        )
    if any(hint in message.lower() for hint in _CONTEXT_HINTS):
        return ProviderError(message, status_code=400, code="context_length_exceeded")
    return ProviderError(message, status_code=400, code="invalid_request")


class Sessions:
    """The one aiohttp session every upstream deployment shares (made on first use, inside the
    event loop; closed by the router). ``limit`` 0: no cap on its connections, so a stream
    never queues behind others (a deployment may cap its own: ``max_connections``)."""

    def __init__(self, limit: int = 0, ssl: ssl.SSLContext | bool = True) -> None:
        """``ssl``: the context that verifies upstreams (True: the system's CAs)."""
        self._limit = limit
        self._ssl = ssl
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._limit, ttl_dns_cache=300, ssl=self._ssl)
            self._session = aiohttp.ClientSession(connector=connector, auto_decompress=True)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


Refusal = Callable[[int, bytes], bool]
"""Whether an upstream's error answer (status, body) refuses the deployment itself, for APIs
that say so with a status of their own (Gemini answers a bad key with a 400)."""


TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError, ConnectionError)
"""What a broken or timed-out upstream connection raises while a body is read."""


class StreamedResponse:
    """An open 2xx streamed answer: its body by lines (SSE) or by chunks of bytes."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.headers = response.headers

    async def aiter_lines(self) -> AsyncIterator[str]:
        """The body's lines; a longer one than ``SSE_MAX_LINE_BYTES`` raises ``LineTooLong``."""
        content = self._response.content
        while line := await content.readline(max_line_length=SSE_MAX_LINE_BYTES):
            yield line.decode().rstrip("\r\n")

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        async for data in self._response.content.iter_any():
            yield data


class StreamGuard:
    """One streamed call's failures, mapped alike for every hosted API: each is retryable
    until output reached the client (after that another deployment must not start over)."""

    def __init__(
        self,
        deployment: str,
        unreadable: str = "event",
        decode_errors: tuple[type[Exception], ...] = (ValueError,),
    ) -> None:
        self.deployment = deployment
        self.started = False
        self._unreadable = unreadable
        self._decode_errors = decode_errors

    def saw(self, chunk: Chunk) -> Chunk:
        self.started = self.started or chunk.has_output()
        return chunk

    def upstream_error(self, status: int, message: str) -> ProviderError:
        """An error the upstream reported inside the stream, as if it had answered ``status``."""
        failure = status_error(self.deployment, status, message)
        failure.retryable = failure.retryable and not self.started
        return failure

    def ended_early(self) -> ProviderError:
        return ProviderError(
            f"deployment {self.deployment} ended the stream early", retryable=not self.started
        )

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around the reading of the body: a broken connection or an undecodable event."""
        try:
            yield
        except TRANSPORT_ERRORS as exc:
            raise ProviderError(
                f"deployment {self.deployment} failed mid-stream", retryable=not self.started
            ) from exc
        except LineTooLong as exc:
            # aiohttp's own exception (neither a ClientError nor a ValueError).
            raise ProviderError(
                f"deployment {self.deployment} sent a line longer than "
                f"{SSE_MAX_LINE_BYTES // (1024 * 1024)} MiB",
                retryable=not self.started,
            ) from exc
        except self._decode_errors as exc:
            raise ProviderError(
                f"deployment {self.deployment} sent an unreadable {self._unreadable}",
                retryable=not self.started,
            ) from exc


class HostedClient:
    """One deployment's calls over the shared aiohttp session: plain and TLS, whole and
    streamed (bench/upstream_clients.py: ~5x less CPU per call than httpx)."""

    def __init__(
        self,
        name: str,
        sessions: Sessions,
        read_timeout_s: float,
        refusal: Refusal | None = None,
    ) -> None:
        self.name = name
        self._sessions = sessions
        self._read_timeout_s = read_timeout_s
        self._refusal = refusal

    def _status_error(self, status: int, raw: bytes, headers: Mapping[str, str]) -> ProviderError:
        refused = self._refusal is not None and self._refusal(status, raw)
        return status_error(self.name, status, error_message(raw), headers, refused=refused)

    def _timeout(self, request: ChatRequest) -> aiohttp.ClientTimeout:
        # A whole answer is bounded by the request's deadline, not a first-token timeout.
        budget = request.deadline - time.time() if request.deadline else self._read_timeout_s
        return aiohttp.ClientTimeout(total=max(0.001, budget), sock_connect=CONNECT_TIMEOUT_S)

    def _transport_error(self, exc: BaseException) -> ProviderError:
        kind = "timed out" if isinstance(exc, TimeoutError) else "unreachable"
        logger.warning("deployment %s %s: %s", self.name, kind, type(exc).__name__)
        return ProviderError(f"deployment {self.name} {kind}", retryable=True, status_code=502)

    async def post(
        self, request: ChatRequest, url: str, headers: dict[str, str], body: bytes
    ) -> tuple[bytes, Mapping[str, str]]:
        """The 2xx body of a whole call; a ``ProviderError`` for anything else."""
        try:
            async with self._sessions.get().post(
                url, data=body, headers=headers, timeout=self._timeout(request)
            ) as response:
                content = await response.read()
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from None
        if response.status >= 300:
            raise self._status_error(response.status, content, response.headers)
        return content, response.headers

    @asynccontextmanager
    async def stream(
        self, url: str, headers: dict[str, str], body: bytes, *, deadline: float
    ) -> AsyncIterator[StreamedResponse]:
        """An open streamed response with a 2xx status (the caller reads its body; a failure
        while reading is the caller's to map, as only it knows whether output had started).
        Each read waits at most the read timeout, and the whole stream ends by the request's
        ``deadline``: past it the request's concurrency slot and reservation stop being
        held for it (``sluicegate.gateway.admission.limits``), so its tokens would go uncounted."""
        total = max(0.001, deadline - time.time()) if deadline else None
        timeout = aiohttp.ClientTimeout(
            total=total, sock_connect=CONNECT_TIMEOUT_S, sock_read=self._read_timeout_s
        )
        try:
            response = await self._sessions.get().post(
                url, data=body, headers=headers, timeout=timeout
            )
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from None
        try:
            if response.status >= 300:
                try:
                    raw = await response.read()
                except TRANSPORT_ERRORS as exc:
                    raise self._transport_error(exc) from None
                raise self._status_error(response.status, raw, response.headers)
            yield StreamedResponse(response)
        finally:
            response.release()


class HostedProvider:
    """What every hosted deployment shares: its name and model, its calls over the router's
    aiohttp session, whole answers read the same way."""

    def __init__(
        self,
        name: str,
        model: str,
        sessions: Sessions,
        read_timeout_s: float,
        refusal: Refusal | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self._http = HostedClient(name, sessions, read_timeout_s, refusal)

    async def _answer(
        self,
        request: ChatRequest,
        url: str,
        headers: dict[str, str],
        body: bytes,
        read: Callable[[Any], T],
    ) -> T:
        """``read`` of the JSON of a whole 2xx answer; retryable when it cannot be read."""
        raw, _ = await self._http.post(request, url, headers, body)
        try:
            return read(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise ProviderError(
                f"deployment {self.name} sent an unreadable answer", retryable=True
            ) from exc

    async def is_available(self) -> bool:
        return True

    async def close(self) -> None:
        """Nothing of its own: the aiohttp session is the router's."""


def error_message(raw: bytes) -> str:
    """The human part of an upstream's error body, whichever hosted API sent it."""
    try:
        body = json.loads(raw)
    except ValueError:
        return raw[:300].decode(errors="replace")
    if isinstance(body, list) and body:
        body = body[0]
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return raw[:300].decode(errors="replace")


async def sse_events(response: StreamedResponse) -> AsyncIterator[tuple[str, str]]:
    """``(event, data)`` pairs of a server-sent-events body (event is "" when unnamed)."""
    event, data = "", []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield event, "\n".join(data)
