"""The UI's sessions, lists and forms without a browser: who may sign in, when a session ends,
paging, what a refused or accepted save shows."""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import io
import os
import re
import uuid
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway import up
from sluicegate.gateway.app import create_app
from sluicegate.gateway.db.usage import insert_usage
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.ui import TEMPLATES

from .usage_rows import usage_row

Client = AsyncTestClient[Litestar]
TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


async def _sign_in(client: Client, key: str) -> Any:
    page = await client.get("/ui", headers={"authorization": ""})
    token = TOKEN.search(page.text).group(1)  # type: ignore[union-attr]
    return await client.post(
        "/ui/sign-in", data={"csrf_token": token, "key": key}, follow_redirects=False
    )


async def _key(client: Client, **fields: Any) -> dict[str, Any]:
    response = await client.post("/admin/keys", json={"name": "k", **fields})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


async def test_only_master_and_team_admin_keys_sign_in(admin_client: Client) -> None:
    team = (await admin_client.post("/admin/teams", json={"name": "t"})).json()
    member = await _key(admin_client, team_id=team["id"])
    lead = await _key(admin_client, team_id=team["id"], role="team_admin")

    refused = await _sign_in(admin_client, member["key"])
    assert refused.status_code == 403 and "team admin key" in refused.text
    wrong = await _sign_in(admin_client, "sk-" + "x" * 43)
    assert wrong.status_code == 401
    assert "sg_ui_session" not in admin_client.cookies

    signed_in = await _sign_in(admin_client, lead["key"])
    assert signed_in.status_code == 303 and signed_in.headers["location"] == "/ui"
    cookie = signed_in.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and lead["key"] not in cookie
    assert (await admin_client.get("/ui/keys")).status_code == 200

    # Revoking the key ends its UI sessions at once.
    await admin_client.delete(f"/admin/keys/{lead['id']}")
    after = await admin_client.get("/ui/keys", follow_redirects=False)
    assert after.status_code == 303 and after.headers["location"] == "/ui"


async def test_rotating_a_team_admin_key_away_ends_its_sessions(admin_client: Client) -> None:
    team = (await admin_client.post("/admin/teams", json={"name": "t"})).json()
    lead = await _key(admin_client, team_id=team["id"], role="team_admin")
    assert (await _sign_in(admin_client, lead["key"])).status_code == 303
    rotated = await admin_client.post(
        f"/admin/keys/{lead['id']}/rotate", json={"grace_seconds": 60}
    )
    assert rotated.status_code == 200
    # Within the grace period the session lives on; a rotation without grace ends it.
    assert (await admin_client.get("/ui/keys")).status_code == 200
    await admin_client.post(f"/admin/keys/{lead['id']}/rotate", json={"grace_seconds": 0})
    assert (await admin_client.get("/ui/keys", follow_redirects=False)).status_code == 303


async def test_keys_pages_search_and_page(admin_client: Client) -> None:
    for i in range(30):
        await _key(admin_client, name=f"svc-{i:02d}")
    await _key(admin_client, name="billing-etl")
    master = admin_client.headers["authorization"].split()[-1]
    assert (await _sign_in(admin_client, master)).status_code == 303

    first = await admin_client.get("/ui/keys")
    assert "31 keys" in first.text and "Page 1 of 2" in first.text
    names = set(re.findall(r">(svc-\d\d|billing-etl)</a>", first.text))
    second = await admin_client.get("/ui/keys", params={"page": 2})
    names_2 = set(re.findall(r">(svc-\d\d|billing-etl)</a>", second.text))
    assert len(names) == 25 and len(names_2) == 6 and not names & names_2
    found = await admin_client.get("/ui/keys", params={"q": "billing"})
    assert re.findall(r">(svc-\d\d|billing-etl)</a>", found.text) == ["billing-etl"]
    # Searched in names and key prefixes: "!" is in neither (a prefix is URL-safe base64,
    # which a plain "zzz" matched in about one run in a hundred).
    nothing = await admin_client.get("/ui/keys", params={"q": "zz!"})
    assert "No key matches" in nothing.text


async def test_key_and_team_forms_refuse_and_save_alike(admin_client: Client) -> None:
    team = (await admin_client.post("/admin/teams", json={"name": "t"})).json()
    key = await _key(admin_client, team_id=team["id"])
    master = admin_client.headers["authorization"].split()[-1]
    assert (await _sign_in(admin_client, master)).status_code == 303
    token = TOKEN.search((await admin_client.get("/ui/keys")).text).group(1)  # type: ignore[union-attr]

    for kind, row, extra in (("keys", key, {"team_id": team["id"]}), ("teams", team, {})):
        page = f"/ui/{kind}/{row['id']}"
        form = {"csrf_token": token, "name": "renamed", **extra}
        refused = await admin_client.post(page, data={**form, "rpm_limit": "0"})
        assert refused.status_code == 400
        assert "rpm limit must be at least 1" in refused.text
        assert 'id="f-rpm_limit" name="rpm_limit" type="number" value="0"' in refused.text
        nameless = await admin_client.post(page, data={**form, "name": " "})
        assert nameless.status_code == 400 and f"a {kind[:-1]} needs a name" in nameless.text

        saved = await admin_client.post(
            page,
            data={**form, "rpm_limit": "7", "max_budget": "2.5", "budget_period": "day"},
            follow_redirects=False,
        )
        assert saved.status_code == 303 and saved.headers["location"] == f"{page}?notice=saved"
        shown = await admin_client.get(saved.headers["location"])
        assert "Saved." in shown.text and 'value="2.5"' in shown.text
        api = (await admin_client.get(f"/admin/{kind}/{row['id']}")).json()
        assert (api["name"], api["rpm_limit"], api["max_budget"], api["budget_period"]) == (
            "renamed",
            7,
            2.5,
            "day",
        )

    created = await admin_client.post("/ui/teams", data={"csrf_token": token, "name": ""})
    assert created.status_code == 400 and "a team needs a name" in created.text


async def test_forms_keep_the_admin_apis_bounds(admin_client: Client) -> None:
    """What the database cannot hold is the form's 400, as in the admin API, not a 500."""
    key = await _key(admin_client)
    master = admin_client.headers["authorization"].split()[-1]
    assert (await _sign_in(admin_client, master)).status_code == 303
    token = TOKEN.search((await admin_client.get("/ui/keys")).text).group(1)  # type: ignore[union-attr]
    too_big = {
        "rpm_limit": (str(2**31), "rpm limit must be at most 2147483647"),
        "token_budget": (str(2**63), "token budget must be at most 9223372036854775807"),
        "max_budget": ("1e13", "max budget must be at most 1,000,000,000,000"),
    }
    for page in ("/ui/teams", "/ui/keys", f"/ui/keys/{key['id']}"):
        for field, (value, message) in too_big.items():
            form = {"csrf_token": token, "name": "n", field: value}
            refused = await admin_client.post(page, data=form)
            assert refused.status_code == 400 and message in refused.text, (page, field)
    rotate = f"/ui/keys/{key['id']}/rotate"
    grace = await admin_client.post(rotate, data={"csrf_token": token, "grace_seconds": "1e9"})
    assert grace.status_code == 400 and "whole number" in grace.text
    grace = await admin_client.post(rotate, data={"csrf_token": token, "grace_seconds": "9" * 12})
    assert grace.status_code == 400 and "grace seconds must be at most 2592000" in grace.text
    teams = (await admin_client.get("/admin/teams")).json()["data"]
    assert (
        teams == [] and (await admin_client.get(f"/admin/keys/{key['id']}")).json()["name"] == "k"
    )


async def test_a_bad_csv_filter_is_a_400_page(admin_client: Client) -> None:
    master = admin_client.headers["authorization"].split()[-1]
    assert (await _sign_in(admin_client, master)).status_code == 303
    for query, message in (
        ("since=soon", "Since must be a date like 2026-01-31."),
        ("team_id=zz", "Team id is not a valid id."),
    ):
        page = await admin_client.get(f"/ui/usage.csv?{query}")
        assert page.status_code == 400 and message in page.text
        assert page.headers["content-type"].startswith("text/html")
    assert (await admin_client.get("/ui/usage.csv")).status_code == 200


def _requests_stat(page: Any) -> int:
    found = re.search(r'stat-label">Requests</span><span class="stat-value">([\d,]+)<', page.text)
    assert found, page.text
    return int(found.group(1).replace(",", ""))


async def test_usage_filters_by_key_model_and_dates(
    admin_client: Client, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    team = (await admin_client.post("/admin/teams", json={"name": "t"})).json()
    a = await _key(admin_client, team_id=team["id"])
    b = await _key(admin_client)
    lead = await _key(admin_client, team_id=team["id"], role="team_admin")
    today = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    earlier = today - dt.timedelta(days=3)
    rows = [
        (a, team["id"], "m1", today, 100, 50),
        (a, team["id"], "m2", today, 200, 0),
        (a, team["id"], "m1", earlier, 300, 300),
        (b, None, "m1", today, 10, 10),
    ]
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [
                usage_row(key["id"], model, when, prompt, completion, team_id=team_id)
                for key, team_id, model, when, prompt, completion in rows
            ],
        )
    master = admin_client.headers["authorization"].split()[-1]
    assert (await _sign_in(admin_client, master)).status_code == 303

    async def csv_rows(**params: str) -> list[tuple[str, str, str, int]]:
        response = await admin_client.get("/ui/usage.csv", params=params)
        assert response.status_code == 200, response.text
        lines = list(csv.DictReader(io.StringIO(response.text)))
        return sorted((r["day"], r["key_id"], r["model"], int(r["total_tokens"])) for r in lines)

    day, before = today.date().isoformat(), earlier.date().isoformat()
    assert await csv_rows(key_id=a["id"]) == [
        (before, a["id"], "m1", 600),
        (day, a["id"], "m1", 150),
        (day, a["id"], "m2", 200),
    ]
    assert await csv_rows(model="m2") == [(day, a["id"], "m2", 200)]
    assert await csv_rows(key_id=a["id"], model="m1") == [
        (before, a["id"], "m1", 600),
        (day, a["id"], "m1", 150),
    ]
    assert await csv_rows(since=before, until=before) == [(before, a["id"], "m1", 600)]
    # Sorted as csv_rows sorts: the two keys' ids are random.
    assert await csv_rows(since=day) == sorted(
        [(day, a["id"], "m1", 150), (day, a["id"], "m2", 200), (day, b["id"], "m1", 20)]
    )
    assert await csv_rows(team_id=team["id"], since=day, model="m1") == [(day, a["id"], "m1", 150)]
    pages = [
        ({}, 4),
        ({"key_id": b["id"]}, 1),
        ({"model": "m1"}, 3),
        ({"since": before, "until": before}, 1),
        ({"team_id": team["id"], "model": "m2"}, 1),
    ]
    for params, requests in pages:
        page = await admin_client.get("/ui/usage", params=params)
        assert page.status_code == 200 and _requests_stat(page) == requests, params

    # A team admin's selection stays inside its team, whatever key or team it names.
    admin_client.cookies.clear()
    assert (await _sign_in(admin_client, lead["key"])).status_code == 303
    assert await csv_rows(key_id=b["id"]) == []
    assert len(await csv_rows(team_id=str(uuid.uuid4()))) == 3
    page = await admin_client.get("/ui/usage", params={"key_id": b["id"]})
    assert _requests_stat(page) == 0


async def test_teams_are_created_and_deleted_from_the_ui_by_the_master_only(
    admin_client: Client,
) -> None:
    master = admin_client.headers["authorization"].split()[-1]
    assert (await _sign_in(admin_client, master)).status_code == 303
    token = TOKEN.search((await admin_client.get("/ui/teams")).text).group(1)  # type: ignore[union-attr]
    form = {"csrf_token": token, "name": "search", "rpm_limit": "40", "max_budget": "12.5"}
    created = await admin_client.post("/ui/teams", data=form, follow_redirects=False)
    assert created.status_code == 303 and created.headers["location"] == "/ui/teams?notice=created"
    (team,) = (await admin_client.get("/admin/teams")).json()["data"]
    assert (team["name"], team["rpm_limit"], team["max_budget"]) == ("search", 40, 12.5)
    taken = await admin_client.post("/ui/teams", data=form)
    assert taken.status_code == 409 and "exists already" in taken.text

    lead = await _key(admin_client, team_id=team["id"], role="team_admin")
    busy = await admin_client.post(f"/ui/teams/{team['id']}/delete", data={"csrf_token": token})
    assert busy.status_code == 409 and "still has 1 keys" in busy.text

    admin_client.cookies.clear()
    assert (await _sign_in(admin_client, lead["key"])).status_code == 303
    lead_token = TOKEN.search((await admin_client.get("/ui/teams")).text).group(1)  # type: ignore[union-attr]
    refused = [
        await admin_client.post("/ui/teams", data={**form, "csrf_token": lead_token, "name": "x"}),
        await admin_client.post(f"/ui/teams/{team['id']}/delete", data={"csrf_token": lead_token}),
        await admin_client.post(
            f"/ui/teams/{team['id']}", data={"csrf_token": lead_token, "name": "mine now"}
        ),
    ]
    assert [response.status_code for response in refused] == [403, 403, 403]
    assert [t["name"] for t in (await admin_client.get("/admin/teams")).json()["data"]] == [
        "search"
    ]

    moved = await admin_client.patch(
        f"/admin/keys/{lead['id']}", json={"team_id": None, "role": "member"}
    )
    assert moved.status_code == 200, moved.text
    admin_client.cookies.clear()
    assert (await _sign_in(admin_client, master)).status_code == 303
    token = TOKEN.search((await admin_client.get("/ui/teams")).text).group(1)  # type: ignore[union-attr]
    deleted = await admin_client.post(
        f"/ui/teams/{team['id']}/delete", data={"csrf_token": token}, follow_redirects=False
    )
    assert deleted.status_code == 303 and deleted.headers["location"] == "/ui/teams?notice=deleted"
    assert (await admin_client.get(f"/admin/teams/{team['id']}")).status_code == 404
    actions = [e["action"] for e in (await admin_client.get("/admin/audit")).json()["data"]]
    assert actions[0] == "team.delete" and "team.create" in actions


async def test_ui_cookies_are_secure_unless_turned_off_for_plain_http(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    def set_cookies(response: Any) -> list[str]:
        return response.headers.get_list("set-cookie")  # type: ignore[no-any-return]

    # Behind a TLS-terminating ingress the gateway itself sees plain http.
    settings = dataclasses.replace(gateway_settings, config=str(routing_yaml))
    async with AsyncTestClient(create_app(settings), base_url="http://testserver.local") as client:
        (signin_cookie,) = set_cookies(await client.get("/ui"))
        assert "; Secure" in signin_cookie

    async with AsyncTestClient(create_app(settings), base_url="https://testserver.local") as client:
        signed_in = await _sign_in(client, settings.master_key)
        assert signed_in.status_code == 303
        assert all("; Secure" in cookie for cookie in set_cookies(signed_in))
        assert (await client.get("/ui/keys", follow_redirects=False)).status_code == 200
        signed_out = await client.post(
            "/ui/sign-out", data={"csrf_token": await _page_token(client, "/ui/keys")}
        )
        assert signed_out.status_code == 200
        assert all("; Secure" in cookie for cookie in set_cookies(signed_out.history[0]))

    # ``sluicegate up``'s case: the browser speaks plain http to 127.0.0.1.
    local = dataclasses.replace(settings, ui_insecure_cookies=True)
    async with AsyncTestClient(create_app(local), base_url="http://testserver.local") as client:
        signed_in = await _sign_in(client, settings.master_key)
        assert signed_in.status_code == 303
        assert set_cookies(signed_in) and not any("Secure" in c for c in set_cookies(signed_in))
        assert (await client.get("/ui/keys", follow_redirects=False)).status_code == 200


async def _page_token(client: Client, path: str) -> str:
    return TOKEN.search((await client.get(path)).text).group(1)  # type: ignore[union-attr]


def test_up_serves_the_ui_with_cookies_a_browser_sends_back_over_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def gateway_settings_under(environ: dict[str, str]) -> Settings:
        env = up.child_env(environ, "postgresql://db", "redis://r", "sk-admin-x")
        for name in [n for n in os.environ if n.startswith("SLUICEGATE_")]:
            monkeypatch.delenv(name)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return Settings.from_env()

    assert gateway_settings_under({}).ui_insecure_cookies is True
    # Someone serving ``up`` through a TLS proxy of their own may still ask for Secure.
    told = gateway_settings_under({"SLUICEGATE_UI_INSECURE_COOKIES": "false"})
    assert told.ui_insecure_cookies is False


async def test_every_ui_response_forbids_framing_sniffing_and_foreign_code(
    admin_client: Client,
) -> None:
    master = admin_client.headers["authorization"].split()[-1]
    signed_out = [
        await admin_client.get("/ui", headers={"authorization": ""}),
        await admin_client.get("/ui/keys", follow_redirects=False),
        await admin_client.get("/ui/static/app.css"),
        await admin_client.get("/ui/static/app.js"),
        await admin_client.get("/ui/static/no-such-file.js"),
        await admin_client.get("/ui/no-such-page"),
        await admin_client.post("/ui/sign-in", data={"key": "x"}),
    ]
    assert [r.status_code for r in signed_out] == [200, 303, 200, 200, 404, 404, 403]
    assert (await _sign_in(admin_client, master)).status_code == 303
    signed_in = [await admin_client.get(path) for path in ("/ui", "/ui/keys", "/ui/usage")]
    for response in signed_out + signed_in:
        assert response.headers["x-frame-options"] == "DENY", response.url
        assert response.headers["x-content-type-options"] == "nosniff"
        policy = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
    assert "content-security-policy" not in (await admin_client.get("/v1/models")).headers


def test_templates_carry_no_inline_code_or_styles() -> None:
    """What the Content-Security-Policy would refuse, in templates the browser tests do not
    reach too: ``style`` attributes, inline scripts and styles, handler attributes."""
    forbidden = re.compile(
        r"\sstyle\s*=|<style|<script(?![^>]*\ssrc=)|\son[a-z]+\s*=|javascript:", re.IGNORECASE
    )
    templates = sorted(TEMPLATES.glob("*.html"))
    assert templates
    found = [
        f"{t.name}: {m.group(0)}" for t in templates for m in forbidden.finditer(t.read_text())
    ]
    assert not found
