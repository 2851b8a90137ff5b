"""``/admin/adapters``: LoRA adapters on a base model, called as ``base:name``.

The master key registers global adapters (every key may call them) or a team's; a team admin
registers, lists and deletes its own team's, and lists the global ones too. Registering sends
nothing to the workers: the first request naming an adapter has it loaded from its ``path``
by the worker it reaches. The functions here are shared by the API and the web UI.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody
from msgspec import Meta
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.api.admin.guards import actor_of, admin_guard, request_id_of
from sluicegate.gateway.api.admin.keys import sessions
from sluicegate.gateway.api.admin.schemas import Amount, Name
from sluicegate.gateway.api.admin.service import parse_team_id, require_master
from sluicegate.gateway.db import adapters as adapter_queries
from sluicegate.gateway.db import audit
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.db.audit import Actor
from sluicegate.gateway.db.models import LoraAdapterRow
from sluicegate.gateway.errors import Conflict, InvalidRequest, NotFound, PermissionDenied
from sluicegate.gateway.routing.adapters import ADAPTER_NAME_PATTERN, AdapterBook, served_name
from sluicegate.gateway.usage.pricing import from_micros, to_micros

AdapterName = Annotated[str, Meta(pattern=ADAPTER_NAME_PATTERN)]
Path = Annotated[str, Meta(min_length=1, max_length=4096)]


class AdapterCreate(msgspec.Struct, forbid_unknown_fields=True):
    """Prices per million tokens in the gateway's currency; none: the base model's apply."""

    name: AdapterName
    base_model: Name
    path: Path
    """The peft folder (``adapter_config.json`` + ``adapter_model.safetensors``) on the
    workers' filesystem."""
    team_id: str | None = None
    """The team whose keys may call it; a team admin's own team by default, global (master
    key only) when left out by the master key."""
    input: Amount | None = None
    output: Amount | None = None
    cached_input: Amount | None = None
    """Defaults to ``input``."""


class AdapterView(msgspec.Struct):
    id: str
    name: str
    model: str
    """What a client calls: ``base_model:name``."""
    base_model: str
    path: str
    served_as: str
    """The name workers hold it under (their heartbeats' ``loras``)."""
    team_id: str | None
    input: float | None
    cached_input: float | None
    output: float | None
    created_at: dt.datetime

    @classmethod
    def of(cls, row: LoraAdapterRow) -> AdapterView:
        return cls(**adapter_fields(row))


class AdapterList(msgspec.Struct):
    data: list[AdapterView]


def adapter_fields(row: LoraAdapterRow) -> dict[str, Any]:
    def money(micros: int | None) -> float | None:
        return None if micros is None else from_micros(micros)

    return {
        "id": str(row.id),
        "name": row.name,
        "model": f"{row.base_model}:{row.name}",
        "base_model": row.base_model,
        "path": row.path,
        "served_as": served_name(row.name, str(row.id)),
        "team_id": str(row.team_id) if row.team_id is not None else None,
        "input": money(row.input_micros),
        "cached_input": money(row.cached_input_micros),
        "output": money(row.output_micros),
        "created_at": row.created_at,
    }


async def register_adapter(
    session: AsyncSession, actor: Actor, data: AdapterCreate, request_id: str | None
) -> LoraAdapterRow:
    team_id = parse_team_id(data.team_id)
    if not actor.is_master:
        if team_id not in (None, actor.team_id):
            raise PermissionDenied(
                "A team admin may register adapters only for its own team.", param="team_id"
            )
        team_id = actor.team_id
    if team_id is not None and await team_queries.get_team(session, team_id) is None:
        raise NotFound(f"No team with id '{team_id}'.", param="team_id")
    if (data.input is None) != (data.output is None):
        raise InvalidRequest(
            "An adapter's price needs both 'input' and 'output', or neither (the base "
            "model's price then applies).",
            param="input" if data.input is None else "output",
        )
    if data.input is None and data.cached_input is not None:
        raise InvalidRequest("'cached_input' needs 'input' and 'output'.", param="cached_input")
    try:
        async with session.begin_nested():
            row = await adapter_queries.add_adapter(
                session,
                name=data.name,
                base_model=data.base_model,
                path=data.path,
                team_id=team_id,
                input_micros=None if data.input is None else to_micros(data.input),
                cached_input_micros=(
                    None if data.input is None else to_micros(data.cached_input or data.input)
                ),
                output_micros=None if data.output is None else to_micros(data.output),
            )
    except IntegrityError:
        raise Conflict(
            f"The base model '{data.base_model}' already has an adapter named '{data.name}'.",
            param="name",
        ) from None
    await _audit(session, actor, "adapter.create", row, request_id, after=adapter_fields(row))
    return row


async def adapter_for(
    session: AsyncSession, actor: Actor, adapter_id: uuid.UUID, *, to_change: bool = False
) -> LoraAdapterRow:
    """An adapter the actor may see (``to_change``: may delete): a team admin sees its
    team's and the global ones, and changes only its team's."""
    row = await adapter_queries.get_adapter(session, adapter_id)
    if row is None or not (actor.is_master or row.team_id in (None, actor.team_id)):
        raise NotFound(f"No adapter with id '{adapter_id}'.", param="adapter_id")
    if to_change and row.team_id is None:
        require_master(actor)
    return row


async def delete_adapter(
    session: AsyncSession, actor: Actor, adapter_id: uuid.UUID, request_id: str | None
) -> LoraAdapterRow:
    row = await adapter_for(session, actor, adapter_id, to_change=True)
    before = adapter_fields(row)
    await session.delete(row)
    await session.flush()
    await _audit(session, actor, "adapter.delete", row, request_id, before=before)
    return row


async def adapters_for(
    session: AsyncSession, actor: Actor, team_id: uuid.UUID | None, base_model: str | None
) -> list[LoraAdapterRow]:
    """The master key's view (all, or one team's alone), or a team admin's (its team's and
    the global ones)."""
    if actor.is_master:
        if team_id is None:
            return await adapter_queries.list_adapters(session, base_model=base_model)
        return await adapter_queries.list_adapters(
            session, team_id=team_id, with_global=False, base_model=base_model
        )
    if team_id not in (None, actor.team_id):
        raise PermissionDenied("A team admin may list only its own team's adapters.")
    return await adapter_queries.list_adapters(
        session, team_id=actor.team_id, base_model=base_model
    )


async def _audit(
    session: AsyncSession,
    actor: Actor,
    action: str,
    row: LoraAdapterRow,
    request_id: str | None,
    **change: Any,
) -> None:
    await audit.record(
        session,
        actor,
        action,
        target_type="adapter",
        target_id=str(row.id),
        team_id=row.team_id,
        request_id=request_id,
        **change,
    )


class AdaptersController(Controller):
    path = "/admin/adapters"
    guards = (admin_guard,)
    tags = ("admin",)

    @post("/", status_code=201)
    async def register(
        self, request: Request[Any, Any, Any], data: JSONBody[AdapterCreate]
    ) -> AdapterView:
        async with sessions(request)() as session, session.begin():
            row = await register_adapter(session, actor_of(request), data, request_id_of(request))
        adapter_book(request).invalidate()
        return AdapterView.of(row)

    @get("/")
    async def list_adapters(
        self,
        request: Request[Any, Any, Any],
        team_id: FromQuery[uuid.UUID | None] = None,
        base_model: FromQuery[str | None] = None,
    ) -> AdapterList:
        async with sessions(request)() as session:
            rows = await adapters_for(session, actor_of(request), team_id, base_model)
        return AdapterList(data=[AdapterView.of(row) for row in rows])

    @get("/{adapter_id:uuid}")
    async def get_adapter(
        self, request: Request[Any, Any, Any], adapter_id: FromPath[uuid.UUID]
    ) -> AdapterView:
        async with sessions(request)() as session:
            row = await adapter_for(session, actor_of(request), adapter_id)
        return AdapterView.of(row)

    @delete("/{adapter_id:uuid}", status_code=200)
    async def delete_adapter(
        self, request: Request[Any, Any, Any], adapter_id: FromPath[uuid.UUID]
    ) -> AdapterView:
        async with sessions(request)() as session, session.begin():
            row = await delete_adapter(
                session, actor_of(request), adapter_id, request_id_of(request)
            )
        adapter_book(request).invalidate()
        return AdapterView.of(row)


def adapter_book(request: Request[Any, Any, Any]) -> AdapterBook:
    book: AdapterBook = request.app.state.adapters
    return book
