"""Model prices set through the admin API (the routing YAML's are not stored)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.keys import utcnow
from sluicegate.gateway.db.models import ModelPrice


async def add_price(
    session: AsyncSession,
    *,
    model: str,
    input_micros: int,
    cached_input_micros: int,
    output_micros: int,
    currency: str,
    effective_from: dt.datetime | None,
) -> ModelPrice:
    now = utcnow()
    row = ModelPrice(
        model=model,
        input_micros=input_micros,
        cached_input_micros=cached_input_micros,
        output_micros=output_micros,
        currency=currency,
        effective_from=effective_from or now,
        created_at=now,
    )
    session.add(row)
    await session.flush()
    return row


async def list_prices(session: AsyncSession, model: str | None = None) -> list[ModelPrice]:
    query = select(ModelPrice).order_by(ModelPrice.model, ModelPrice.effective_from.desc())
    if model is not None:
        query = query.where(ModelPrice.model == model)
    return list((await session.execute(query)).scalars())


async def get_price(session: AsyncSession, price_id: int) -> ModelPrice | None:
    return await session.get(ModelPrice, price_id)
