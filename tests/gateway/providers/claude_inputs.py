"""Request pieces the Anthropic-SDK tests of the hosted providers share."""

from __future__ import annotations

from typing import Any

WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
SAY: Any = [{"role": "user", "content": "say some words"}]
THINK: Any = {"type": "enabled", "budget_tokens": 1024}
