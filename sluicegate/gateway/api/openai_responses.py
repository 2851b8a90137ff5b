"""``POST /v1/responses``: OpenAI's Responses API in, stateless.

The body becomes a canonical request (translate/responses_in.py), runs the shared lifecycle
(``sluicegate.gateway.admission.admit`` and ``sluicegate.gateway.call.call``) and comes back as a ``response`` object or the
Responses event stream (translate/responses_reply.py). Errors keep OpenAI's shape (the app's
handlers).
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response

from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.api.openai_reply import reply
from sluicegate.gateway.api.openapi_body import body_operation
from sluicegate.gateway.call.call import Call
from sluicegate.gateway.canonical import Chunk
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.schemas.wire import decode_body
from sluicegate.gateway.services import authenticate
from sluicegate.gateway.translate.responses_in import FunctionTool, ResponsesRequest, canonical
from sluicegate.gateway.translate.responses_reply import Envelope, ResponsesStream, response_body

_encode = msgspec.json.Encoder().encode


def _echo(data: ResponsesRequest) -> dict[str, Any]:
    """The request's settings that a ``response`` object repeats back."""
    text = msgspec.to_builtins(data.text) if data.text else {"format": {"type": "text"}}
    if "format" not in text:
        text["format"] = {"type": "text"}
    tool_choice = data.tool_choice
    return {
        "instructions": data.instructions,
        "max_output_tokens": data.max_output_tokens,
        "metadata": data.metadata or {},
        "parallel_tool_calls": data.parallel_tool_calls is not False,
        "temperature": data.temperature,
        "top_p": data.top_p,
        "tool_choice": msgspec.to_builtins(tool_choice) if tool_choice is not None else "auto",
        "tools": [_tool(t) for t in data.tools or ()],
        "text": text,
        "truncation": "disabled",
        "reasoning": msgspec.to_builtins(data.reasoning) if data.reasoning else None,
        "user": data.user,
    }


def _tool(tool: FunctionTool) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }


class ResponsesRenderer:
    def __init__(self, data: ResponsesRequest) -> None:
        self._data = data
        self._stream: ResponsesStream | None = None

    def _new_stream(self, call: Call) -> ResponsesStream:
        options = self._data.stream_options
        obfuscate = options is None or options.include_obfuscation is not False
        return ResponsesStream(self._envelope(call), obfuscate)

    def _envelope(self, call: Call) -> Envelope:
        return Envelope(call.response_id, call.created, call.public_model, _echo(self._data))

    def whole(self, call: Call, answer: Answer) -> bytes:
        assert call.usage is not None
        return _encode(response_body(self._envelope(call), answer, call.usage, call.finish_reason))

    def opening(self, call: Call, first: Chunk) -> bytes:
        self._stream = self._new_stream(call)
        return self._stream.start()

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        assert self._stream is not None
        return self._stream.chunk(chunk)

    def closing(self, call: Call) -> bytes:
        assert self._stream is not None
        return self._stream.end(call.finish_reason, call.billed())

    def error(self, call: Call, error: OpenAIError) -> bytes:
        stream = self._stream or self._new_stream(call)
        body = error.body()["error"]
        return stream.failed(str(body.get("code") or body["type"]), body["message"])


class ResponsesController(Controller):
    path = "/v1/responses"
    guards = (authenticate,)
    tags = ("openai",)

    @inference_post(
        "/",
        status_code=200,
        summary="Create a model response (stateless)",
        operation_class=body_operation(ResponsesRequest),
    )
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, _ = decode_body(await request.body(), ResponsesRequest)
        body = canonical(data)
        renderer = ResponsesRenderer(data)
        return await reply(request, body, renderer, operation="chat", id_prefix="resp_")
