"""OpenAI's ``/v1/files`` and ``/v1/batches``, scoped to the key's team (others get 404).

A batch's input file is read and checked line by line when the batch is made: a file with bad
lines makes a batch that failed at once, its ``errors`` naming each line, as OpenAI's does; a
good one is copied into the batch's lines and the batch is ``in_progress`` from the start.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.params import FromPath

from sluicegate.gateway.batches.creation import (
    check_metadata,
    create_batch,
    files,
    limit_option,
    owner,
    query_options,
    sessions,
)
from sluicegate.gateway.batches.queries import (
    ACTIVE,
    cancel_batch,
    delete_file,
    insert_file,
    select_batch,
    select_batches,
    select_file,
    select_files,
    utcnow,
)
from sluicegate.gateway.batches.wire import ENDPOINTS, file_object, openai_batch, parse_openai_input
from sluicegate.gateway.db.batch_tables import BatchFile
from sluicegate.gateway.errors import Conflict, InvalidRequest, NotFound
from sluicegate.gateway.http.json_response import JSONBytes
from sluicegate.gateway.services import authenticate

PURPOSES = ("batch",)
_BATCH_FIELDS = frozenset({"input_file_id", "endpoint", "completion_window", "metadata"})


def _json(body: dict[str, Any]) -> Response[bytes]:
    return JSONBytes(msgspec.json.encode(body), headers={})


def _listing(data: list[dict[str, Any]], has_more: bool) -> Response[bytes]:
    return _json(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def _no_file(file_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param=param)


class FilesController(Controller):
    path = "/v1/files"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/", status_code=200, summary="Upload a file")
    async def upload(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        # The body hook read the body already: the form is parsed from that copy.
        await request.body()
        form = await request.form()
        unknown = sorted(set(form.keys()) - {"file", "purpose"})
        if unknown:
            raise InvalidRequest(f"Unrecognized request argument: {unknown[0]}.", param=unknown[0])
        purpose = form.get("purpose")
        if purpose not in PURPOSES:
            raise InvalidRequest(
                f"'purpose' must be one of {', '.join(PURPOSES)} here.", param="purpose"
            )
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("'file' must be a file part.", param="file")
        content = await upload.read()
        store = files(request)
        row = BatchFile(
            id="file-" + os.urandom(12).hex(),
            key_id=owner(request).key_id,
            team_id=owner(request).team_id,
            purpose=purpose,
            filename=upload.filename or "upload.jsonl",
            size=len(content),
            created_at=utcnow(),
            store=store.name,
        )
        row.content = await store.put(row.id, content)
        async with sessions(request)() as session, session.begin():
            await insert_file(session, row)
        return _json(file_object(row))

    @get("/", summary="List files")
    async def list_files(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        query = query_options(request, frozenset({"purpose", "limit", "after", "order"}))
        limit = limit_option(query, 10_000, 10_000)
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
        async with sessions(request)() as session:
            rows = await select_files(
                session,
                owner(request),
                purpose=query.get("purpose"),
                limit=limit + 1,
                after=query.get("after"),
                newest_first=order == "desc",
            )
        return _listing([file_object(r) for r in rows[:limit]], len(rows) > limit)

    @get("/{file_id:str}", summary="Retrieve a file")
    async def retrieve(
        self, request: Request[Any, Any, Any], file_id: FromPath[str]
    ) -> Response[bytes]:
        async with sessions(request)() as session:
            row = await select_file(session, owner(request), file_id)
        if row is None:
            raise _no_file(file_id)
        return _json(file_object(row))

    @get("/{file_id:str}/content", summary="Retrieve a file's content")
    async def content(
        self, request: Request[Any, Any, Any], file_id: FromPath[str]
    ) -> Response[bytes]:
        async with sessions(request)() as session:
            row = await select_file(session, owner(request), file_id)
        if row is None:
            raise _no_file(file_id)
        body = await files(request).get(row.id, row.content)
        return Response(body, media_type="application/octet-stream")

    @delete("/{file_id:str}", status_code=200, summary="Delete a file")
    async def remove(
        self, request: Request[Any, Any, Any], file_id: FromPath[str]
    ) -> Response[bytes]:
        async with sessions(request)() as session, session.begin():
            row = await delete_file(session, owner(request), file_id)
        if row is None:
            raise _no_file(file_id)
        await files(request).delete(file_id)
        return _json({"id": file_id, "object": "file", "deleted": True})


class BatchesController(Controller):
    path = "/v1/batches"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/", status_code=200, summary="Create a batch")
    async def create(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        try:
            data = msgspec.json.decode(await request.body())
        except msgspec.DecodeError:
            raise InvalidRequest("The body is not valid JSON.") from None
        if not isinstance(data, dict):
            raise InvalidRequest("The body must be a JSON object.")
        for name in sorted(set(data) - _BATCH_FIELDS):
            raise InvalidRequest(f"Unrecognized request argument: {name}.", param=name)
        endpoint = data.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise InvalidRequest(
                f"'endpoint' must be one of {', '.join(ENDPOINTS)}.", param="endpoint"
            )
        if data.get("completion_window") != "24h":
            raise InvalidRequest("'completion_window' must be '24h'.", param="completion_window")
        metadata = check_metadata(data.get("metadata"))
        file_id = data.get("input_file_id")
        if not isinstance(file_id, str):
            raise InvalidRequest("'input_file_id' is required.", param="input_file_id")
        asker = owner(request)
        async with sessions(request)() as session:
            row = await select_file(session, asker, file_id)
        if row is None:
            raise _no_file(file_id, "input_file_id")
        if row.purpose != "batch":
            raise InvalidRequest(
                f"File {file_id} has purpose '{row.purpose}', not 'batch'.", param="input_file_id"
            )
        content = await files(request).get(row.id, row.content)
        lines, errors = parse_openai_input(content, endpoint)
        batch = await create_batch(
            sessions(request),
            asker,
            api="openai",
            endpoint=endpoint,
            lines=lines,
            errors=errors,
            input_file_id=file_id,
            metadata=metadata,
        )
        return _json(openai_batch(batch))

    @get("/", summary="List batches")
    async def list_batches(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        query = query_options(request, frozenset({"limit", "after"}))
        limit = limit_option(query, 20, 100)
        async with sessions(request)() as session:
            rows = await select_batches(
                session, owner(request), "openai", limit=limit + 1, after=query.get("after")
            )
        return _listing([openai_batch(b) for b in rows[:limit]], len(rows) > limit)

    @get("/{batch_id:str}", summary="Retrieve a batch")
    async def retrieve(
        self, request: Request[Any, Any, Any], batch_id: FromPath[str]
    ) -> Response[bytes]:
        async with sessions(request)() as session:
            batch = await select_batch(session, owner(request), batch_id, "openai")
        if batch is None:
            raise NotFound(f"No such Batch object: {batch_id}")
        return _json(openai_batch(batch))

    @post("/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
    async def cancel(
        self, request: Request[Any, Any, Any], batch_id: FromPath[str]
    ) -> Response[bytes]:
        async with sessions(request)() as session, session.begin():
            batch = await select_batch(session, owner(request), batch_id, "openai")
            if batch is None:
                raise NotFound(f"No such Batch object: {batch_id}")
            if batch.status not in (*ACTIVE, "cancelling"):
                raise Conflict(f"Cannot cancel a batch with status '{batch.status}'.")
            await cancel_batch(session, batch)
        return _json(openai_batch(batch))
