"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API in.

The controller translates Anthropic's body into the canonical request (translate/
anthropic_in.py), runs the shared lifecycle (``sluicegate.gateway.admission.admit`` and ``sluicegate.gateway.call.call``: keys,
limits, routing, usage, traces) and renders the canonical answer as Anthropic's message or
stream of events.
Authentication takes ``x-api-key`` or ``Authorization: Bearer``; ``anthropic-version`` and
``anthropic-beta`` headers are accepted (the wire format here is the current version's).
Errors come in Anthropic's shape via the controller's own exception handlers.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response

from sluicegate.gateway.admission.admit import admit
from sluicegate.gateway.api.anthropic_errors import ANTHROPIC_EXCEPTION_HANDLERS, anthropic_error
from sluicegate.gateway.api.anthropic_thinking import ThinkingSigner, signer_for
from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.call.call import DEPLOYMENT_HEADER, Call
from sluicegate.gateway.call.stream import stream
from sluicegate.gateway.canonical import Chunk
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.schemas.wire import decode_body
from sluicegate.gateway.services import authenticate
from sluicegate.gateway.translate.anthropic_in import CountTokensRequest, MessagesRequest, canonical
from sluicegate.gateway.translate.anthropic_reply import StreamWriter, event, message_body

_encode = msgspec.json.Encoder().encode


class MessagesRenderer:
    """Canonical answers as Anthropic messages; one per request (a stream has state)."""

    def __init__(self, signer: ThinkingSigner) -> None:
        self._sign = signer.sign
        self._writer = StreamWriter(signer.sign)

    def whole(self, call: Call, answer: Answer) -> bytes:
        assert call.usage is not None
        body = message_body(
            call.response_id, call.public_model, answer, call.usage, call.finish_reason, self._sign
        )
        return _encode(body)

    def opening(self, call: Call, first: Chunk) -> bytes:
        prompt = call.prompt_tokens or call.prompt_estimate
        return self._writer.start(call.response_id, call.public_model, prompt)

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        return self._writer.chunk(chunk)

    def closing(self, call: Call) -> bytes:
        return self._writer.end(call.finish_reason, call.billed())

    def error(self, call: Call, error: OpenAIError) -> bytes:
        _, body = anthropic_error(error)
        return event("error", body)


class MessagesController(Controller):
    path = "/v1/messages"
    guards = (authenticate,)
    tags = ("anthropic",)
    exception_handlers = ANTHROPIC_EXCEPTION_HANDLERS

    @inference_post("/", status_code=200, summary="Create a message (Anthropic Messages API)")
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, _ = decode_body(await request.body(), MessagesRequest)
        signer = _signer(request)
        signer.unwrap(data.messages)
        body = canonical(data)
        early = None if body.stream else request.app.state.services.router.complete
        call = await admit(request, body, operation="chat", id_prefix="msg_", early=early)
        renderer = MessagesRenderer(signer)
        response = await (stream(call, renderer) if body.stream else call.complete(renderer))
        return response

    @inference_post("/count_tokens", status_code=200, summary="Count a message's input tokens")
    async def count_tokens(self, request: Request[Any, Any, Any]) -> Response[Any]:
        """``{"input_tokens": N}``: the prompt (system, messages, tools) as the deployment
        that would serve it counts it, with nothing generated; keys and request limits apply
        as to a message."""
        data, _ = decode_body(await request.body(), CountTokensRequest)
        _signer(request).unwrap(data.messages)
        body = canonical(data)
        # Admission reserves the prompt and the output cap; there is no output to reserve.
        body.sampling.max_tokens = 1
        call = await admit(request, body, operation="count_tokens", id_prefix="msg_")
        count = await call.count()
        headers = {DEPLOYMENT_HEADER: call.deployment.name} if call.deployment else {}
        return Response(
            _encode({"input_tokens": count}),
            media_type="application/json",
            headers={**call.admission.headers, **headers},
        )


def _signer(request: Request[Any, Any, Any]) -> ThinkingSigner:
    return signer_for(request.app.state.services.settings.master_key)
