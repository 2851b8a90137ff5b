"""``POST /v1/embeddings``: routed to the model's deployments that serve embeddings
(``mode: embeddings``, OpenAI-compatible upstreams), with the same keys, limits, budgets and
usage records as chat."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response

from sluicegate.gateway.admission.admit import admit
from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.api.openapi_body import body_operation
from sluicegate.gateway.schemas.embeddings import EmbeddingRequest
from sluicegate.gateway.schemas.wire import decode_body
from sluicegate.gateway.services import authenticate


class EmbeddingsController(Controller):
    path = "/v1/embeddings"
    guards = (authenticate,)
    tags = ("openai",)

    @inference_post(
        "/",
        status_code=200,
        summary="Create embeddings",
        operation_class=body_operation(EmbeddingRequest),
    )
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        data, document = decode_body(await request.body(), EmbeddingRequest)
        data.check()
        body = data.canonical(document)
        call = await admit(
            request,
            body,
            operation="embeddings",
            id_prefix="",
            mode="embeddings",
            early=request.app.state.services.router.embed,
        )
        return await call.embed()
