"""A fake Google AI Gemini API: ``models/{m}:generateContent`` and
``:streamGenerateContent?alt=sse``, per its docs.

Requires ``x-goog-api-key: gem-test-key``; any other key is refused as Google refuses it: a
400 INVALID_ARGUMENT whose ``details`` hold an ErrorInfo with reason API_KEY_INVALID. Answers by the shared fake model (fake_common.py),
``candidateCount`` candidates of it; ``thinkingConfig.includeThoughts`` adds a thought part.
Errors use Google's ``{"error": {"code", "message", "status"}}``: ``limited`` 429
RESOURCE_EXHAUSTED, ``down`` 503 UNAVAILABLE, ``bad`` 400 INVALID_ARGUMENT, ``unbilled`` 400
FAILED_PRECONDITION (the free tier is not offered where the project is and billing is off).
``:countTokens`` counts as the generation does (tools too). Models named ``bigcall-N`` call the tool they are offered with an argument of N KiB.
"""

from __future__ import annotations

import json
from typing import Any

from .fake_common import (
    TOOL_ARGUMENTS,
    FakeServer,
    count_words,
    plan,
    send_bytes,
    send_json,
    sse,
    start_stream,
)

API_KEY = "gem-test-key"
_ERRORS = {
    "limited": (429, "RESOURCE_EXHAUSTED", "Resource has been exhausted (e.g. check quota)."),
    "down": (503, "UNAVAILABLE", "The model is overloaded. Please try again later."),
    "bad": (400, "INVALID_ARGUMENT", "Request contains an invalid argument."),
    "unbilled": (
        400,
        "FAILED_PRECONDITION",
        "Gemini API free tier is not available in your country. Please enable billing.",
    ),
}
BAD_KEY_MESSAGE = "API key not valid. Please pass a valid API key."


def _error(code: int, status: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "status": status}}


class FakeGemini(FakeServer):
    async def handle(
        self, scope: dict[str, Any], headers: dict[str, str], raw: bytes, body: Any, send: Any
    ) -> None:
        path: str = scope["path"]
        prefix = "/v1beta/models/"
        if not path.startswith(prefix) or ":" not in path:
            return await send_json(send, 404, _error(404, "NOT_FOUND", "not found"))
        model, method = path[len(prefix) :].rsplit(":", 1)
        if headers.get("x-goog-api-key") != API_KEY:
            error = _error(400, "INVALID_ARGUMENT", BAD_KEY_MESSAGE)
            error["error"]["details"] = [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "API_KEY_INVALID",
                    "domain": "googleapis.com",
                    "metadata": {"service": "generativelanguage.googleapis.com"},
                },
                {
                    "@type": "type.googleapis.com/google.rpc.LocalizedMessage",
                    "locale": "en-US",
                    "message": BAD_KEY_MESSAGE,
                },
            ]
            return await send_json(send, 400, error)
        if method == "countTokens":
            return await _count_tokens(model, body, send)
        self.calls[model] += 1
        if model in _ERRORS:
            code, status, message = _ERRORS[model]
            extra = {"retry-after": "0"} if code == 429 else {}
            return await send_json(send, code, _error(code, status, message), extra)
        config = body.get("generationConfig") or {}
        tools = [d["name"] for t in body.get("tools") or () for d in t["functionDeclarations"]]
        calling = (body.get("toolConfig") or {}).get("functionCallingConfig") or {}
        forced = None
        if calling.get("mode") == "ANY":
            forced = (calling.get("allowedFunctionNames") or [""])[0]
        users = [c for c in body["contents"] if c["role"] == "user"]
        last_user = json.dumps(users[-1]["parts"]) if users else ""
        answer = plan(
            config.get("maxOutputTokens"), tools, forced, last_user, config.get("stopSequences")
        )
        arguments: dict[str, Any] = TOOL_ARGUMENTS
        if model.startswith("bigcall-") and answer.tool:
            arguments = {"city": "x" * int(model.removeprefix("bigcall-")) * 1024}
        thought = bool((config.get("thinkingConfig") or {}).get("includeThoughts"))
        usage = {
            "promptTokenCount": count_words(body["contents"])
            + count_words(body.get("systemInstruction")),
            "candidatesTokenCount": len(answer.words) or 7,
        }
        usage["totalTokenCount"] = usage["promptTokenCount"] + usage["candidatesTokenCount"]
        finish = "MAX_TOKENS" if answer.length_cut else "STOP"
        candidates = range(int(config.get("candidateCount", 1)))
        if method == "generateContent":
            parts: list[dict[str, Any]] = (
                [{"text": "let me think", "thought": True}] if thought else []
            )
            if answer.tool:
                parts.append({"functionCall": {"name": answer.tool, "args": arguments}})
            else:
                parts.append({"text": "".join(answer.words)})
            reply = {
                "candidates": [
                    {
                        "content": {"role": "model", "parts": parts},
                        "finishReason": finish,
                        "index": i,
                    }
                    for i in candidates
                ],
                "usageMetadata": usage,
                "modelVersion": model,
            }
            return await send_json(send, 200, reply)
        if method != "streamGenerateContent" or b"alt=sse" not in scope["query_string"]:
            return await send_json(send, 404, _error(404, "NOT_FOUND", "not found"))
        await start_stream(send)
        pieces: list[dict[str, Any]] = (
            [{"text": "let me think", "thought": True}] if thought else []
        )
        if answer.tool:
            pieces.append({"functionCall": {"name": answer.tool, "args": arguments}})
        else:
            pieces += [{"text": word} for word in answer.words]
        for piece in pieces:
            event = {
                "candidates": [
                    {"content": {"role": "model", "parts": [piece]}, "index": i} for i in candidates
                ],
                "modelVersion": model,
            }
            await send_bytes(send, sse(event))
        last = {
            "candidates": [
                {
                    "content": {"role": "model", "parts": [{"text": ""}]},
                    "finishReason": finish,
                    "index": i,
                }
                for i in candidates
            ],
            "usageMetadata": usage,
            "modelVersion": model,
        }
        await send_bytes(send, sse(last), more=False)


async def _count_tokens(model: str, body: dict[str, Any], send: Any) -> None:
    """``countTokens`` of a ``generateContentRequest``: its words, and a function's name and
    description words. The request names its model; bare ``contents`` may not come with it."""
    request = body.get("generateContentRequest")
    if not isinstance(request, dict) or "contents" in body:
        message = "Exactly one of contents or generateContentRequest must be set."
        return await send_json(send, 400, _error(400, "INVALID_ARGUMENT", message))
    if request.get("model") != f"models/{model}":
        message = "generateContentRequest.model must name the model counted."
        return await send_json(send, 400, _error(400, "INVALID_ARGUMENT", message))
    functions = [d for t in request.get("tools") or () for d in t["functionDeclarations"]]
    described = sum(1 + len((d.get("description") or "").split()) for d in functions)
    tokens = (
        count_words(request["contents"]) + count_words(request.get("systemInstruction")) + described
    )
    await send_json(send, 200, {"totalTokens": tokens})
