"""Any OpenAI-compatible HTTP upstream (vLLM, a hosted API, another gateway) over httpx.

Streams are passed through chunk by chunk with httpx (its client is shared by every deployment
and owned by the router). A non-streaming client request is answered with one non-streaming
upstream call (``complete``); to a plain-``http://`` upstream that call goes through
``Http1Pool``, a minimal keep-alive client ~40x cheaper than httpx per call (see http1.py).

Failures map onto ``ProviderError``: connect errors, timeouts, 5xx and 429 (and 401/403/404,
which mean this deployment is misconfigured) are ``retryable`` so the router may fall back;
a 400 is the client's fault and is passed on, with ``context_length_exceeded`` recognised.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from gateway.canonical import (
    ChatRequest,
    Choice,
    ChoiceDelta,
    Chunk,
    Message,
    Response,
    TextPart,
    Usage,
)
from gateway.providers.base import ProviderError
from gateway.providers.http1 import Http1Pool, UpstreamConnectionError

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0

_CONTEXT_HINTS = ("maximum context length", "context length", "context_length_exceeded")
_RETRYABLE_STATUS = {401, 403, 404, 408, 409, 429}


class _Message(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    delta: _Message | None = None
    message: _Message | None = None
    text: str | None = None
    finish_reason: str | None = None

    def content(self) -> str:
        part = self.delta or self.message
        return (part.content if part else self.text) or ""


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Error(msgspec.Struct):
    message: str = ""
    type: str | None = None
    code: str | int | None = None


class _Body(msgspec.Struct):
    """A completion, a stream chunk or an error: every shape we read from an upstream."""

    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: _Error | None = None


_decoder = msgspec.json.Decoder(_Body)
_encoder = msgspec.json.Encoder()


def _payload(request: ChatRequest, model: str, stream: bool) -> dict[str, Any]:
    s = request.sampling
    body: dict[str, Any] = {"model": model}
    if request.messages is not None:
        body["messages"] = [
            {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
            for m in request.messages
        ]
    else:
        body["prompt"] = request.prompt
    body["max_tokens"] = s.max_tokens
    body["temperature"] = 1.0 if s.temperature is None else s.temperature
    body["top_p"] = 1.0 if s.top_p is None else s.top_p
    optional = {
        "stop": s.stop,
        "seed": s.seed,
        "presence_penalty": s.presence_penalty or None,
        "frequency_penalty": s.frequency_penalty or None,
        "user": request.user,
        # vLLM's extras: only when set, since hosted APIs reject unknown fields.
        "top_k": s.top_k if s.top_k is not None and s.top_k > 0 else None,
        "min_p": s.min_p or None,
        "repetition_penalty": s.repetition_penalty
        if s.repetition_penalty not in (None, 1.0)
        else None,
        "ignore_eos": s.ignore_eos or None,
        "stop_token_ids": s.stop_token_ids,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _error_from_response(status: int, raw: bytes, deployment: str) -> ProviderError:
    try:
        error = _decoder.decode(raw).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        error = None
    message = (error.message if error else "") or raw[:300].decode(errors="replace")
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
    return ProviderError(message, status_code=400, code="invalid_request")


def _usage(body: _Body) -> Usage | None:
    if body.usage is None:
        return None
    return Usage(body.usage.prompt_tokens, body.usage.completion_tokens)


class OpenAIProvider:
    def __init__(
        self,
        *,
        name: str,
        base_url: str,
        model: str,
        client: httpx.AsyncClient,
        api_key: str | None = None,
        read_timeout_s: float = 60.0,
    ) -> None:
        self.name = name
        self.model = model
        self._client = client
        self._base_url = base_url.rstrip("/")
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        url = urlsplit(self._base_url)
        self._read_timeout_s = read_timeout_s
        self._fast: Http1Pool | None = None
        if url.scheme == "http" and url.hostname:
            self._fast = Http1Pool(
                url.hostname,
                url.port or 80,
                connect_timeout_s=CONNECT_TIMEOUT_S,
                read_timeout_s=read_timeout_s,
            )
        self._path = url.path

    def _url(self, request: ChatRequest) -> str:
        path = "/chat/completions" if request.messages is not None else "/completions"
        return self._base_url + path

    def _headers_for(self, request: ChatRequest) -> dict[str, str]:
        if request.traceparent:
            return {**self._headers, "traceparent": request.traceparent}
        return self._headers

    async def _post(self, request: ChatRequest, body: bytes) -> tuple[int, bytes]:
        headers = self._headers_for(request)
        try:
            if self._fast is not None:
                path = self._path + (
                    "/chat/completions" if request.messages is not None else "/completions"
                )
                return await self._fast.post(path, body, headers)
            # The whole answer comes in one read: bounded by the request's deadline, not by
            # the shared client's first-token timeout (a long generation is not a dead peer).
            response = await self._client.post(
                self._url(request),
                content=body,
                headers=headers,
                timeout=httpx.Timeout(self._read_timeout(request), connect=CONNECT_TIMEOUT_S),
            )
            return response.status_code, response.content
        except (httpx.TimeoutException, TimeoutError) as exc:
            logger.warning("deployment %s timed out: %r", self.name, exc)
            raise ProviderError(
                f"deployment {self.name} timed out", retryable=True, status_code=502
            ) from exc
        except (httpx.TransportError, UpstreamConnectionError) as exc:
            logger.warning("deployment %s unreachable: %r", self.name, exc)
            raise ProviderError(
                f"deployment {self.name} unreachable", retryable=True, status_code=502
            ) from exc

    def _read_timeout(self, request: ChatRequest) -> float:
        if request.deadline:
            return max(0.001, request.deadline - time.time())
        return self._read_timeout_s

    async def complete(self, request: ChatRequest) -> Response:
        """The whole answer as one chunk (text, finish_reason, usage)."""
        body = _encoder.encode(_payload(request, self.model, stream=False))
        status, content = await self._post(request, body)
        if status >= 400:
            raise _error_from_response(status, content, self.name)
        try:
            parsed = _decoder.decode(content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProviderError(
                f"deployment {self.name} sent an unreadable body: {exc}", retryable=True
            ) from exc
        if parsed.error is not None or not parsed.choices:
            message = parsed.error.message if parsed.error else "no choices in the answer"
            raise ProviderError(f"deployment {self.name}: {message}", retryable=True)
        choice = parsed.choices[0]
        message = Message("assistant", [TextPart(choice.content())])
        return Response([Choice(0, message, choice.finish_reason or "stop")], _usage(parsed))

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        body = _encoder.encode(_payload(request, self.model, stream=True))
        started = False
        finish_reason: str | None = None
        usage: Usage | None = None
        try:
            async with self._client.stream(
                "POST", self._url(request), content=body, headers=self._headers_for(request)
            ) as response:
                if response.status_code >= 400:
                    raw = await response.aread()
                    raise _error_from_response(response.status_code, raw, self.name)
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    parsed = _decoder.decode(data)
                    if parsed.error is not None:
                        raise ProviderError(
                            f"deployment {self.name}: {parsed.error.message}",
                            retryable=not started,
                        )
                    usage = _usage(parsed) or usage
                    for choice in parsed.choices[:1]:
                        finish_reason = choice.finish_reason or finish_reason
                        text = choice.content()
                        if text:
                            started = True
                            yield Chunk([ChoiceDelta(text=text)], num_tokens=1)
        except httpx.TransportError as exc:
            logger.warning("deployment %s failed mid-stream: %r", self.name, exc)
            raise ProviderError(
                f"deployment {self.name} failed", retryable=not started, status_code=502
            ) from exc
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProviderError(
                f"deployment {self.name} sent an unreadable chunk: {exc}", retryable=not started
            ) from exc
        yield Chunk([ChoiceDelta(finish_reason=finish_reason or "stop")], usage=usage)

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        return None

    async def is_available(self) -> bool:
        return True

    async def close(self) -> None:
        """Closes this deployment's keep-alive pool; the shared httpx client is the router's."""
        if self._fast is not None:
            await self._fast.aclose()
