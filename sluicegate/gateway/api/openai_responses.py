"""``/v1/responses``: OpenAI's Responses API in; the responses it stores, read and deleted.

``POST`` turns the body into a canonical request (translate/responses_in.py), runs the shared
lifecycle (``sluicegate.gateway.admission.admit`` and ``sluicegate.gateway.call.call``) and
comes back as a ``response`` object or the Responses event stream (translate/responses_reply.py).
Errors keep OpenAI's shape (the app's handlers).

``store`` is true unless the client sends false, as in OpenAI's API. A stored response is
written (``sluicegate.gateway.stored``) before its answer ends: a whole body once rendered, a
stream before its last event. So a client that continues it at once (``previous_response_id``)
always finds it; that write is the one database round trip storing adds to a request, and
``store: false`` adds none. ``previous_response_id`` reads one row, before admission, and the
conversation it holds goes through the same translation as the client's own input: it works
on every backend.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get
from litestar.params import FromPath
from litestar.types import Message, Send

from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.api.openai_reply import reply
from sluicegate.gateway.api.openapi_body import body_operation
from sluicegate.gateway.call.call import Call
from sluicegate.gateway.canonical import Chunk
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.db.responses import Owner
from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.http.event_stream import EventStream, Relay
from sluicegate.gateway.http.json_response import JSONBytes
from sluicegate.gateway.schemas.responses import FunctionTool, ResponsesRequest, parse_items
from sluicegate.gateway.schemas.wire import decode_body
from sluicegate.gateway.services import authenticate
from sluicegate.gateway.stored.items import input_items, page, page_options, refuse_unsupported
from sluicegate.gateway.stored.store import ResponseStore, owner_of
from sluicegate.gateway.translate.responses_in import canonical
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
        "store": data.store is not False,
        "previous_response_id": data.previous_response_id,
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
        self._whole: dict[str, Any] | None = None

    @property
    def final(self) -> dict[str, Any] | None:
        """The response object the client got, once the answer ended well."""
        return self._stream.final if self._stream is not None else self._whole

    def _new_stream(self, call: Call) -> ResponsesStream:
        options = self._data.stream_options
        obfuscate = options is None or options.include_obfuscation is not False
        return ResponsesStream(self._envelope(call), obfuscate)

    def _envelope(self, call: Call) -> Envelope:
        return Envelope(call.response_id, call.created, call.public_model, _echo(self._data))

    def whole(self, call: Call, answer: Answer) -> bytes:
        assert call.usage is not None
        body = response_body(self._envelope(call), answer, call.usage, call.finish_reason)
        self._whole = body
        return _encode(body)

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


def _storing(
    relay: Relay,
    renderer: ResponsesRenderer,
    store: ResponseStore,
    owner: Owner,
    items: list[dict[str, Any]],
) -> Relay:
    """The stream's relay, its response stored before the body message that carries the last
    event (rendered, not yet sent) goes out."""

    async def storing_relay(send: Send) -> None:
        stored = False

        async def send_after_storing(message: Message) -> None:
            nonlocal stored
            final = renderer.final
            if final is not None and not stored:
                stored = True
                await store.save(owner, final, items)
            await send(message)

        await relay(send_after_storing)

    return storing_relay


def _asker(request: Request[Any, Any, Any]) -> tuple[ResponseStore, Owner]:
    return request.app.state.response_store, owner_of(request.scope["state"]["api_key"])


def _json(body: dict[str, Any]) -> Response[bytes]:
    return JSONBytes(_encode(body), headers={})


class ResponsesController(Controller):
    path = "/v1/responses"
    guards = (authenticate,)
    tags = ("openai",)

    @inference_post(
        "/",
        status_code=200,
        summary="Create a model response",
        operation_class=body_operation(ResponsesRequest),
    )
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, _ = decode_body(await request.body(), ResponsesRequest)
        store, owner = _asker(request)
        earlier: list[dict[str, Any]] = []
        if data.previous_response_id is not None:
            earlier = await store.history(owner, data.previous_response_id)
        body = canonical(data, parse_items(earlier, "previous_response_id"))
        renderer = ResponsesRenderer(data)
        response = await reply(request, body, renderer, operation="chat", id_prefix="resp_")
        if data.store is False:
            return response
        items = [*earlier, *input_items(data.input)]
        if isinstance(response, EventStream):
            response.relay = _storing(response.relay, renderer, store, owner, items)
        elif renderer.final is not None:
            await store.save(owner, renderer.final, items)
        return response

    @get("/{response_id:str}", summary="Retrieve a stored response")
    async def retrieve(
        self, request: Request[Any, Any, Any], response_id: FromPath[str]
    ) -> Response[bytes]:
        refuse_unsupported(dict(request.query_params), frozenset())
        store, owner = _asker(request)
        return _json(await store.get(owner, response_id))

    @delete("/{response_id:str}", status_code=200, summary="Delete a stored response")
    async def remove(
        self, request: Request[Any, Any, Any], response_id: FromPath[str]
    ) -> Response[bytes]:
        store, owner = _asker(request)
        await store.delete(owner, response_id)
        return _json({"id": response_id, "object": "response", "deleted": True})

    @get("/{response_id:str}/input_items", summary="List a stored response's input items")
    async def list_input_items(
        self, request: Request[Any, Any, Any], response_id: FromPath[str]
    ) -> Response[bytes]:
        limit, order, after = page_options(dict(request.query_params))
        store, owner = _asker(request)
        items = await store.input_items(owner, response_id)
        return _json(page(items, limit=limit, order=order, after=after))
