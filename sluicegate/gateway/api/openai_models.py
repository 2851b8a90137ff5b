"""``GET /v1/models``: the models this key may use."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get

from sluicegate.gateway.http.json_response import JSON
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.schemas.wire import ModelCard, ModelList, encode
from sluicegate.gateway.services import Services, authenticate


class ModelsController(Controller):
    path = "/v1/models"
    guards = (authenticate,)
    tags = ("openai",)

    @get("/", summary="List the models this key may use")
    async def list_models(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        services: Services = request.app.state.services
        key: ApiKeyRecord = request.scope["state"]["api_key"]
        cards = [
            ModelCard(id=route.name, created=services.started_at, owned_by="sluicegate")
            for route in await services.router.live_routes()
            if key.allows_model(route.name) or any(key.allows_model(a) for a in route.aliases)
        ]
        return Response(encode(ModelList(data=cards)), media_type=JSON)
