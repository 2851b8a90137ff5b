"""A fake AWS Bedrock runtime: ``/model/{id}/converse`` and ``/converse-stream``, per its docs.

Every request must carry a valid SigV4 signature for the fixed test credentials: the server
recomputes it with botocore's signer over the headers the client signed (a wrong key or a
changed body is a 403, as AWS answers). ConverseStream replies in AWS's binary event-stream
framing, encoded here from the spec (prelude with CRC, string headers, payload, message CRC).
Answers by the shared fake model (fake_common.py). Errors: ``limited`` 429
ThrottlingException, ``down`` 503 ServiceUnavailableException, ``bad`` 400 ValidationException;
a thinking budget not below ``maxTokens`` is a 400, as Anthropic's models answer. CountTokens
(``/model/{id}/count-tokens``) counts as the generation does, but for ``nocount`` models.
Model ``interleaved``, asked to think (Claude's ``thinking`` in
``additionalModelRequestFields``), reasons before its tool call as Claude does on Bedrock:
the blocks of fake_anthropic.INTERLEAVED as ``reasoningContent`` (signed text, encrypted
content) and text; an assistant turn must hold them all back, in place, as issued.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any
from urllib.parse import unquote

from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from . import fake_anthropic
from .fake_common import (
    TOOL_ARGUMENTS,
    FakeServer,
    count_words,
    plan,
    send_bytes,
    send_json,
    start_stream,
)


def _converse_block(block: dict[str, Any]) -> dict[str, Any]:
    if block["type"] == "thinking":
        text = {"text": block["thinking"], "signature": block["signature"]}
        return {"reasoningContent": {"reasoningText": text}}
    if block["type"] == "redacted_thinking":
        return {"reasoningContent": {"redactedContent": block["data"]}}
    return {"text": block["text"]}


INTERLEAVED = [_converse_block(block) for block in fake_anthropic.INTERLEAVED]
"""What model ``interleaved`` answers before its tool call, when asked to think."""

ACCESS_KEY = "AKIDSLUICEGATETEST"
SECRET_KEY = "sluicegate-test-secret"
REGION = "us-east-1"
_ERRORS = {
    "limited": (429, "ThrottlingException", "Too many requests, please wait."),
    "down": (503, "ServiceUnavailableException", "Service unavailable."),
    "bad": (400, "ValidationException", "A conversation must start with a user message."),
}


def event_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One message of AWS's event stream: all header values as strings (type 7)."""
    encoded = b""
    for name, value in headers.items():
        raw_name, raw_value = name.encode(), value.encode()
        encoded += struct.pack("!B", len(raw_name)) + raw_name
        encoded += struct.pack("!BH", 7, len(raw_value)) + raw_value
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack("!II", total, len(encoded))
    prelude += struct.pack("!I", zlib.crc32(prelude))
    message = prelude + encoded + payload
    return message + struct.pack("!I", zlib.crc32(message))


def event(event_type: str, payload: dict[str, Any]) -> bytes:
    headers = {
        ":event-type": event_type,
        ":content-type": "application/json",
        ":message-type": "event",
    }
    return event_message(headers, json.dumps(payload).encode())


def signature_ok(method: str, url: str, headers: dict[str, str], raw: bytes) -> bool:
    authorization = headers.get("authorization", "")
    fields = dict(
        item.strip().split("=", 1)
        for item in authorization.partition(" ")[2].split(",")
        if "=" in item
    )
    if not fields.get("Credential", "").startswith(ACCESS_KEY + "/"):
        return False
    signed = fields.get("SignedHeaders", "").split(";")
    request = AWSRequest(
        method=method, url=url, data=raw, headers={k: headers[k] for k in signed if k in headers}
    )
    request.context["timestamp"] = headers.get("x-amz-date", "")
    signer = SigV4Auth(Credentials(ACCESS_KEY, SECRET_KEY), "bedrock", REGION)
    canonical = signer.canonical_request(request)
    expected = signer.signature(signer.string_to_sign(request, canonical), request)
    return bool(expected == fields.get("Signature"))


class FakeBedrock(FakeServer):
    async def handle(
        self, scope: dict[str, Any], headers: dict[str, str], raw: bytes, body: Any, send: Any
    ) -> None:
        raw_path = scope.get("raw_path") or scope["path"].encode()
        url = f"http://{headers['host']}{raw_path.decode()}"
        if not signature_ok(scope["method"], url, headers, raw):
            return await send_json(
                send,
                403,
                {"message": "The request signature we calculated does not match."},
                {"x-amzn-errortype": "InvalidSignatureException"},
            )
        path: str = scope["path"]
        _, _, model_id, operation = path.split("/", 3)
        model = unquote(model_id)
        if operation == "count-tokens":
            return await _count_tokens(model, body, send)
        self.calls[model] += 1
        if model in _ERRORS:
            status, kind, message = _ERRORS[model]
            return await send_json(send, status, {"message": message}, {"x-amzn-errortype": kind})
        thinking = (body.get("additionalModelRequestFields") or {}).get("thinking") or {}
        thinks = model == "interleaved" and thinking.get("type") in {"enabled", "adaptive"}
        if thinks and not _thinking_intact(body["messages"]):
            message = (
                "The reasoning blocks in the latest assistant message cannot be modified. "
                "These blocks must remain as they were in the original response."
            )
            return await send_json(
                send, 400, {"message": message}, {"x-amzn-errortype": "ValidationException"}
            )
        config = body.get("inferenceConfig") or {}
        budget = thinking.get("budget_tokens") if thinking.get("type") == "enabled" else None
        if budget is not None and config.get("maxTokens", 4096) <= budget:
            message = "max_tokens must be greater than thinking.budget_tokens"
            return await send_json(
                send, 400, {"message": message}, {"x-amzn-errortype": "ValidationException"}
            )
        tool_config = body.get("toolConfig") or {}
        tools = [t["toolSpec"]["name"] for t in tool_config.get("tools") or ()]
        choice = tool_config.get("toolChoice") or {}
        forced = "" if "any" in choice else (choice.get("tool") or {}).get("name")
        users = [m for m in body["messages"] if m["role"] == "user"]
        last_user = json.dumps(users[-1]["content"]) if users else ""
        answer = plan(
            config.get("maxTokens"), tools, forced, last_user, config.get("stopSequences")
        )
        usage = {
            "inputTokens": count_words(body["messages"]) + count_words(body.get("system")),
            "outputTokens": len(answer.words) or 7,
            "cacheReadInputTokens": 2,
        }
        usage["totalTokens"] = usage["inputTokens"] + usage["outputTokens"] + 2
        stop = "tool_use" if answer.tool else "max_tokens" if answer.length_cut else "end_turn"
        if answer.stopped_by:
            stop = "stop_sequence"
        reasoning = INTERLEAVED if thinks and answer.tool else []
        if operation == "converse":
            if answer.tool:
                use = {"toolUseId": "tooluse_01", "name": answer.tool, "input": TOOL_ARGUMENTS}
                content: list[dict[str, Any]] = [*reasoning, {"toolUse": use}]
            else:
                content = [{"text": "".join(answer.words)}]
            reply = {
                "output": {"message": {"role": "assistant", "content": content}},
                "stopReason": stop,
                "usage": usage,
                "metrics": {"latencyMs": 1},
            }
            return await send_json(send, 200, reply)
        await start_stream(send, "application/vnd.amazon.eventstream")
        await send_bytes(send, event("messageStart", {"role": "assistant"}))
        for index, block in enumerate(reasoning):
            for delta in _reasoning_deltas(block):
                await send_bytes(
                    send, event("contentBlockDelta", {"delta": delta, "contentBlockIndex": index})
                )
            await send_bytes(send, event("contentBlockStop", {"contentBlockIndex": index}))
        index = len(reasoning)
        if answer.tool:
            start = {"toolUse": {"toolUseId": "tooluse_01", "name": answer.tool}}
            await send_bytes(
                send, event("contentBlockStart", {"start": start, "contentBlockIndex": index})
            )
            text = json.dumps(TOOL_ARGUMENTS)
            for piece in (text[:5], text[5:]):
                delta = {"delta": {"toolUse": {"input": piece}}, "contentBlockIndex": index}
                await send_bytes(send, event("contentBlockDelta", delta))
        else:
            for word in answer.words:
                delta = {"delta": {"text": word}, "contentBlockIndex": index}
                await send_bytes(send, event("contentBlockDelta", delta))
        await send_bytes(send, event("contentBlockStop", {"contentBlockIndex": index}))
        await send_bytes(send, event("messageStop", {"stopReason": stop}))
        metadata = {"usage": usage, "metrics": {"latencyMs": 1}}
        await send_bytes(send, event("metadata", metadata), more=False)


def _reasoning_deltas(block: dict[str, Any]) -> list[dict[str, Any]]:
    """ConverseStream's deltas of one block: reasoning text then its signature, encrypted
    reasoning whole, or text."""
    if "text" in block:
        return [{"text": block["text"]}]
    content = block["reasoningContent"]
    if "redactedContent" in content:
        return [{"reasoningContent": {"redactedContent": content["redactedContent"]}}]
    text = content["reasoningText"]
    return [
        {"reasoningContent": {"text": text["text"]}},
        {"reasoningContent": {"signature": text["signature"]}},
    ]


def _thinking_intact(messages: list[dict[str, Any]]) -> bool:
    """Every assistant turn starts with the reasoning issued, in place (its text may differ)."""

    def shape(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"text": ""} if "text" in b else b for b in blocks]

    return all(
        shape(m["content"][: len(INTERLEAVED)]) == shape(INTERLEAVED)
        for m in messages
        if m["role"] == "assistant"
    )


async def _count_tokens(model: str, body: dict[str, Any], send: Any) -> None:
    """CountTokens of a Converse body: its words, and a tool's name and description words;
    models named ``nocount`` have no count (a ValidationException, as Bedrock answers)."""
    if model == "nocount":
        message = "The provided model doesn't support counting tokens."
        return await send_json(
            send, 400, {"message": message}, {"x-amzn-errortype": "ValidationException"}
        )
    converse = body["input"]["converse"]
    tools = [t["toolSpec"] for t in (converse.get("toolConfig") or {}).get("tools") or ()]
    described = sum(1 + len((t.get("description") or "").split()) for t in tools)
    tokens = count_words(converse["messages"]) + count_words(converse.get("system")) + described
    await send_json(send, 200, {"inputTokens": tokens})
