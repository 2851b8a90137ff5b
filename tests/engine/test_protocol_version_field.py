"""``v`` travels on every message, and a message without it reads as the oldest version.

Before version 4 the structs' ``omit_defaults`` left ``v`` out whenever it equalled the
writer's own version, so every reader decoded its *own* version into it: a version-1 gateway's
request read as version 3 on a newer worker, which then sent it ``Batch`` replies it cannot read.
"""

from __future__ import annotations

import msgspec

from sluicegate.engine import protocol


class _RequestOld(msgspec.Struct, tag="request", omit_defaults=True):
    """A version-2 writer's (and reader's) view of a request: ``v`` omitted at its default."""

    request_id: str
    model: str
    prompt: str | None = None
    v: int = 2


class _DeltaOld(msgspec.Struct, tag="delta", omit_defaults=True):
    request_id: str
    seq: int
    text: str = ""
    v: int = 2


def _every_kind() -> list[protocol.Message]:
    delta = protocol.Delta("r1", 0, text="x")
    error = protocol.Error("r1", "overloaded", "busy")
    beat = protocol.Heartbeat("w1", "m", "m", "dev", 1.0)
    return [
        protocol.Request("r1", "m", prompt="hi"),
        delta,
        error,
        protocol.Cancel("r1"),
        beat,
        protocol.Batch([delta, error]),
    ]


def test_every_message_carries_v_on_the_wire() -> None:
    for message in _every_kind():
        raw = msgspec.msgpack.decode(protocol.encode(message))
        assert raw["v"] == protocol.PROTOCOL_VERSION, type(message).__name__
        for inner in raw.get("messages", []):
            assert inner["v"] == protocol.PROTOCOL_VERSION
        assert protocol.decode(protocol.encode(message)) == message


def test_an_explicit_older_version_travels_as_written() -> None:
    request = protocol.Request("r1", "m", prompt="hi", v=protocol.BATCH_VERSION - 1)
    decoded = protocol.decode(protocol.encode(request))
    assert isinstance(decoded, protocol.Request)
    assert decoded.v == protocol.BATCH_VERSION - 1


def test_a_message_without_v_reads_as_the_legacy_version() -> None:
    decoded = protocol.decode(msgspec.msgpack.encode(_RequestOld("r1", "m", prompt="hi")))
    assert isinstance(decoded, protocol.Request)
    assert decoded.prompt == "hi"
    assert decoded.v == protocol.LEGACY_VERSION
    # Its writer may be a version-1 gateway: it must not get Batch replies.
    assert decoded.v < protocol.BATCH_VERSION
    batch = msgspec.msgpack.encode(
        {"type": "batch", "messages": [msgspec.to_builtins(_DeltaOld("r1", 0, text="x"))]}
    )
    decoded_batch = protocol.decode(batch)
    assert isinstance(decoded_batch, protocol.Batch)
    assert decoded_batch.v == decoded_batch.messages[0].v == protocol.LEGACY_VERSION


def test_messages_built_after_a_decode_still_carry_the_writers_version() -> None:
    protocol.decode(msgspec.msgpack.encode(_RequestOld("r1", "m")))
    assert protocol.Delta("r1", 0).v == protocol.PROTOCOL_VERSION


def test_an_older_reader_sees_the_writers_version() -> None:
    # A version-2 reader no longer mistakes a newer writer's message for one of its own.
    old = msgspec.msgpack.decode(protocol.encode(protocol.Request("r1", "m")), type=_RequestOld)
    assert old.v == protocol.PROTOCOL_VERSION
    delta = msgspec.msgpack.decode(
        protocol.encode(protocol.Delta("r1", 0, text="x")), type=_DeltaOld
    )
    assert (delta.text, delta.v) == ("x", protocol.PROTOCOL_VERSION)
