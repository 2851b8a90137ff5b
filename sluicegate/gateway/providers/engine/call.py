"""One engine request's progress as the provider relays it, and the errors it ends with.

``EngineCall`` tracks who serves the request, what reached the client (to resume after it, or
to bill a failure) and which choices ended; ``accept`` turns a worker's delta into a chunk.
"""

from __future__ import annotations

from typing import Any

from sluicegate.engine import protocol
from sluicegate.gateway.canonical import Chunk, Usage
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.engine.wire import choice_delta

REDIS_TIMEOUT_S = 2.0
"""How long one Redis command of the provider may take."""
MOMENTARY = frozenset({"service_unavailable", "no_worker_available"})
"""Failures of the moment, not of the deployment (see ``ProviderError.counts_toward_cooldown``)."""


class EngineCall:
    """One request's progress: who serves it, what reached the client, how to bill a failure."""

    def __init__(self, request_id: str, deadline: float, choices: int = 1) -> None:
        self.request_id = request_id
        self.deadline = deadline
        self.choices = choices
        self.ended: set[int] = set()
        """Choices that have their final delta; the request is over when all have."""
        self.entry: tuple[str, Any] | None = None
        self.worker_id: str | None = None
        self.counted_on = ""
        """The worker whose outstanding count includes this request."""
        self.first_delta = True
        self.next_seq = 0
        self.prompt_tokens = 0
        self.delivered = 0
        self.unshown = 0
        self.shown = False
        self.finished = False
        self.token_ids: list[int] = []
        """Every token received, in order: what a resumption continues after."""
        self.attempts = 0
        """Resumptions so far (each one a new engine request id)."""
        self.attempt_shown = False
        self.transport_down_since: float | None = None
        self._base = (0, 0)
        """(delivered, unshown) when the current attempt began."""

    def start_attempt(self) -> None:
        self.worker_id = None
        self.next_seq = 0
        self.attempt_shown = False
        self._base = (self.delivered, self.unshown)

    def accept(self, delta: protocol.Delta) -> Chunk | None:
        if delta.worker_id != self.worker_id:
            if self.attempt_shown:
                return None  # a second worker took over a request the first was still serving
            # Nothing of this attempt was shown yet, so another worker may take it over.
            self.worker_id = delta.worker_id
            self.next_seq = 0
            self.delivered, self.unshown = self._base
            self.ended.clear()
            del self.token_ids[self.delivered :]
        if delta.seq < self.next_seq:
            return None
        if delta.seq > self.next_seq:
            raise self.error(502, "worker_lost", "Part of the engine's reply was lost.")
        self.next_seq += 1
        if delta.usage is not None:
            self.prompt_tokens = delta.usage.prompt_tokens
        self.delivered += len(delta.token_ids)
        self.token_ids.extend(delta.token_ids)
        # A token whose text the detokenizer holds back (part of a UTF-8 character) travels
        # with the next chunk that has text, so counting chunks' tokens counts what was shown.
        self.unshown += len(delta.token_ids)
        usage = None
        if delta.finish_reason is not None:
            self.ended.add(delta.index)
            self.finished = len(self.ended) >= self.choices
            cached = delta.usage.cached_tokens if delta.usage else 0
            usage = Usage(self.prompt_tokens, self.delivered, cached)
        elif not (delta.text or delta.reasoning_text or delta.tool_calls or delta.logprobs):
            return None
        self.shown = self.attempt_shown = True
        chunk = Chunk(
            [choice_delta(delta)],
            usage=usage,
            num_tokens=self.unshown,
            prompt_tokens=self.prompt_tokens,
        )
        self.unshown = 0
        return chunk

    def error(self, status: int, code: str, message: str, retryable: bool = False) -> ProviderError:
        self.finished = code != "timeout" and code not in MOMENTARY
        return ProviderError(
            message,
            retryable=retryable or (not self.shown and status in {503, 504}),
            status_code=status,
            code=code,
            usage=Usage(self.prompt_tokens, self.delivered - self.unshown),
            counts_toward_cooldown=code not in MOMENTARY,
        )


class WorkerLost(Exception):
    """The worker serving an attempt that had streamed text is gone: resume elsewhere."""


def redis_down(exc: BaseException) -> ProviderError:
    return ProviderError(
        f"The engine transport (Redis) is unavailable: {exc or type(exc).__name__}",
        retryable=True,
        status_code=503,
        code="service_unavailable",
        counts_toward_cooldown=False,
    )


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)
