"""``/v1/messages/count_tokens`` through hosted deployments, and the signatures of the thinking
blocks the gateway returns, with the official ``anthropic`` SDK against a gateway in front of
the fake providers."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from . import fake_anthropic
from .claude_inputs import SAY, THINK, WEATHER


def test_count_tokens_is_anthropics_own_count(
    claude: anthropic.Anthropic, fakes: dict[str, tuple[Any, str]]
) -> None:
    calls = dict(fakes["anthropic"][0].calls)
    counted = claude.messages.count_tokens(
        model="anthropic-plain", system="be brief", tools=[WEATHER], messages=SAY
    )
    # The fake's count: 3 words of messages, 2 of system, the tool's name and its 5 words;
    # the fake refuses any field its count endpoint does not take (max_tokens, ...).
    assert counted.input_tokens == 3 + 2 + 1 + 5
    assert fakes["anthropic"][0].calls == calls, "nothing was generated"


@pytest.mark.parametrize("model", ["anthropic-plain", "gemini-plain"])
def test_count_tokens_takes_speed_which_does_not_change_the_count(
    claude: anthropic.Anthropic, model: str
) -> None:
    plain = claude.messages.count_tokens(model=model, messages=SAY).input_tokens
    for speed in ("standard", "fast"):
        counted = claude.messages.count_tokens(model=model, messages=SAY, speed=speed)
        assert counted.input_tokens == plain
    # A field count_tokens does not take is still a 400 naming it.
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.count_tokens(model=model, messages=SAY, extra_body={"max_tokens": 5})
    assert "max_tokens" in caught.value.body["error"]["message"]  # type: ignore[index]


def test_count_tokens_without_a_count_endpoint_is_the_prompt_of_a_generation(
    claude: anthropic.Anthropic,
) -> None:
    # Bedrock's CountTokens, which this fake model lacks (Gemini has countTokens).
    model = "bedrock-nocount"
    counted = claude.messages.count_tokens(model=model, system="be brief", messages=SAY)
    message = claude.messages.create(model=model, max_tokens=3, system="be brief", messages=SAY)
    usage = message.usage
    prompt = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == prompt == 3 + 2 + 2  # words, and 2 read from the cache


def _altered(signature: str) -> str:
    # Its last two characters replaced by others: a signature that already ended in "AA"
    # (one key in 4,096) was sent back unchanged by a plain "AA" and rightly accepted.
    return signature[:-2] + ("BB" if signature.endswith("AA") else "AA")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", ["anthropic-plain", "gemini-plain"])
def test_a_thinking_block_comes_signed_and_goes_back(
    claude: anthropic.Anthropic, model: str, stream: bool
) -> None:
    """Anthropic signs its thinking (its signature rides inside ours); Gemini does not, like
    our engines: the signature is then ours alone."""
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 2048,
        "thinking": THINK,
        "messages": SAY,
    }
    message = _answer(claude, kwargs, stream)
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking == "let me think"
    assert thinking.signature.startswith("sg1.") and len(thinking.signature) > 40
    signed_upstream = thinking.signature.endswith("." + fake_anthropic.SIGNATURE)
    assert signed_upstream == (model == "anthropic-plain")
    assert thinking.signature.count(".") == (1 + signed_upstream)

    def follow_up(block: dict[str, Any]) -> Any:
        turns: Any = [
            *SAY,
            {"role": "assistant", "content": [block, message.content[1].model_dump()]},
            {"role": "user", "content": "and more"},
        ]
        return claude.messages.create(model=model, max_tokens=2, thinking=THINK, messages=turns)

    block = thinking.model_dump()
    assert follow_up(block).stop_reason == "max_tokens"
    for tampered in (
        {**block, "thinking": "let me think harder"},
        {**block, "signature": _altered(block["signature"])},
        {**block, "signature": ""},
    ):
        with pytest.raises(anthropic.BadRequestError) as caught:
            follow_up(tampered)
        error = caught.value.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        assert "messages[1].content[0].signature" in error["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropics_signed_thinking_goes_back_to_it_in_a_tool_loop(
    claude: anthropic.Anthropic, stream: bool
) -> None:
    ask: Any = [{"role": "user", "content": "what is the weather in Paris"}]
    kwargs: dict[str, Any] = {
        "model": "anthropic-plain",
        "max_tokens": 2048,
        "thinking": THINK,
        "tools": [WEATHER],
        "messages": ask,
    }
    message = _answer(claude, kwargs, stream)
    thinking, use = message.content
    assert thinking.type == "thinking" and use.type == "tool_use"
    # Anthropic's own signature rides inside ours, to go back to it with the block.
    assert thinking.signature.startswith("sg1.")
    assert thinking.signature.endswith("." + fake_anthropic.SIGNATURE)
    turns = _tool_result_turns(ask, message, use.id)
    # The fake, as Anthropic, refuses this turn unless its signed thinking block leads it.
    follow = claude.messages.create(**{**kwargs, "messages": turns})
    assert follow.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("model", ["anthropic-interleaved", "bedrock-interleaved"])
def test_interleaved_thinking_goes_back_block_by_block(
    claude: anthropic.Anthropic, model: str, stream: bool
) -> None:
    """An answer with several thinking blocks (one of them redacted) between its text and tool
    call, from Claude on Anthropic's API or on Bedrock: each signed block comes with its own
    signature, every block in its place, and all of them go back as Claude issued them."""
    ask: Any = [{"role": "user", "content": "what is the weather in Paris"}]
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 2048,
        "thinking": THINK,
        "tools": [WEATHER],
        "messages": ask,
    }
    message = _answer(claude, kwargs, stream)
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "redacted_thinking", "text", "thinking", "tool_use"]
    first, redacted, text, second, use = message.content
    issued = fake_anthropic.INTERLEAVED
    for block, original in ((first, issued[0]), (second, issued[3])):
        assert block.type == "thinking" and block.thinking == original["thinking"]
        assert block.signature.startswith("sg1.")
        assert block.signature.endswith("." + original["signature"])
    assert redacted.type == "redacted_thinking" and redacted.data == issued[1]["data"]
    assert text.type == "text" and text.text.strip() == fake_anthropic.INTERLEAVED_TEXT
    assert use.type == "tool_use"

    turns = _tool_result_turns(ask, message, use.id)
    # The fakes, as Claude, refuse the turn unless every block comes back as issued.
    follow = claude.messages.create(**{**kwargs, "messages": turns})
    assert follow.stop_reason == "end_turn"
    # Another backend cannot read the redacted block and goes without it, as Anthropic's own
    # models do with a block they cannot read; the signed thinking goes as text.
    elsewhere = claude.messages.create(**{**kwargs, "model": "gemini-plain", "messages": turns})
    assert elsewhere.stop_reason in {"end_turn", "max_tokens"}


def _answer(claude: anthropic.Anthropic, kwargs: dict[str, Any], stream: bool) -> Any:
    """The message, whole or folded from its stream by the SDK."""
    if stream:
        with claude.messages.stream(**kwargs) as events:
            return events.get_final_message()
    return claude.messages.create(**kwargs)


def _tool_result_turns(ask: Any, message: Any, tool_use_id: str) -> Any:
    """The conversation going on: the question, the answer as it came, a tool result."""
    return [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "sunny"}],
        },
    ]
