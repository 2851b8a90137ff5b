"""``GET /v1/models``: the models this key may use, and the LoRA adapters it may call (its
team's and the global ones, on a base model that is live), each with ``parent`` set to its
base model."""

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
        live = await services.router.live_routes()
        cards = [
            ModelCard(id=route.name, created=services.started_at, owned_by="sluicegate")
            for route in live
            if key.allows_model(route.name) or any(key.allows_model(a) for a in route.aliases)
        ]
        if services.adapters is not None:
            bases = {name for route in live for name in [route.name, *route.aliases]}
            cards += [
                ModelCard(
                    id=name,
                    created=services.started_at,
                    owned_by="sluicegate",
                    parent=adapter.base_model,
                )
                for name, adapter in await services.adapters.callable_by(key.team_id)
                if adapter.base_model in bases
                and (key.allows_model(name) or key.allows_model(adapter.model_name))
            ]
        return Response(encode(ModelList(data=cards)), media_type=JSON)
