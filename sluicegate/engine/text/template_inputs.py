"""A request's messages and tools as chat templates read them (Hugging Face's conventions).
Torch-free: the gateway renders prompts the same way to compute a worker's block hashes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def message_dict(message: Any) -> dict[str, Any]:
    if isinstance(message, Mapping):
        fields = dict(message)
    else:
        fields = {"role": message.role, "content": message.content or ""}
        for name in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if getattr(message, name, None):
                fields[name] = getattr(message, name)
    if fields.get("tool_calls"):
        fields["tool_calls"] = [template_tool_call(call) for call in fields["tool_calls"]]
    return fields


def template_tool_call(call: Any) -> dict[str, Any]:
    """An earlier turn's call in the shape chat templates read (Hugging Face's convention:
    ``function.arguments`` a mapping, which templates serialise with ``tojson``)."""
    if isinstance(call, Mapping) and "function" in call:
        return dict(call)
    get = call.get if isinstance(call, Mapping) else lambda key: getattr(call, key, None)
    arguments: Any = get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return {
        "id": get("id"),
        "type": "function",
        "function": {"name": get("name"), "arguments": arguments},
    }


def template_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Tools in the OpenAI shape chat templates expect (``{"type": "function", ...}``)."""
    rendered = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
        rendered.append({"type": "function", "function": function})
    return rendered
