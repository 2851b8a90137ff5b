"""Wire messages between the gateway and engine workers, carried over Redis Streams.

Torch-free on purpose: the gateway imports this module and must never load torch.
Every message carries ``v``, the protocol version of its writer, always on the wire (even
though the structs omit other fields at their defaults). Readers accept any version up to
their own and ignore unknown fields, so old and new workers can coexist in a rollout. A
message without ``v`` comes from a writer before version 4, which left ``v`` out whenever it
equalled its own version, so it could be any of 1 to 3: readers take it as ``LEGACY_VERSION``
(1), the one version nothing is gated on, so such a peer never gets what it may not read
(a ``Batch`` reply, say).

Where each message goes (the Redis streams, channels and keys): ``redis_names``.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any, Literal, TypeVar

import msgspec

from sluicegate.engine import redis_names

PROTOCOL_VERSION = 6
"""2: a worker may pack the replies of one step for one reply stream into a ``Batch``; it does
so only for requests whose ``v`` is at least 2, so version-1 gateways keep getting single
messages.
3: tools, structured output, logprobs, ``n`` choices and reasoning text; every new field has a
default, so a version-2 request is a valid version-3 request.
4: ``v`` is always on the wire (before, it was omitted when it equalled the writer's version,
so a reader took every such message for its own version and version gating did nothing).
5: ``Delta.produced``, the request's output tokens so far, so a reaper can bill a dead gateway
replica's stream from the deltas it had read (a default: older readers ignore it).
6: LoRA adapters: ``Request.lora``, the heartbeat's ``max_loras``/``max_lora_rank``/``loras``
and the per-worker control stream. A gateway sends a request with ``lora`` only to a worker
whose heartbeat has ``max_loras > 0``, on that worker's own stream, because an older worker
would ignore the field and answer from the base model."""
LORA_VERSION = 6
BATCH_VERSION = 2
LEGACY_VERSION = 1
"""What a message without ``v`` reads as: its writer predates version 4 and could be any
version from 1 up, so readers assume the oldest."""

_decoding: contextvars.ContextVar[bool] = contextvars.ContextVar("_decoding", default=False)


def writer_version() -> int:
    """``v``'s default: the writer's own version for a message built here, ``LEGACY_VERSION``
    for one decoded without ``v``. A default factory, because ``omit_defaults`` never omits a
    field whose default comes from one (only empty containers), so ``v`` is always encoded."""
    return LEGACY_VERSION if _decoding.get() else PROTOCOL_VERSION


class Sampling(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """Sampling parameters as they travel; mirrors ``sluicegate.engine.SamplingParams``."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """None: no logprobs; k in 0..20: the sampled token's logprob and the k most likely."""
    logit_bias: dict[int, float] | None = None


class ToolCall(msgspec.Struct, omit_defaults=True):
    """A call made by an earlier assistant turn, rendered back through the chat template."""

    id: str
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class Tool(msgspec.Struct, omit_defaults=True):
    """A function the model may call."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """JSON Schema of the arguments."""
    strict: bool = False


StructuredKind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class Structured(msgspec.Struct, omit_defaults=True):
    """Grammar-constrained output."""

    kind: StructuredKind
    json_schema: str | None = None
    """JSON text of the schema (kind ``json_schema``)."""
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    """EBNF (kind ``grammar``)."""
    strict: bool = False


BATCH_PRIORITY = 1000
"""The priority of Batch API lines on our engines (interactive requests have 0)."""


class LoraAdapter(msgspec.Struct, omit_defaults=True):
    """A LoRA adapter (peft's folder: ``adapter_config.json`` + ``adapter_model.safetensors``)
    on the base model a worker serves. ``path`` is on the workers' filesystem, so a worker that
    does not hold the adapter yet loads it from there."""

    name: str
    path: str


class Request(msgspec.Struct, tag="request", omit_defaults=True):
    """One generation request. Exactly one of ``prompt``, ``prompt_token_ids``, ``messages``."""

    request_id: str
    model: str
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    deadline: float = 0.0
    """Unix time after which the worker must not start (or continue) the request; 0 = none."""
    traceparent: str | None = None
    reply_to: str = ""
    """Stream the deltas go to; defaults to ``redis_names.reply_stream(request_id)``."""
    n: int = 1
    tools: list[Tool] | None = None
    tool_choice: str = "auto"
    """One of ``"none"``, ``"auto"``, ``"required"``, ``"function"``."""
    tool_choice_name: str | None = None
    """The function to call when ``tool_choice`` is ``"function"``."""
    parallel_tool_calls: bool = True
    structured: Structured | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra chat-template variables, e.g. ``{"enable_thinking": False}``."""
    resume_token_ids: list[int] | None = None
    """Output tokens an earlier attempt already streamed (its worker died): the worker goes on
    after them exactly as the uninterrupted request would (same seeded draws, penalties and
    stop checks). They count toward ``sampling.max_tokens`` and deltas carry only new tokens;
    their text (answer, reasoning, tool calls) is what the stream delivered, one delta per
    token, so the worker re-derives where that delivery stopped and goes on from there."""
    count_only: bool = False
    """Only count the prompt's tokens, rendered as a generation would render it (chat template,
    tools): the worker answers one final delta whose ``usage`` has them and no completion
    tokens, and schedules nothing. A worker that predates the field generates instead, up to
    ``sampling.max_tokens`` (the gateway sends 1), and its usage has the same prompt count."""
    priority: int = 0
    """vLLM's ``priority``: lower runs first. Waiting requests are admitted in order of it
    (first come, first served within one value), and a running one of a higher value is
    preempted to admit a lower one that has no room; the gateway's batch traffic uses
    ``BATCH_PRIORITY``, so it runs only in the capacity interactive requests leave."""
    lora: LoraAdapter | None = None
    """Run with this adapter on the base model (``None``: the base model alone). A worker
    without LoRA enabled answers ``invalid_request``; never the base model's tokens."""
    v: int = msgspec.field(default_factory=writer_version)

    def reply_key(self) -> str:
        return self.reply_to or redis_names.reply_stream(self.request_id)

    def expired(self, now: float | None = None) -> bool:
        return self.deadline > 0 and (now if now is not None else time.time()) > self.deadline


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


class TopLogprob(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob]


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """An OpenAI-style streamed tool-call fragment: the first of a call carries ``id`` and
    ``name``, later ones pieces of the arguments JSON text."""

    index: int
    """Position of the call within its choice."""
    id: str | None = None
    name: str | None = None
    arguments: str = ""


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class Delta(msgspec.Struct, tag="delta", omit_defaults=True):
    """Incremental output. The last delta of a request has ``finish_reason`` and ``usage``;
    the first one carries ``usage`` too (prompt tokens known so far), so a reader can bill a
    request that fails midway."""

    request_id: str
    seq: int
    """Position of this delta in the reply stream, from 0, so a reader can detect gaps."""
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    worker_id: str = ""
    index: int = 0
    """Choice index (``n`` > 1); each choice ends with its own ``finish_reason``, and ``usage``
    on a final delta is cumulative for the whole request (prompt counted once)."""
    stop_sequence: str | None = None
    """On a final delta: the client's stop string that ended the choice, if one did."""
    reasoning_text: str = ""
    """Thinking text, never mixed into ``text``."""
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    """One per token of this delta's content (and reasoning)."""
    produced: int = 0
    """Output tokens of the whole request up to and including this delta: every choice's, and
    the ``resume_token_ids`` an earlier attempt streamed. A reaper bills a dead gateway
    replica's stream by the latest one it had read (``sluicegate.gateway.leases.reaper``); 0 from a worker
    before version 5."""
    v: int = msgspec.field(default_factory=writer_version)


ErrorCode = Literal[
    "invalid_request",
    "context_length_exceeded",
    "deadline_exceeded",
    "worker_lost",
    "internal_error",
    "overloaded",
]


class Error(msgspec.Struct, tag="error", omit_defaults=True):
    """Terminal failure of a request. ``usage`` counts only tokens already delivered."""

    request_id: str
    code: ErrorCode
    message: str
    usage: Usage | None = None
    worker_id: str = ""
    v: int = msgspec.field(default_factory=writer_version)


class Cancel(msgspec.Struct, tag="cancel"):
    request_id: str
    v: int = msgspec.field(default_factory=writer_version)


class Heartbeat(msgspec.Struct, tag="heartbeat", omit_defaults=True):
    worker_id: str
    model: str
    served_model_name: str
    version: str
    time: float
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    tokens_per_s: float = 0.0
    max_model_len: int = 0
    block_size: int = 16
    draining: bool = False
    """Shutting down: finishing what it holds, pulling nothing new."""
    thinking: bool = False
    """The checkpoint's chat template has a thinking mode (``<think>`` blocks)."""
    queue_ms: float = 0.0
    """How long a request arriving at ``time`` would wait for its first token, estimated from
    the requests ahead of it against free running slots, free KV blocks and the recent finish
    rate, from the prompt tokens ahead against the step budget and the recent step time, and
    never less than the queue's head had waited (``sluicegate.engine.worker.queue_estimate``; 0: no
    queue, a slot and KV room free), so a gateway can send a burst's excess elsewhere
    (spill-over). Older workers sent the head's wait alone; it reads the same way."""
    spec_acceptance_rate: float = 0.0
    """Share of speculative draft tokens the model accepted since the worker started (0:
    speculative decoding off, or nothing proposed yet)."""
    tensor_parallel_size: int = 1
    dtype: str = ""
    """The model's activation dtype (``bfloat16``...); empty from a worker before version 6."""
    weight_dtype: str = ""
    """How the weights are held: the dtype, or ``fp8`` / ``int4`` for a quantized checkpoint."""
    kv_cache_dtype: str = ""
    max_loras: int = 0
    """Adapters one step can mix (``--max-loras``); 0: LoRA off, never send it ``lora``."""
    max_lora_rank: int = 0
    loras: list[str] = msgspec.field(default_factory=list)
    """Names of the adapters the worker holds (in a step slot or in host memory), so routing
    prefers it for them; any LoRA worker can load others from their path."""
    kv_events: bool = False
    """The worker publishes its prefix cache's changes (``kv_events_stream``): a gateway may
    route by the blocks it holds. False from older workers, and with ``--no-kv-events``."""
    tokenizer_digest: str = ""
    """Names the ``TokenizerFiles`` this worker published (``tokenizer_key``); empty: none (a
    slow tokenizer, or no KV events), so a gateway cannot compute its block hashes."""
    v: int = msgspec.field(default_factory=writer_version)


class Batch(msgspec.Struct, tag="batch"):
    """Replies of one engine step that go to the same reply stream, in order, in one entry."""

    messages: list[Delta | Error]
    v: int = msgspec.field(default_factory=writer_version)


class LoadLora(msgspec.Struct, tag="load_lora", omit_defaults=True):
    """Control command: load ``adapter`` (or reload it from its path) and hold it."""

    adapter: LoraAdapter
    reply_to: str
    v: int = msgspec.field(default_factory=writer_version)


class UnloadLora(msgspec.Struct, tag="unload_lora", omit_defaults=True):
    """Control command: drop the adapter ``name``; requests already running with it finish
    first, later ones load it again from their ``lora.path``."""

    name: str
    reply_to: str
    v: int = msgspec.field(default_factory=writer_version)


class ControlReply(msgspec.Struct, tag="control_reply", omit_defaults=True):
    """A worker's answer to a control command: ``ok``, or why not (wrong base model, rank above
    ``--max-lora-rank``, missing file)."""

    worker_id: str
    ok: bool
    message: str = ""
    v: int = msgspec.field(default_factory=writer_version)


Message = (
    Request | Delta | Error | Cancel | Heartbeat | Batch | LoadLora | UnloadLora | ControlReply
)

Decoded = TypeVar("Decoded")
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class MalformedMessage(ValueError):
    """A stream entry that is not a message of this protocol."""


def encode(message: msgspec.Struct) -> bytes:
    """Any message of this protocol, or of ``sluicegate.engine.kv_events.messages``."""
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return decode_with(_decoder, data)


def decode_with(decoder: msgspec.msgpack.Decoder[Decoded], data: bytes) -> Decoded:
    """``data`` by ``decoder``, a message without ``v`` read as ``LEGACY_VERSION``'s."""
    token = _decoding.set(True)
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(str(exc)) from exc
    finally:
        _decoding.reset(token)
