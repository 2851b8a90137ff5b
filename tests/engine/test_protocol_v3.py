"""Protocol v3 round trips, and that version-2 peers and version-3 peers read each other."""

from __future__ import annotations

import msgspec

from sluicegate.engine import protocol


class _ChatMessageV2(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None = None
    name: str | None = None


class _RequestV2(msgspec.Struct, tag="request", omit_defaults=True):
    """A version-2 writer's (and reader's) view of a request."""

    request_id: str
    model: str
    sampling: protocol.Sampling = msgspec.field(default_factory=protocol.Sampling)
    prompt: str | None = None
    messages: list[_ChatMessageV2] | None = None
    v: int = 2


class _DeltaV2(msgspec.Struct, tag="delta", omit_defaults=True):
    request_id: str
    seq: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    v: int = 2


def _full_request() -> protocol.Request:
    return protocol.Request(
        request_id="r1",
        model="m",
        sampling=protocol.Sampling(max_tokens=8, logprobs=3, logit_bias={5: -100.0, 7: 2.5}),
        messages=[
            protocol.ChatMessage(role="user", content="weather?"),
            protocol.ChatMessage(
                role="assistant",
                tool_calls=[protocol.ToolCall("call_1", "get_weather", '{"city": "Paris"}')],
                reasoning_content="the user wants weather",
            ),
            protocol.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
        ],
        n=3,
        tools=[
            protocol.Tool(
                name="get_weather",
                description="Current weather",
                parameters={"type": "object", "properties": {"city": {"type": "string"}}},
                strict=True,
            )
        ],
        tool_choice="function",
        tool_choice_name="get_weather",
        parallel_tool_calls=False,
        structured=protocol.Structured(kind="json_schema", json_schema='{"type": "object"}'),
        chat_template_kwargs={"enable_thinking": False},
    )


def test_request_with_every_v3_field_round_trips() -> None:
    request = _full_request()
    assert protocol.decode(protocol.encode(request)) == request
    assert request.v == protocol.PROTOCOL_VERSION >= 3


def test_delta_with_tool_calls_logprobs_and_reasoning_round_trips() -> None:
    delta = protocol.Delta(
        request_id="r1",
        seq=4,
        text="",
        index=2,
        reasoning_text="hmm",
        tool_calls=[
            protocol.ToolCallDelta(index=0, id="call_abc", name="get_weather"),
            protocol.ToolCallDelta(index=0, arguments='{"city": '),
        ],
        logprobs=[
            protocol.TokenLogprob(
                "a",
                -0.5,
                [97],
                [protocol.TopLogprob("a", -0.5, [97]), protocol.TopLogprob("é", -1.5, [195, 169])],
            )
        ],
        finish_reason="tool_calls",
        usage=protocol.Usage(10, 4),
    )
    assert protocol.decode(protocol.encode(delta)) == delta


def test_a_version_2_request_decodes_with_v3_defaults() -> None:
    old = _RequestV2("r2", "m", prompt="hi")
    decoded = protocol.decode(msgspec.msgpack.encode(old))
    assert isinstance(decoded, protocol.Request)
    assert (decoded.request_id, decoded.prompt) == ("r2", "hi")
    assert (decoded.n, decoded.tools, decoded.structured, decoded.messages) == (1, None, None, None)
    assert decoded.tool_choice == "auto" and decoded.sampling.logit_bias is None


def test_a_version_2_reader_ignores_v3_fields() -> None:
    request = msgspec.msgpack.decode(protocol.encode(_full_request()), type=_RequestV2)
    assert request.request_id == "r1"
    assert request.messages is not None and request.messages[2].content == '{"temp": 21}'
    delta = protocol.Delta("r1", 0, text="x", index=1, reasoning_text="y", finish_reason="stop")
    old = msgspec.msgpack.decode(protocol.encode(delta), type=_DeltaV2)
    assert (old.text, old.finish_reason) == ("x", "stop")


def test_plain_deltas_stay_as_small_as_in_version_2() -> None:
    delta = protocol.Delta("r1", 0, text="x")
    fields = set(msgspec.msgpack.decode(protocol.encode(delta)))
    # Only ``v`` more (3 bytes), which version 4 always writes.
    assert fields == {"type", "request_id", "seq", "text", "v"}
