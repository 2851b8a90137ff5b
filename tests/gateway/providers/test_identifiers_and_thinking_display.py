"""Caller identifiers (``user``, ``safety_identifier``, ``prompt_cache_key``) and Anthropic's
``thinking.display`` through each hosted adapter: forwarded where the provider has a field for
them, otherwise gone without by the README's documented policy (identifiers only), or a 400
naming the field; never dropped unnoticed."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from .claude_inputs import SAY

IDS = {"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k-1"}


@pytest.fixture(scope="module")
def gpt(hosted_gateway: tuple[str, str]) -> openai.OpenAI:
    url, key = hosted_gateway
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _last(fakes: dict[str, tuple[Any, str]], kind: str) -> dict[str, Any]:
    body: dict[str, Any] = fakes[kind][0].bodies[-1]
    return body


def test_bedrock_records_the_callers_identifiers_as_request_metadata(
    gpt: openai.OpenAI, fakes: dict[str, tuple[Any, str]]
) -> None:
    gpt.chat.completions.create(model="bedrock-plain", messages=SAY, **IDS)  # type: ignore[arg-type]
    assert _last(fakes, "bedrock")["requestMetadata"] == {"user": "u-1", "safety_identifier": "s-1"}
    gpt.chat.completions.create(model="bedrock-plain", messages=SAY)
    assert "requestMetadata" not in _last(fakes, "bedrock")


def test_anthropic_takes_the_safety_identifier_as_its_user_id(
    gpt: openai.OpenAI, fakes: dict[str, tuple[Any, str]]
) -> None:
    gpt.chat.completions.create(model="anthropic-plain", messages=SAY, **IDS)  # type: ignore[arg-type]
    assert _last(fakes, "anthropic")["metadata"] == {"user_id": "s-1"}
    gpt.chat.completions.create(model="anthropic-plain", messages=SAY, user="u-2")
    assert _last(fakes, "anthropic")["metadata"] == {"user_id": "u-2"}


def test_gemini_answers_with_identifiers_it_has_no_field_for(
    gpt: openai.OpenAI, fakes: dict[str, tuple[Any, str]]
) -> None:
    plain = gpt.chat.completions.create(model="gemini-plain", messages=SAY)
    tagged = gpt.chat.completions.create(model="gemini-plain", messages=SAY, **IDS)  # type: ignore[arg-type]
    assert tagged.choices[0].message.content == plain.choices[0].message.content
    assert set(_last(fakes, "gemini")) == set(fakes["gemini"][0].bodies[-2])


def test_azure_gets_the_identifiers_of_a_responses_request(
    gpt: openai.OpenAI, fakes: dict[str, tuple[Any, str]]
) -> None:
    gpt.responses.create(model="azure-plain", input="say some words", **IDS)  # type: ignore[arg-type]
    body = _last(fakes, "azure")
    assert {k: body.get(k) for k in IDS} == IDS


@pytest.mark.parametrize("display", ["summarized", "omitted"])
def test_thinking_display_reaches_anthropic_and_gemini(
    claude: anthropic.Anthropic, fakes: dict[str, tuple[Any, str]], display: str
) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024, "display": display}
    claude.messages.create(model="anthropic-plain", max_tokens=5, thinking=thinking, messages=SAY)
    assert _last(fakes, "anthropic")["thinking"] == thinking
    claude.messages.create(model="gemini-plain", max_tokens=5, thinking=thinking, messages=SAY)
    config = _last(fakes, "gemini")["generationConfig"]["thinkingConfig"]
    assert config == {"thinkingBudget": 1024, "includeThoughts": display == "summarized"}


@pytest.mark.parametrize(
    ("model", "named"), [("azure-plain", "'thinking'"), ("bedrock-plain", "'thinking.display'")]
)
def test_thinking_display_where_it_is_not_taken_is_a_400(
    claude: anthropic.Anthropic, model: str, named: str
) -> None:
    thinking: Any = {"type": "adaptive", "display": "omitted"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=model, max_tokens=5, thinking=thinking, messages=SAY)
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert named in caught.value.body["error"]["message"]  # type: ignore[index]
