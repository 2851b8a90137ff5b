"""Canonical answers rendered as OpenAI Responses: the ``response`` object, and the stream of
Responses events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed``), each with its ``sequence_number``."""

from __future__ import annotations

import secrets
from typing import Any

import msgspec

from sluicegate.gateway.canonical import Chunk, Response, TextPart, TokenLogprob, ToolCall, Usage

_encode = msgspec.json.Encoder().encode

_PAD_TO = 32
"""Stream obfuscation pads a delta event's ``delta`` with random characters in
``obfuscation`` up to the next multiple of this many, so an event's size no longer tells the
length of the tokens it carries (OpenAI's ``stream_options.include_obfuscation``, on unless the
client turns it off)."""


def _obfuscation(delta: str) -> str:
    return secrets.token_urlsafe(_PAD_TO)[: _PAD_TO - len(delta.encode()) % _PAD_TO]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def logprobs_body(logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """The answer tokens' logprobs in the Responses shape (empty unless they were asked for)."""
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": lp.bytes or list(lp.token.encode()),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": t.bytes or list(t.token.encode())}
                for t in lp.top
            ],
        }
        for lp in logprobs or ()
    ]


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    return "completed", None


def _text_item(
    item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [part] if text or status == "completed" else [],
    }


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if text else [],
    }


class Envelope:
    """The fields of a ``response`` object that do not depend on the answer; ``request``: the
    request's settings it repeats (``store`` and ``previous_response_id`` among them)."""

    def __init__(self, response_id: str, created: int, model: str, request: dict[str, Any]) -> None:
        self.response_id = response_id
        self.created = created
        self.model = model
        self.request = request

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None,
        incomplete: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            "usage": usage_body(usage) if usage is not None else None,
            **self.request,
        }


def response_body(
    envelope: Envelope, answer: Response, usage: Usage, finish: str | None
) -> dict[str, Any]:
    output: list[dict[str, Any]] = []
    suffix = envelope.response_id.removeprefix("resp_")
    choice = answer.choices[0] if answer.choices else None
    if choice is not None:
        finish = choice.finish_reason or finish
        if choice.message.reasoning:
            output.append(_reasoning_item(f"rs_{suffix}", choice.message.reasoning))
        text = "".join(p.text for p in choice.message.parts if isinstance(p, TextPart))
        if text or not choice.message.tool_calls():
            logprobs = logprobs_body(choice.logprobs)
            output.append(_text_item(f"msg_{suffix}", text, "completed", logprobs))
        for k, call in enumerate(p for p in choice.message.parts if isinstance(p, ToolCall)):
            output.append(
                _call_item(f"fc_{suffix}_{k}", call.id, call.name, call.arguments, "completed")
            )
    status, incomplete = _status(finish)
    return envelope.body(status, output, usage, incomplete)


class ResponsesStream:
    """One stream's events; output items opened as the chunks' kinds change."""

    def __init__(self, envelope: Envelope, obfuscate: bool = True) -> None:
        self._envelope = envelope
        self._obfuscate = obfuscate
        self._suffix = envelope.response_id.removeprefix("resp_")
        self._seq = 0
        self._items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls = 0
        self.final: dict[str, Any] | None = None
        """The response object of the stream's last event, once it ended well."""

    def _event(self, kind: str, **fields: Any) -> bytes:
        if self._obfuscate and "delta" in fields:
            fields["obfuscation"] = _obfuscation(fields["delta"])
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _encode(payload) + b"\n\n"

    def start(self) -> bytes:
        body = self._envelope.body("in_progress", [], None)
        return self._event("response.created", response=body) + self._event(
            "response.in_progress", response=body
        )

    def _index(self) -> int:
        return len(self._items) - 1

    def _close(self) -> bytes:
        item = self._open
        if item is None:
            return b""
        self._open = None
        index = self._index()
        out = b""
        if item["type"] == "message":
            text, logprobs = item["text"], item["logprobs"]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += self._event("response.output_text.done", text=text, logprobs=logprobs, **common)
            out += self._event("response.content_part.done", part=part, **common)
            done = _text_item(item["id"], text, "completed", logprobs)
        elif item["type"] == "reasoning":
            text = item["text"]
            common = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out += self._event("response.reasoning_text.done", text=text, **common)
            done = _reasoning_item(item["id"], text)
        else:
            args = item["arguments"]
            out += self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=args,
            )
            done = _call_item(item["id"], item["call_id"], item["name"], args, "completed")
        self._items[index] = done
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def _open_item(self, state: dict[str, Any], added: dict[str, Any]) -> bytes:
        out = self._close()
        self._items.append(added)
        self._open = state
        return out + self._event(
            "response.output_item.added", output_index=self._index(), item=added
        )

    def chunk(self, chunk: Chunk) -> bytes:
        out = b""
        for choice in chunk.choices[:1]:
            if choice.reasoning:
                if self._open is None or self._open["type"] != "reasoning":
                    item_id = f"rs_{self._suffix}_{len(self._items)}"
                    state = {"type": "reasoning", "id": item_id, "text": ""}
                    out += self._open_item(state, _reasoning_item(item_id, ""))
                assert self._open is not None
                self._open["text"] += choice.reasoning
                out += self._event(
                    "response.reasoning_text.delta",
                    item_id=self._open["id"],
                    output_index=self._index(),
                    content_index=0,
                    delta=choice.reasoning,
                )
            if choice.text:
                if self._open is None or self._open["type"] != "message":
                    item_id = f"msg_{self._suffix}_{len(self._items)}"
                    state = {"type": "message", "id": item_id, "text": "", "logprobs": []}
                    out += self._open_item(state, _text_item(item_id, "", "in_progress"))
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    out += self._event(
                        "response.content_part.added",
                        item_id=item_id,
                        output_index=self._index(),
                        content_index=0,
                        part=part,
                    )
                assert self._open is not None
                logprobs = logprobs_body(choice.logprobs)
                self._open["text"] += choice.text
                self._open["logprobs"] += logprobs
                out += self._event(
                    "response.output_text.delta",
                    item_id=self._open["id"],
                    output_index=self._index(),
                    content_index=0,
                    delta=choice.text,
                    logprobs=logprobs,
                )
            for call in choice.tool_calls or ():
                if (
                    call.id is not None
                    or self._open is None
                    or self._open["type"] != "function_call"
                ):
                    item_id = f"fc_{self._suffix}_{self._calls}"
                    self._calls += 1
                    state = {
                        "type": "function_call",
                        "id": item_id,
                        "call_id": call.id or item_id,
                        "name": call.name or "",
                        "arguments": "",
                    }
                    added = _call_item(item_id, state["call_id"], state["name"], "", "in_progress")
                    out += self._open_item(state, added)
                if call.arguments:
                    assert self._open is not None
                    self._open["arguments"] += call.arguments
                    out += self._event(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=self._index(),
                        delta=call.arguments,
                    )
        return out

    def end(self, finish_reason: str | None, usage: Usage) -> bytes:
        out = self._close()
        status, incomplete = _status(finish_reason)
        body = self.final = self._envelope.body(status, self._items, usage, incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=body)

    def failed(self, code: str, message: str) -> bytes:
        error = {"code": code, "message": message}
        body = self._envelope.body("failed", self._items, None)
        body["error"] = error
        return self._event("response.failed", response=body)
