"""Teams, team admins, /v1/key/info, key rotation across replicas, and the audit log."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient

from sluicegate.gateway.app import create_app
from sluicegate.gateway.settings import Settings

Client = AsyncTestClient[Litestar]


async def _ok(response: Any, status: int = 200) -> dict[str, Any]:
    assert response.status_code == status, response.text
    return response.json()  # type: ignore[no-any-return]


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _team(client: Client, name: str, **fields: Any) -> dict[str, Any]:
    return await _ok(await client.post("/admin/teams", json={"name": name, **fields}), 201)


async def _key(client: Client, **fields: Any) -> dict[str, Any]:
    return await _ok(await client.post("/admin/keys", json={"name": "k", **fields}), 201)


async def test_team_crud_and_validation(admin_client: Client) -> None:
    team = await _team(
        admin_client,
        "search",
        allowed_models=["tiny"],
        rpm_limit=100,
        max_budget=12.5,
        budget_period="month",
        metadata={"cost_center": "42"},
    )
    assert team["max_budget"] == 12.5 and team["allowed_models"] == ["tiny"]
    assert (await admin_client.post("/admin/teams", json={"name": "search"})).status_code == 409
    bad = await admin_client.post("/admin/teams", json={"name": "x", "budget_period": "week"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "budget_period"

    listed = await _ok(await admin_client.get("/admin/teams"))
    assert [t["name"] for t in listed["data"]] == ["search"]
    patched = await _ok(
        await admin_client.patch(f"/admin/teams/{team['id']}", json={"max_budget": None})
    )
    assert patched["max_budget"] is None and patched["rpm_limit"] == 100

    key = await _key(admin_client, team_id=team["id"])
    assert key["team_id"] == team["id"] and key["role"] == "member"
    busy = await admin_client.delete(f"/admin/teams/{team['id']}")
    assert busy.status_code == 409
    missing_team = await admin_client.post(
        "/admin/keys", json={"name": "x", "team_id": str(uuid.uuid4())}
    )
    assert missing_team.status_code == 404 and missing_team.json()["error"]["param"] == "team_id"

    empty = await _team(admin_client, "empty")
    await _ok(await admin_client.delete(f"/admin/teams/{empty['id']}"))
    assert (await admin_client.get(f"/admin/teams/{empty['id']}")).status_code == 404


async def test_team_admin_manages_only_its_own_team(admin_client: Client) -> None:
    mine = await _team(admin_client, "mine")
    theirs = await _team(admin_client, "theirs")
    admin_key = await _key(admin_client, team_id=mine["id"], role="team_admin")
    other_key = await _key(admin_client, team_id=theirs["id"])
    lone_key = await _key(admin_client)
    as_admin = _bearer(admin_key["key"])

    created = await _ok(
        await admin_client.post(
            "/admin/keys", json={"name": "made-by-lead", "rpm_limit": 5}, headers=as_admin
        ),
        201,
    )
    assert created["team_id"] == mine["id"] and created["key"].startswith("sk-")
    listed = await _ok(await admin_client.get("/admin/keys", headers=as_admin))
    assert {k["id"] for k in listed["data"]} == {admin_key["id"], created["id"]}
    assert listed["total"] == 2
    path = f"/admin/keys/{created['id']}"
    assert (await _ok(await admin_client.patch(path, json={"rpm_limit": 9}, headers=as_admin)))[
        "rpm_limit"
    ] == 9
    rotated = await _ok(
        await admin_client.post(f"{path}/rotate", json={"grace_seconds": 0}, headers=as_admin)
    )
    assert rotated["key"] != created["key"]
    assert (await _ok(await admin_client.delete(path, headers=as_admin)))["revoked"] is True
    usage = await _ok(await admin_client.get(f"/admin/teams/{mine['id']}/usage", headers=as_admin))
    assert usage["team_id"] == mine["id"]
    own_usage = await _ok(await admin_client.get("/admin/usage", headers=as_admin))
    assert own_usage["total"]["requests"] == 0

    forbidden = [
        await admin_client.get(f"/admin/keys/{other_key['id']}", headers=as_admin),
        await admin_client.get(f"/admin/keys/{lone_key['id']}", headers=as_admin),
        await admin_client.patch(
            f"/admin/keys/{other_key['id']}", json={"rpm_limit": 1}, headers=as_admin
        ),
        await admin_client.delete(f"/admin/keys/{other_key['id']}", headers=as_admin),
        await admin_client.post(f"/admin/keys/{other_key['id']}/rotate", headers=as_admin),
        await admin_client.get(f"/admin/keys/{other_key['id']}/usage", headers=as_admin),
        await admin_client.get("/admin/keys", params={"team_id": theirs["id"]}, headers=as_admin),
        await admin_client.post(
            "/admin/keys", json={"name": "x", "team_id": theirs["id"]}, headers=as_admin
        ),
        await admin_client.post(
            "/admin/keys", json={"name": "x", "role": "team_admin"}, headers=as_admin
        ),
        await admin_client.patch(
            f"/admin/keys/{created['id']}", json={"team_id": theirs["id"]}, headers=as_admin
        ),
        await admin_client.get("/admin/teams", headers=as_admin),
        await admin_client.post("/admin/teams", json={"name": "x"}, headers=as_admin),
        await admin_client.get(f"/admin/teams/{mine['id']}", headers=as_admin),
        await admin_client.patch(
            f"/admin/teams/{mine['id']}", json={"rpm_limit": 1}, headers=as_admin
        ),
        await admin_client.delete(f"/admin/teams/{theirs['id']}", headers=as_admin),
        await admin_client.get(f"/admin/teams/{theirs['id']}/usage", headers=as_admin),
        await admin_client.get("/admin/prices", headers=as_admin),
        await admin_client.post(
            "/admin/prices", json={"model": "tiny", "input": 1, "output": 1}, headers=as_admin
        ),
        await admin_client.get("/admin/audit", headers=as_admin),
        await admin_client.get("/admin/models", headers=as_admin),
    ]
    for response in forbidden:
        assert response.status_code == 403, (response.request.url, response.text)
        assert response.json()["error"]["type"] == "permission_error"
    # The other team's key was left as it was.
    untouched = await _ok(await admin_client.get(f"/admin/keys/{other_key['id']}"))
    assert untouched["revoked"] is False and untouched["rpm_limit"] is None

    member = await _key(admin_client, team_id=mine["id"])
    plain = await admin_client.get("/admin/keys", headers=_bearer(member["key"]))
    assert plain.status_code == 403
    assert (await admin_client.get("/admin/keys", headers=_bearer("sk-nope"))).status_code == 401


async def test_any_key_reads_itself(admin_client: Client) -> None:
    team = await _team(admin_client, "infra", token_budget=1000, max_budget=5.0)
    key = await _key(
        admin_client,
        team_id=team["id"],
        tpm_limit=500,
        token_budget=100,
        max_budget=1.25,
        budget_period="day",
    )
    info = await _ok(await admin_client.get("/v1/key/info", headers=_bearer(key["key"])))
    assert info["key"]["id"] == key["id"] and info["key"]["tpm_limit"] == 500
    assert key["key"] not in str(info) and "key_hash" not in str(info)
    assert info["budget"]["max_budget"] == 1.25 and info["budget"]["remaining"] == 1.25
    assert info["budget"]["remaining_tokens"] == 100
    assert info["team"]["name"] == "infra"
    assert info["team_budget"]["remaining"] == 5.0
    assert info["currency"] == "USD"

    lone = await _key(admin_client)
    lone_info = await _ok(await admin_client.get("/v1/key/info", headers=_bearer(lone["key"])))
    assert lone_info["team"] is None and lone_info["budget"]["remaining"] is None
    assert (await admin_client.get("/v1/key/info")).status_code == 401


@contextlib.asynccontextmanager
async def _replica(settings: Settings) -> AsyncIterator[Client]:
    async with AsyncTestClient(create_app(settings)) as client:
        yield client


async def _status(client: Client, key: str) -> int:
    return (await client.get("/v1/key/info", headers=_bearer(key))).status_code


async def _until(check: Any, deadline_s: float = 5.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not await check():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


async def test_key_info_is_rate_limited_per_key_across_replicas(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = dataclasses.replace(
        gateway_settings, config=str(routing_yaml), key_info_requests_per_min=3
    )
    async with _replica(settings) as first, _replica(settings) as second:
        master = _bearer(settings.master_key)
        busy = await _ok(await first.post("/admin/keys", json={"name": "b"}, headers=master), 201)
        calm = await _ok(await first.post("/admin/keys", json={"name": "c"}, headers=master), 201)
        # The cap counts per minute of the clock: not across a minute's turn, which resets it.
        if time.time() % 60 > 55:
            await asyncio.sleep(60.5 - time.time() % 60)
        assert [await _status(r, busy["key"]) for r in (first, second, first)] == [200] * 3
        refused = await second.get("/v1/key/info", headers=_bearer(busy["key"]))
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert await _status(first, calm["key"]) == 200, "other keys keep their own count"
        assert await _status(first, "sk-" + "x" * 43) == 401


async def test_rotation_grace_is_honoured_on_every_replica(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    # The test polls /v1/key/info as its probe, far more often than a client would.
    settings = dataclasses.replace(
        gateway_settings, config=str(routing_yaml), key_info_requests_per_min=0
    )
    async with _replica(settings) as first, _replica(settings) as second:
        master = _bearer(settings.master_key)
        key = await _ok(await first.post("/admin/keys", json={"name": "r"}, headers=master), 201)
        old = key["key"]
        # Both replicas have the key cached before the rotation.
        assert await _status(first, old) == 200 and await _status(second, old) == 200

        grace_s = 2
        asked_at = time.monotonic()
        rotated = await _ok(
            await first.post(
                f"/admin/keys/{key['id']}/rotate", json={"grace_seconds": grace_s}, headers=master
            )
        )
        new = rotated["key"]
        rotated_at = time.monotonic()
        assert new != old and rotated["id"] == key["id"]
        assert rotated["previous_key_expires_at"] is not None
        for replica in (first, second):
            assert await _status(replica, new) == 200
            assert await _status(replica, old) == 200
        assert time.monotonic() - rotated_at < grace_s, "the machine was too slow to judge"

        for replica in (first, second):
            await _until(lambda replica=replica: _is(replica, old, 401), grace_s + 5)
            assert await _status(replica, new) == 200
        assert time.monotonic() - asked_at >= grace_s

        # Without a grace period the replaced secret stops at once, everywhere.
        again = await _ok(await second.post(f"/admin/keys/{key['id']}/rotate", headers=master))
        for replica in (first, second):
            await _until(lambda replica=replica: _is(replica, new, 401), 2.0)
            assert await _status(replica, again["key"]) == 200


async def _is(client: Client, key: str, status: int) -> bool:
    return await _status(client, key) == status


async def test_every_mutation_is_in_the_audit_log(admin_client: Client) -> None:
    team = await _team(admin_client, "audited", max_budget=1.0)
    await _ok(await admin_client.patch(f"/admin/teams/{team['id']}", json={"rpm_limit": 7}))
    lead = await _key(admin_client, team_id=team["id"], role="team_admin")
    as_lead = _bearer(lead["key"])
    made = await _ok(
        await admin_client.post("/admin/keys", json={"name": "m"}, headers=as_lead), 201
    )
    await _ok(
        await admin_client.patch(f"/admin/keys/{made['id']}", json={"name": "m2"}, headers=as_lead)
    )
    rotation = await admin_client.post(
        f"/admin/keys/{made['id']}/rotate", json={"grace_seconds": 30}, headers=as_lead
    )
    await _ok(rotation)
    await _ok(await admin_client.delete(f"/admin/keys/{made['id']}", headers=as_lead))
    await _ok(
        await admin_client.post("/admin/prices", json={"model": "tiny", "input": 1, "output": 3}),
        201,
    )
    spare = await _team(admin_client, "spare")
    await _ok(await admin_client.delete(f"/admin/teams/{spare['id']}"))
    refused = await admin_client.delete(f"/admin/teams/{team['id']}")
    assert refused.status_code == 409

    log = (await _ok(await admin_client.get("/admin/audit", params={"limit": 100})))["data"]
    assert [(e["action"], e["actor"]) for e in reversed(log)] == [
        ("team.create", "master"),
        ("team.update", "master"),
        ("key.create", "master"),
        ("key.create", f"key:{lead['id']}"),
        ("key.update", f"key:{lead['id']}"),
        ("key.rotate", f"key:{lead['id']}"),
        ("key.revoke", f"key:{lead['id']}"),
        ("price.create", "master"),
        ("team.create", "master"),
        ("team.delete", "master"),
    ]
    secrets = (lead["key"], made["key"], rotation.json()["key"])
    assert not any(secret in str(log) for secret in secrets)
    assert "key_hash" not in str(log)
    update = next(e for e in log if e["action"] == "key.update")
    assert update["before"]["name"] == "m" and update["after"]["name"] == "m2"
    assert update["team_id"] == team["id"] and update["target_id"] == made["id"]
    assert update["request_id"] and update["at"]
    rotate = next(e for e in log if e["action"] == "key.rotate")
    assert rotate["request_id"] == rotation.headers["x-request-id"]
    assert rotate["after"]["grace_seconds"] == 30 and "grace_seconds" not in rotate["before"]
    created = next(e for e in log if e["action"] == "key.create" and e["target_id"] == made["id"])
    assert created["before"] is None and created["after"]["team_id"] == team["id"]
    deleted = next(e for e in log if e["action"] == "team.delete")
    assert (deleted["target_id"], deleted["team_id"]) == (spare["id"], spare["id"])
    assert deleted["before"]["name"] == "spare" and deleted["after"] is None

    page = await _ok(await admin_client.get("/admin/audit", params={"limit": 3, "offset": 2}))
    assert [e["id"] for e in page["data"]] == [e["id"] for e in log[2:5]]
    assert page["has_more"] is True
    by_target = await _ok(await admin_client.get("/admin/audit", params={"target_id": made["id"]}))
    assert [e["action"] for e in by_target["data"]] == [
        "key.revoke",
        "key.rotate",
        "key.update",
        "key.create",
    ]
    by_actor = await _ok(
        await admin_client.get("/admin/audit", params={"actor": "master", "action": "team.create"})
    )
    assert len(by_actor["data"]) == 2


@pytest.mark.parametrize("grace", [-1, "soon"])
async def test_rotation_rejects_a_bad_grace(admin_client: Client, grace: Any) -> None:
    key = await _key(admin_client)
    response = await admin_client.post(
        f"/admin/keys/{key['id']}/rotate", json={"grace_seconds": grace}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "grace_seconds"
