"""``/admin/prices``: model prices per million tokens, each effective from a moment (master
only). A new price applies to requests admitted from then on; past usage keeps its cost."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get, post
from litestar.params import FromQuery, JSONBody

from sluicegate.gateway.api.admin import service
from sluicegate.gateway.api.admin.guards import actor_of, admin_guard, master_guard, request_id_of
from sluicegate.gateway.api.admin.keys import sessions
from sluicegate.gateway.api.admin.schemas import PriceCreate, PriceList, PriceView
from sluicegate.gateway.db import prices as price_queries
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.usage.pricing import PriceBook


class PricesController(Controller):
    path = "/admin/prices"
    guards = (admin_guard, master_guard)
    tags = ("admin",)

    @post("/", status_code=201)
    async def add_price(
        self, request: Request[Any, Any, Any], data: JSONBody[PriceCreate]
    ) -> PriceView:
        currency = request.app.state.settings.currency
        if data.currency is not None and data.currency.upper() != currency:
            raise InvalidRequest(
                f"Prices are in the gateway's currency {currency}, not {data.currency}.",
                param="currency",
            )
        async with sessions(request)() as session, session.begin():
            row = await service.add_price(
                session,
                actor_of(request),
                model=data.model,
                input=data.input,
                output=data.output,
                cached_input=data.cached_input,
                currency=currency,
                effective_from=data.effective_from,
                request_id=request_id_of(request),
            )
        prices: PriceBook = request.app.state.prices
        prices.invalidate()
        return PriceView.of(row)

    @get("/")
    async def list_prices(
        self, request: Request[Any, Any, Any], model: FromQuery[str | None] = None
    ) -> PriceList:
        async with sessions(request)() as session:
            rows = await price_queries.list_prices(session, model)
        prices: PriceBook = request.app.state.prices
        return PriceList(
            data=[PriceView.of(row) for row in rows],
            configured={name: price.as_dict() for name, price in prices.configured.items()},
        )
