"""The LoRA adapter registry's queries (``lora_adapters``)."""

from __future__ import annotations

import uuid

from sqlalchemy import or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.keys import utcnow
from sluicegate.gateway.db.models import LoraAdapterRow


async def add_adapter(
    session: AsyncSession,
    *,
    name: str,
    base_model: str,
    path: str,
    team_id: uuid.UUID | None,
    input_micros: int | None,
    cached_input_micros: int | None,
    output_micros: int | None,
) -> LoraAdapterRow:
    row = LoraAdapterRow(
        name=name,
        base_model=base_model,
        path=path,
        team_id=team_id,
        input_micros=input_micros,
        cached_input_micros=cached_input_micros,
        output_micros=output_micros,
        created_at=utcnow(),
    )
    session.add(row)
    await session.flush()
    return row


async def list_adapters(
    session: AsyncSession,
    *,
    team_id: uuid.UUID | None = None,
    with_global: bool = True,
    base_model: str | None = None,
) -> list[LoraAdapterRow]:
    """Every adapter (``team_id`` None), or a team's and, with ``with_global``, the global
    ones: what that team's keys may call."""
    query = select(LoraAdapterRow).order_by(LoraAdapterRow.base_model, LoraAdapterRow.name)
    if team_id is not None:
        own = LoraAdapterRow.team_id == team_id
        query = query.where(or_(own, LoraAdapterRow.team_id.is_(None)) if with_global else own)
    if base_model is not None:
        query = query.where(LoraAdapterRow.base_model == base_model)
    return list((await session.execute(query)).scalars())


async def get_adapter(session: AsyncSession, adapter_id: uuid.UUID) -> LoraAdapterRow | None:
    return await session.get(LoraAdapterRow, adapter_id)
