"""Any OpenAI-compatible HTTP upstream (vLLM, a hosted API, another gateway).

The request body and the replies are OpenAI's own (see openai_wire.py: a client's OpenAI body
goes upstream field for field, and its reply comes back whole in ``raw``). Streams are passed
through chunk by chunk; a non-streaming client request is answered with one non-streaming
upstream call (``complete``). To a plain-``http://`` upstream both go through ``Http1Pool``, a
minimal keep-alive client (see http1.py); to ``https://`` over the router's aiohttp session
(``hosted.Sessions``, shared by every deployment). Neither caps connections: a stream never
waits for another to end unless its deployment says so (``max_connections`` in the routing
file).

Failures map onto ``ProviderError``: connect errors, timeouts, 5xx and 429 (and 401/403/404,
which mean this deployment is misconfigured) are ``retryable`` so the router may fall back;
a 400 is the client's fault and is passed on, with ``context_length_exceeded`` recognised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp
import msgspec
from aiohttp.http_exceptions import LineTooLong

from sluicegate.gateway.canonical import ChatRequest, Chunk, Response, Usage
from sluicegate.gateway.errors import redact
from sluicegate.gateway.providers.base import ProviderError, unsupported_field
from sluicegate.gateway.providers.hosted import (
    TRANSPORT_ERRORS,
    Sessions,
    json_headers,
    with_traceparent,
)
from sluicegate.gateway.providers.http1 import Http1Pool
from sluicegate.gateway.providers.http1_answer import UpstreamConnectionError
from sluicegate.gateway.providers.openai_wire import (
    Reply,
    choice_delta,
    reply_decoder,
    request_body,
    response,
)
from sluicegate.gateway.providers.sse_lines import Body, LineReader

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0

_CONTEXT_HINTS = ("maximum context length", "context length", "context_length_exceeded")
_RETRYABLE_STATUS = {401, 403, 404, 408, 409, 429}

_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder()


class _Param(msgspec.Struct):
    param: str | None = None


class _ErrorWithParam(msgspec.Struct):
    error: _Param | None = None


_param_decoder = msgspec.json.Decoder(_ErrorWithParam)


def _error_from_response(status: int, raw: bytes, deployment: str) -> ProviderError:
    try:
        error = reply_decoder.decode(raw).error
        param = (_param_decoder.decode(raw).error or _Param()).param
    except (msgspec.DecodeError, msgspec.ValidationError):
        error, param = None, None
    # What an upstream says may name where it lives (a proxy's "cannot reach 10.0.0.7:8000")
    # or echo a key: the client, the logs and the fallback's last error get it redacted.
    message = redact((error.message if error else "") or raw[:300].decode(errors="replace"))
    code = str(error.code) if error and error.code is not None else ""
    if status == 400 and (
        code == "context_length_exceeded" or any(h in message.lower() for h in _CONTEXT_HINTS)
    ):
        return ProviderError(message, status_code=400, code="context_length_exceeded")
    if status in {401, 403}:
        # What an upstream says about our credentials (often the key, partly masked) is for
        # the operator's log, not for the client.
        logger.warning(
            "deployment %s refused our credentials (%d): %s", deployment, status, message
        )
        return ProviderError(
            f"deployment {deployment} refused the gateway's credentials ({status})",
            retryable=True,
            status_code=502,
        )
    if status >= 500 or status in _RETRYABLE_STATUS:
        return ProviderError(
            f"deployment {deployment} answered {status}: {message}",
            retryable=True,
            status_code=502,
        )
    return ProviderError(message, status_code=400, code="invalid_request", param=param)


class _StreamBody(Body, Protocol):
    """aiohttp's ``StreamReader`` or ``http1_answer.Answer``."""

    async def read(self) -> bytes: ...


class OpenAIProvider:
    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        model: str,
        sessions: Sessions,
        api_key: str | None = None,
        read_timeout_s: float = 60.0,
        first_token_timeout_s: float = 60.0,
        max_connections: int = 0,
    ) -> None:
        """``read_timeout_s`` bounds a whole answer without a deadline; ``first_token_timeout_s``
        each read of a stream; ``max_connections`` (0: no cap) the calls in flight at once."""
        self.name = name
        self.model = model
        self._sessions = sessions
        self._base_url = base_url.rstrip("/")
        self._headers = json_headers("authorization", api_key, prefix="Bearer ")
        url = urlsplit(self._base_url)
        self._read_timeout_s = read_timeout_s
        self._first_token_timeout_s = first_token_timeout_s
        self._slots = asyncio.Semaphore(max_connections) if max_connections > 0 else None
        self._fast: Http1Pool | None = None
        if url.scheme == "http" and url.hostname:
            self._fast = Http1Pool(
                url.hostname,
                url.port or 80,
                connect_timeout_s=CONNECT_TIMEOUT_S,
                read_timeout_s=read_timeout_s,
            )
        self._path = url.path

    async def _post(
        self, path: str, body: bytes, traceparent: str | None, deadline: float
    ) -> tuple[int, bytes]:
        headers = with_traceparent(self._headers, traceparent)
        try:
            async with self._slot():
                if self._fast is not None:
                    return await self._fast.post(self._path + path, body, headers)
                # The whole answer comes in one read: bounded by the request's deadline, not by
                # a first-token timeout (a long generation is not a dead peer).
                timeout = aiohttp.ClientTimeout(
                    total=self._read_timeout(deadline), sock_connect=CONNECT_TIMEOUT_S
                )
                async with self._sessions.get().post(
                    self._base_url + path, data=body, headers=headers, timeout=timeout
                ) as response:
                    return response.status, await response.read()
        except TimeoutError as exc:
            _log_transport("timed out", self.name, exc)
            raise ProviderError(
                f"deployment {self.name} timed out", retryable=True, status_code=502
            ) from exc
        except (*TRANSPORT_ERRORS, UpstreamConnectionError) as exc:
            _log_transport("unreachable", self.name, exc)
            raise ProviderError(
                f"deployment {self.name} unreachable", retryable=True, status_code=502
            ) from exc

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of the deployment's ``max_connections`` while a call is in flight."""
        if self._slots is None:
            yield
            return
        async with self._slots:
            yield

    def _read_timeout(self, deadline: float) -> float:
        if deadline:
            return max(0.001, deadline - time.time())
        return self._read_timeout_s

    def _read(self, status: int, content: bytes) -> tuple[Reply, dict[str, Any]]:
        if status >= 400:
            raise _error_from_response(status, content, self.name)
        try:
            return reply_decoder.decode(content), _json_decoder.decode(content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProviderError(
                f"deployment {self.name} sent an unreadable body: {exc}", retryable=True
            ) from exc

    async def complete(self, request: ChatRequest) -> Response:
        """The whole answer, canonical, with the upstream's own body in ``raw``."""
        body = _encoder.encode(request_body(request, self.model, stream=False))
        status, content = await self._post(
            _path(request), body, request.traceparent, request.deadline
        )
        parsed, raw = self._read(status, content)
        if parsed.error is not None or not parsed.choices:
            message = parsed.error.message if parsed.error else "no choices in the answer"
            raise ProviderError(f"deployment {self.name}: {message}", retryable=True)
        return response(parsed, raw)

    @contextlib.asynccontextmanager
    async def _streamed(
        self, request: ChatRequest, body: bytes
    ) -> AsyncIterator[tuple[int, _StreamBody]]:
        """The stream's status and body. Each read waits at most the first-token timeout; the
        whole stream ends by the request's deadline (past it the request's slot and
        reservation are no longer held)."""
        headers = with_traceparent(self._headers, request.traceparent)
        deadline = request.deadline
        async with self._slot():
            if self._fast is not None:
                async with self._fast.stream(
                    self._path + _path(request),
                    body,
                    headers,
                    idle_timeout_s=self._first_token_timeout_s,
                    deadline=deadline,
                ) as answer:
                    yield answer.status, answer
                return
            timeout = aiohttp.ClientTimeout(
                total=max(0.001, deadline - time.time()) if deadline else None,
                sock_connect=CONNECT_TIMEOUT_S,
                sock_read=self._first_token_timeout_s,
            )
            async with self._sessions.get().post(
                self._base_url + _path(request), data=body, headers=headers, timeout=timeout
            ) as reply:
                yield reply.status, reply.content

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        body = _encoder.encode(request_body(request, self.model, stream=True))
        relay = request.passthrough is not None
        started = False
        deadline = request.deadline
        try:
            async with self._streamed(request, body) as (status, content):
                if status >= 400:
                    raise _error_from_response(status, await content.read(), self.name)
                reader = LineReader(content)
                while lines := await reader.lines():
                    if deadline and time.time() > deadline:
                        # Reads are bounded one by one; this bounds the whole stream (past
                        # its deadline the request's slot and reservation are no longer held).
                        raise ProviderError(
                            f"deployment {self.name} passed the request's deadline",
                            retryable=not started,
                            status_code=504,
                        )
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            return
                        parsed = reply_decoder.decode(data)
                        if parsed.error is not None:
                            raise ProviderError(
                                f"deployment {self.name}: {parsed.error.message}",
                                retryable=not started,
                            )
                        chunk = Chunk(
                            [choice_delta(c) for c in parsed.choices],
                            usage=parsed.canonical_usage(),
                            raw=_json_decoder.decode(data) if relay else None,
                        )
                        if chunk.has_output():
                            started = True
                            chunk.num_tokens = 1
                        yield chunk
        except TRANSPORT_ERRORS as exc:
            if deadline and time.time() >= deadline:
                raise ProviderError(
                    f"deployment {self.name} passed the request's deadline",
                    retryable=not started,
                    status_code=504,
                ) from exc
            _log_transport("failed mid-stream", self.name, exc)
            raise ProviderError(
                f"deployment {self.name} failed", retryable=not started, status_code=502
            ) from exc
        except (msgspec.DecodeError, msgspec.ValidationError, LineTooLong) as exc:
            raise ProviderError(
                f"deployment {self.name} sent an unreadable chunk: {exc}", retryable=not started
            ) from exc

    async def embed(
        self, body: dict[str, Any], traceparent: str | None, deadline: float
    ) -> tuple[dict[str, Any], Usage | None]:
        """``POST /embeddings`` with the client's body (``model`` rewritten)."""
        payload = _encoder.encode({**body, "model": self.model})
        status, content = await self._post("/embeddings", payload, traceparent, deadline)
        parsed, raw = self._read(status, content)
        if parsed.error is not None or not isinstance(raw.get("data"), list):
            message = parsed.error.message if parsed.error else "no data in the answer"
            raise ProviderError(f"deployment {self.name}: {message}", retryable=True)
        return raw, parsed.canonical_usage()

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        thinking = request.thinking
        if thinking is not None and thinking.type != "disabled" and thinking.display is not None:
            # OpenAI-compatible servers return reasoning as written, with no switch for it.
            return unsupported_field(
                "thinking.display",
                f"The model '{request.model}' returns its thinking as written, neither "
                "summarized nor left out; leave out 'thinking.display'.",
            )
        return None

    async def is_available(self) -> bool:
        return True

    async def close(self) -> None:
        """Closes this deployment's keep-alive pool; the shared aiohttp session is the router's."""
        if self._fast is not None:
            await self._fast.aclose()


def _log_transport(what: str, deployment: str, exc: BaseException) -> None:
    """A transport failure, by the deployment's name and the exception's type: its text names
    the upstream's host and port, which stay out of INFO/WARNING logs (DEBUG has them)."""
    cause = exc.__cause__
    kind = type(exc).__name__ + (f" ({type(cause).__name__})" if cause is not None else "")
    logger.warning("deployment %s %s: %s", deployment, what, kind)
    logger.debug("deployment %s %s: %r", deployment, what, exc)


def _path(request: ChatRequest) -> str:
    return "/chat/completions" if request.messages is not None else "/completions"
