"""Anthropic's Message Batches: ``/v1/messages/batches`` (create, list, retrieve, cancel, delete)
and each batch's ``/results`` as JSONL, scoped to the key's team (others get 404), errors in
Anthropic's shape. Each request's ``params`` is a Messages request, run as ``POST /v1/messages``
of the batch's key."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath

from sluicegate.gateway.api.anthropic_errors import ANTHROPIC_EXCEPTION_HANDLERS
from sluicegate.gateway.batches.creation import (
    create_batch,
    limit_option,
    owner,
    query_options,
    sessions,
)
from sluicegate.gateway.batches.queries import (
    ACTIVE,
    ENDED,
    cancel_batch,
    delete_batch,
    select_batch,
    select_batches,
    select_lines,
)
from sluicegate.gateway.batches.wire import (
    ANTHROPIC_ENDPOINT,
    anthropic_batch,
    anthropic_result,
    parse_anthropic_requests,
)
from sluicegate.gateway.db.batch_tables import Batch
from sluicegate.gateway.errors import InvalidRequest, NotFound
from sluicegate.gateway.http.json_response import JSONBytes
from sluicegate.gateway.services import authenticate


def _json(body: dict[str, Any]) -> Response[bytes]:
    return JSONBytes(msgspec.json.encode(body), headers={})


def _base_url(request: Request[Any, Any, Any]) -> str:
    return str(request.base_url).rstrip("/")


async def _batch(request: Request[Any, Any, Any], batch_id: str) -> Batch:
    async with sessions(request)() as session:
        batch = await select_batch(session, owner(request), batch_id, "anthropic")
    if batch is None:
        raise NotFound(f"No message batch with id '{batch_id}'.")
    return batch


class MessageBatchesController(Controller):
    path = "/v1/messages/batches"
    guards = (authenticate,)
    tags = ("anthropic",)
    exception_handlers = ANTHROPIC_EXCEPTION_HANDLERS

    @post("/", status_code=200, summary="Create a message batch")
    async def create(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        try:
            data = msgspec.json.decode(await request.body())
        except msgspec.DecodeError:
            raise InvalidRequest("The body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise InvalidRequest("The body must be a JSON object.")
        for name in sorted(set(data) - {"requests"}):
            raise InvalidRequest(f"{name}: Extra inputs are not permitted", param=name)
        try:
            lines = parse_anthropic_requests(data.get("requests"))
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="requests") from None
        batch = await create_batch(
            sessions(request), owner(request), api="anthropic", endpoint=ANTHROPIC_ENDPOINT,
            lines=lines,
        )  # fmt: skip
        return _json(anthropic_batch(batch, _base_url(request)))

    @get("/", summary="List message batches")
    async def list_batches(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        query = query_options(request, frozenset({"limit", "after_id"}))
        limit = limit_option(query, 20, 1000)
        async with sessions(request)() as session:
            rows = await select_batches(
                session, owner(request), "anthropic", limit=limit + 1, after=query.get("after_id")
            )
        data = [anthropic_batch(b, _base_url(request)) for b in rows[:limit]]
        return _json(
            {
                "data": data,
                "has_more": len(rows) > limit,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
            }
        )

    @get("/{batch_id:str}", summary="Retrieve a message batch")
    async def retrieve(
        self, request: Request[Any, Any, Any], batch_id: FromPath[str]
    ) -> Response[bytes]:
        return _json(anthropic_batch(await _batch(request, batch_id), _base_url(request)))

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a message batch")
    async def cancel(
        self, request: Request[Any, Any, Any], batch_id: FromPath[str]
    ) -> Response[bytes]:
        batch = await _batch(request, batch_id)
        if batch.status in ACTIVE:
            async with sessions(request)() as session, session.begin():
                await cancel_batch(session, batch)
        return _json(anthropic_batch(batch, _base_url(request)))

    @delete("/{batch_id:str}", status_code=200, summary="Delete a message batch")
    async def remove(
        self, request: Request[Any, Any, Any], batch_id: FromPath[str]
    ) -> Response[bytes]:
        batch = await _batch(request, batch_id)
        if batch.status not in ENDED:
            raise InvalidRequest(
                f"Message batch {batch_id} is still processing; cancel it before deleting it."
            )
        async with sessions(request)() as session, session.begin():
            await delete_batch(session, batch)
        return _json({"id": batch_id, "type": "message_batch_deleted"})

    @get("/{batch_id:str}/results", summary="A message batch's results (JSONL)")
    async def results(
        self, request: Request[Any, Any, Any], batch_id: FromPath[str]
    ) -> Response[bytes]:
        batch = await _batch(request, batch_id)
        if batch.status not in ENDED:
            raise InvalidRequest(f"Message batch {batch_id} has not ended; no results yet.")
        async with sessions(request)() as session:
            lines = await select_lines(session, batch_id)
        body = b"".join(
            msgspec.json.encode(anthropic_result(batch, line)) + b"\n" for line in lines
        )
        return Response(body, media_type="application/binary")
