"""API-key management through the admin HTTP API, against real PostgreSQL and Redis."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import uuid
from typing import Any

from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.models import ApiKey
from sluicegate.gateway.keys.throttle import FailureThrottle


async def _create(client: AsyncTestClient[Litestar], **fields: Any) -> dict[str, Any]:
    response = await client.post("/admin/keys", json={"name": "team-a", **fields})
    assert response.status_code == 201, response.text
    return response.json()


async def test_create_returns_plaintext_once_and_stores_only_its_hash(
    admin_client: AsyncTestClient[Litestar], db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    created = await _create(
        admin_client,
        allowed_models=["llama3", "qwen"],
        rpm_limit=60,
        tpm_limit=10_000,
        max_parallel_requests=4,
        token_budget=1_000_000,
        budget_period="month",
        expires_at="2099-01-01T00:00:00Z",
        metadata={"team": "a"},
    )
    plaintext = created["key"]
    assert re.fullmatch(r"sk-[A-Za-z0-9_-]{32,}", plaintext)
    assert plaintext.startswith(created["key_prefix"]) and len(created["key_prefix"]) < 16
    assert created["allowed_models"] == ["llama3", "qwen"]
    assert created["budget_period"] == "month" and created["revoked"] is False
    assert created["metadata"] == {"team": "a"}

    for response in (
        await admin_client.get(f"/admin/keys/{created['id']}"),
        await admin_client.get("/admin/keys"),
    ):
        assert response.status_code == 200
        assert plaintext not in response.text and '"key"' not in response.text

    async with db_sessionmaker() as session:
        row = (await session.execute(select(ApiKey))).scalar_one()
        assert row.key_hash == hashlib.sha256(plaintext.encode()).hexdigest()
        dump = (await session.execute(text("SELECT row_to_json(k)::text FROM api_keys k"))).scalar()
    assert plaintext not in dump


async def test_list_get_patch_revoke(admin_client: AsyncTestClient[Litestar]) -> None:
    first = await _create(admin_client, rpm_limit=10)
    second = await _create(admin_client, name="team-b")

    listed = (await admin_client.get("/admin/keys")).json()["data"]
    assert {k["id"] for k in listed} == {first["id"], second["id"]}

    got = (await admin_client.get(f"/admin/keys/{first['id']}")).json()
    assert got["rpm_limit"] == 10 and got["name"] == "team-a"

    patched = await admin_client.patch(
        f"/admin/keys/{first['id']}",
        json={"rpm_limit": None, "tpm_limit": 500, "allowed_models": ["m1"]},
    )
    assert patched.status_code == 200, patched.text
    body = patched.json()
    assert body["rpm_limit"] is None and body["tpm_limit"] == 500
    assert body["allowed_models"] == ["m1"] and body["name"] == "team-a"
    assert body["updated_at"] > got["updated_at"]

    revoked = await admin_client.delete(f"/admin/keys/{first['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    again = await admin_client.delete(f"/admin/keys/{first['id']}")
    assert again.json()["revoked_at"] == revoked.json()["revoked_at"]

    active = (await admin_client.get("/admin/keys", params={"include_revoked": "false"})).json()
    assert [k["id"] for k in active["data"]] == [second["id"]]


async def test_invalid_input_and_unknown_ids_answer_in_openai_shape(
    admin_client: AsyncTestClient[Litestar],
) -> None:
    bad_period = await admin_client.post("/admin/keys", json={"name": "x", "budget_period": "week"})
    assert bad_period.status_code == 400
    assert bad_period.json()["error"]["type"] == "invalid_request_error"

    negative = await admin_client.post("/admin/keys", json={"name": "x", "rpm_limit": 0})
    assert negative.status_code == 400

    key = await _create(admin_client)
    unknown_field = await admin_client.patch(f"/admin/keys/{key['id']}", json={"key_hash": "x"})
    assert unknown_field.status_code == 400

    missing = uuid.uuid4()
    for response in (
        await admin_client.get(f"/admin/keys/{missing}"),
        await admin_client.patch(f"/admin/keys/{missing}", json={"name": "y"}),
        await admin_client.delete(f"/admin/keys/{missing}"),
        await admin_client.get(f"/admin/keys/{missing}/usage"),
    ):
        assert response.status_code == 404
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_every_admin_route_answers_401_without_the_master_key(
    admin_client: AsyncTestClient[Litestar],
) -> None:
    routes = [
        (method, re.sub(r"\{[^}]+\}", str(uuid.uuid4()), route.path))
        for route in admin_client.app.routes
        if route.path.startswith("/admin")
        for method in route.methods - {"OPTIONS", "HEAD"}
    ]
    assert len(routes) >= 8
    # Two wrong keys a route, from one address: past the admin throttle's cap, which
    # test_admin_auth_throttle.py covers, they would get 429s instead.
    admin_client.app.state.admin_auth_throttle = FailureThrottle(0)
    master = admin_client.headers.pop("authorization")
    wrong = master[:-1] + ("x" if master[-1] != "x" else "y")
    for method, path in routes:
        for headers in ({}, {"authorization": wrong}, {"authorization": master.split()[-1]}):
            response = await admin_client.request(method, path, headers=headers, json={})
            assert response.status_code == 401, (method, path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"


async def test_empty_master_key_locks_the_admin_api(
    admin_client: AsyncTestClient[Litestar],
) -> None:
    app_state = admin_client.app.state
    app_state.settings = dataclasses.replace(app_state.settings, master_key="")
    for header in ("Bearer ", "Bearer"):
        response = await admin_client.get("/admin/keys", headers={"authorization": header})
        assert response.status_code == 401
