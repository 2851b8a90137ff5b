"""Messages between the worker process and the engine core process, msgpack-encoded by
msgspec into typed values (the engine's own dataclasses travel as they are).

Worker -> core: ``AddRequest`` (prompt already tokenized), ``AbortRequest``, ``Shutdown``,
``ControlCommand`` (load or unload a LoRA adapter).
Core -> worker: ``Ready`` once the model is loaded, then ``StepOutput`` after every step or
batch of commands (deltas, rejected requests, fresh scheduler stats, the prefix cache's changes), ``CoreFailed`` when the
core cannot go on."""

from __future__ import annotations

from typing import Any

import msgspec

from sluicegate.engine.kv_events.messages import KvEvent
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.engine.serving.request_delta import RequestDelta
from sluicegate.engine.serving.request_options import RequestOptions


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    options: RequestOptions
    chat: bool = False
    resume_token_ids: list[int] | None = None


class AbortRequest(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class ControlCommand(msgspec.Struct, tag="control", array_like=True):
    """Load the LoRA adapter ``name`` from ``path``, or unload it (``path`` None)."""

    token: int
    name: str
    path: str | None = None


class ControlDone(msgspec.Struct, array_like=True):
    token: int
    error: str | None = None
    """Why the command failed; None: done."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Ready(msgspec.Struct, tag="ready", array_like=True):
    vocab_size: int
    stats: dict[str, Any]


class RequestFailed(msgspec.Struct, array_like=True):
    request_id: str
    message: str
    kind: str
    """"rejected" (``RequestRejected``: never fits here), "invalid" (another ``ValueError``,
    e.g. a grammar that does not compile) or "failed" (the engine failed)."""


class StepOutput(msgspec.Struct, tag="out", array_like=True):
    deltas: list[RequestDelta]
    failed: list[RequestFailed]
    stats: dict[str, Any]
    added: int
    """``AddRequest`` messages the core took in since its previous output."""
    replies: list[ControlDone] = msgspec.field(default_factory=list)
    """The ``ControlCommand``s done since its previous output."""
    kv_events: list[KvEvent] = msgspec.field(default_factory=list)
    """The prefix cache's changes in this step (with ``EngineOptions.kv_events``)."""


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


ToCore = AddRequest | AbortRequest | Shutdown | ControlCommand
FromCore = Ready | StepOutput | CoreFailed

encoder = msgspec.msgpack.Encoder()
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)
