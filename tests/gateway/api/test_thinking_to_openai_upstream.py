"""Anthropic's ``thinking`` through a ``provider: openai`` deployment: the chat template's
``enable_thinking`` switch that OpenAI-compatible servers of open models take (vLLM, SGLang),
never dropped; a ``display`` they cannot honour is a 400 naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import pytest

from .servers import Upstream

SAY: Any = [{"role": "user", "content": "say some words"}]


def claude(gateway: str, key: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway, api_key=key, max_retries=0)


@pytest.mark.parametrize(
    ("thinking", "enabled"),
    [({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "disabled"}, False)],
)
def test_thinking_switches_the_upstreams_template(
    gateway: str,
    make_key: Callable[..., str],
    upstream: tuple[Upstream, str],
    thinking: dict[str, Any],
    enabled: bool,
) -> None:
    claude(gateway, make_key()).messages.create(
        model="echo", max_tokens=5, thinking=thinking, messages=SAY
    )
    assert upstream[0].last_body("echo")["chat_template_kwargs"] == {"enable_thinking": enabled}


def test_without_thinking_no_template_switch_is_sent(
    gateway: str, make_key: Callable[..., str], upstream: tuple[Upstream, str]
) -> None:
    claude(gateway, make_key()).messages.create(model="echo", max_tokens=5, messages=SAY)
    assert "chat_template_kwargs" not in upstream[0].last_body("echo")


def test_thinking_display_is_a_400_naming_it(gateway: str, make_key: Callable[..., str]) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(gateway, make_key()).messages.create(
            model="echo", max_tokens=5, thinking=thinking, messages=SAY
        )
    assert "'thinking.display'" in caught.value.body["error"]["message"]  # type: ignore[index]
