"""A fake Azure OpenAI: ``/openai/deployments/{d}/chat/completions?api-version=...`` and
the v1 API ``/openai/v1/chat/completions``, per its docs.

Requires ``api-key: az-test-key`` (401 otherwise, as Azure answers) and, on the deployments
path, an ``api-version`` query (404 without). The model is the deployment's name (or the v1
body's ``model``). Answers by the shared fake model (fake_common.py) in OpenAI's chat shape,
streamed and not; ``limited`` 429 with ``retry-after: 0``, ``down`` 503, ``bad`` 400.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

from .fake_common import (
    TOOL_ARGUMENTS,
    FakeServer,
    count_words,
    plan,
    send_bytes,
    send_json,
    start_stream,
)

API_KEY = "az-test-key"
_ERRORS = {
    "limited": (
        429,
        "429",
        "Requests to the ChatCompletions_Create Operation have exceeded the rate limit.",
    ),
    "down": (
        503,
        "ServiceUnavailable",
        "The service is temporarily unable to process your request.",
    ),
    "bad": (400, "BadRequest", "Invalid value for 'messages'."),
}


def _data(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class FakeAzure(FakeServer):
    async def handle(
        self, scope: dict[str, Any], headers: dict[str, str], raw: bytes, body: Any, send: Any
    ) -> None:
        path: str = scope["path"]
        query = parse_qs(scope["query_string"].decode())
        if path.startswith("/openai/deployments/") and path.endswith("/chat/completions"):
            model = path.split("/")[3]
            if not query.get("api-version"):
                return await send_json(
                    send, 404, {"error": {"code": "404", "message": "Resource not found"}}
                )
        elif path == "/openai/v1/chat/completions":
            model = body["model"]
        else:
            return await send_json(
                send, 404, {"error": {"code": "404", "message": "Resource not found"}}
            )
        if headers.get("api-key") != API_KEY:
            error = {"code": "401", "message": "Access denied due to invalid subscription key."}
            return await send_json(send, 401, {"error": error})
        self.calls[model] += 1
        if model in _ERRORS:
            status, code, message = _ERRORS[model]
            extra = {"retry-after": "0"} if status == 429 else {}
            return await send_json(
                send, status, {"error": {"code": code, "message": message}}, extra
            )
        tools = [t["function"]["name"] for t in body.get("tools") or ()]
        choice = body.get("tool_choice")
        forced = (
            ""
            if choice == "required"
            else (choice or {}).get("function", {}).get("name")
            if isinstance(choice, dict)
            else None
        )
        users = [m for m in body["messages"] if m["role"] == "user"]
        last_user = json.dumps(users[-1]["content"]) if users else ""
        stop = body.get("stop")
        answer = plan(
            body.get("max_completion_tokens") or body.get("max_tokens"),
            tools,
            forced,
            last_user,
            [stop] if isinstance(stop, str) else stop,
        )
        usage = {
            "prompt_tokens": sum(
                len(m["content"].split()) if isinstance(m.get("content"), str) else count_words(m)
                for m in body["messages"]
            ),
            "completion_tokens": len(answer.words) or 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        finish = "tool_calls" if answer.tool else "length" if answer.length_cut else "stop"
        call = {
            "id": "call_az01",
            "type": "function",
            "function": {"name": answer.tool, "arguments": json.dumps(TOOL_ARGUMENTS)},
        }
        head = {"id": "chatcmpl-az", "created": 1, "model": model}
        if not body.get("stream"):
            message: dict[str, Any] = {
                "role": "assistant",
                "content": None if answer.tool else "".join(answer.words),
            }
            if answer.tool:
                message["tool_calls"] = [call]
            choice_out = {"index": 0, "message": message, "finish_reason": finish}
            reply = {**head, "object": "chat.completion", "choices": [choice_out], "usage": usage}
            return await send_json(send, 200, reply)
        await start_stream(send)
        head = {**head, "object": "chat.completion.chunk"}
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if answer.tool:
            deltas.append(
                {
                    "tool_calls": [
                        {"index": 0, **call, "function": {"name": answer.tool, "arguments": ""}}
                    ]
                }
            )
            deltas.append(
                {
                    "tool_calls": [
                        {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
                    ]
                }
            )
        else:
            deltas += [{"content": word} for word in answer.words]
        for delta in deltas:
            choice_out = {"index": 0, "delta": delta, "finish_reason": None}
            await send_bytes(send, _data({**head, "choices": [choice_out]}))
        end = {"index": 0, "delta": {}, "finish_reason": finish}
        await send_bytes(send, _data({**head, "choices": [end]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send_bytes(send, _data({**head, "choices": [], "usage": usage}))
        await send_bytes(send, b"data: [DONE]\n\n", more=False)
