"""The admin web UI in a real browser: headless Chromium, a real gateway, PostgreSQL, Redis."""

from __future__ import annotations

import datetime as dt
import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis
from playwright.sync_api import BrowserContext, Locator, Page, expect

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.db.usage import insert_usage
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.pricing import Price

from .conftest import Admin, run_async

LLAMA = Price(200_000, 200_000, 600_000, "USD")
MINI = Price(150_000, 75_000, 600_000, "USD")


def shot(page: Page, directory: Path, name: str) -> None:
    page.screenshot(path=str(directory / f"{name}.png"), full_page=True)


def nav(page: Page, name: str) -> Locator:
    return page.get_by_role("navigation", name="Main").get_by_role("link", name=name)


def sign_in(page: Page, key: str) -> None:
    page.goto("/ui")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.get_by_label("API key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()


def add_usage(settings: Settings, rows: list[tuple[str, str | None, str, int, int, int]]) -> None:
    """Usage records as the flusher writes them: (key id, team id, model, days ago, in, out)."""
    now = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    prices = {"llama-3.1-8b": LLAMA, "gpt-4o-mini": MINI}
    records: list[dict[str, Any]] = []
    for key_id, team_id, model, days_ago, prompt, completion in rows:
        when = now - dt.timedelta(days=days_ago)
        records.append(
            {
                "request_id": uuid.uuid4().hex,
                "key_id": uuid.UUID(key_id),
                "team_id": uuid.UUID(team_id) if team_id else None,
                "model": model,
                "deployment": None,
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "cost_micros": prices[model].cost_micros(prompt, completion),
                "status": "error" if completion == 0 else "ok",
                "finish_reason": "stop",
                "latency_ms": 100.0,
                "ttft_ms": 20.0,
                "started_at": when,
                "finished_at": when,
            }
        )

    async def write() -> None:
        engine = create_engine(settings.database_url)
        async with create_sessionmaker(engine)() as session, session.begin():
            await insert_usage(session, records)
        await engine.dispose()

    run_async(write())


def test_sign_in_create_a_key_see_its_secret_once_and_revoke_it(
    page: Page, admin: Admin, ui_settings: Settings, gateway_url: str, screenshot_dir: Path
) -> None:
    page.goto("/ui")
    shot(page, screenshot_dir, "01-sign-in")
    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("not accepted")

    sign_in(page, ui_settings.master_key)
    cookie = next(c for c in page.context.cookies() if c["name"] == "sg_ui_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert ui_settings.master_key not in str(page.context.cookies())

    nav(page, "Keys").click()
    expect(page.get_by_text("No keys yet.")).to_be_visible()
    shot(page, screenshot_dir, "02-keys-empty")
    page.get_by_label("Name").fill("search-backend")
    page.get_by_label("Requests / minute").fill("120")
    page.get_by_label("Money budget (USD)").fill("25")
    page.get_by_role("button", name="Create key").click()

    secret_box = page.get_by_label("The new secret")
    secret = secret_box.input_value()
    assert re.fullmatch(r"sk-[A-Za-z0-9_-]{43}", secret)
    expect(page.get_by_text("shown only this once")).to_be_visible()
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.get_by_role("button", name="Copy").click()
    expect(page.get_by_text("Copied to the clipboard.")).to_be_visible()
    shot(page, screenshot_dir, "03-key-created")
    key_info = httpx.get(
        f"{gateway_url}/v1/key/info", headers={"authorization": f"Bearer {secret}"}
    )
    assert key_info.status_code == 200 and key_info.json()["key"]["max_budget"] == 25.0

    page.get_by_role("link", name="Done — go to the key").click()
    expect(page.get_by_role("heading", name="search-backend")).to_be_visible()
    assert secret not in page.content()
    shot(page, screenshot_dir, "04-key-edit")

    page.get_by_label("Requests / minute").fill("60")
    page.get_by_label("Money budget (USD)").fill("12.5")
    page.get_by_label("Budget period").select_option("month")
    page.get_by_role("button", name="Save changes").click()
    expect(page.get_by_text("Saved.")).to_be_visible()
    edited = httpx.get(f"{gateway_url}/v1/key/info", headers={"authorization": f"Bearer {secret}"})
    assert edited.json()["key"]["rpm_limit"] == 60
    assert edited.json()["budget"]["max_budget"] == 12.5
    assert edited.json()["budget"]["budget_period"] == "month"

    page.get_by_label("Grace period (seconds)").fill("300")
    page.get_by_role("button", name="Rotate").click()
    rotated = page.get_by_label("The new secret").input_value()
    assert rotated != secret and rotated.startswith("sk-")
    expect(page.get_by_text("keeps working for 300 seconds")).to_be_visible()
    for usable in (secret, rotated):
        info = httpx.get(
            f"{gateway_url}/v1/key/info", headers={"authorization": f"Bearer {usable}"}
        )
        assert info.status_code == 200
    page.get_by_role("link", name="Done — go to the key").click()
    assert rotated not in page.content() and secret not in page.content()
    page.goto("/ui/keys")
    assert secret not in page.content()
    expect(page.get_by_role("cell", name="search-backend", exact=True)).to_be_visible()
    shot(page, screenshot_dir, "05-keys")

    page.get_by_role("button", name="Revoke search-backend").click()
    expect(page.get_by_text("The key was revoked.")).to_be_visible()
    expect(page.get_by_text("revoked", exact=True)).to_be_visible()
    refused = httpx.get(f"{gateway_url}/v1/key/info", headers={"authorization": f"Bearer {secret}"})
    assert refused.status_code == 401

    nav(page, "Audit log").click()
    expect(page.get_by_role("cell", name="key.revoke")).to_be_visible()
    expect(page.get_by_role("cell", name="key.create")).to_be_visible()
    assert secret not in page.content()
    shot(page, screenshot_dir, "06-audit")

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()
    page.goto("/ui/keys")
    expect(page.get_by_role("heading", name="Sign in")).to_be_visible()


def test_the_overview_charts_daily_tokens_and_spend(
    page: Page, admin: Admin, ui_settings: Settings, screenshot_dir: Path, browser: Any
) -> None:
    team = admin.post("/admin/teams", {"name": "research", "max_budget": 50})
    key = admin.post("/admin/keys", {"name": "notebooks", "team_id": team["id"]})
    other = admin.post("/admin/keys", {"name": "batch-jobs"})
    rows = []
    for days_ago in range(14):
        rows.append(
            (key["id"], team["id"], "llama-3.1-8b", days_ago, 40_000 + 900 * days_ago, 9_000)
        )
        rows.append((other["id"], None, "gpt-4o-mini", days_ago, 20_000, 4_000 + 300 * days_ago))
    rows.append((other["id"], None, "gpt-4o-mini", 0, 10, 0))
    add_usage(ui_settings, rows)

    sign_in(page, ui_settings.master_key)
    expect(page.locator("[data-stat=requests-today]")).to_have_text("3")
    expect(page.locator("[data-stat=requests-30d]")).to_have_text("29")
    chart = page.locator("svg.chart").first
    expect(chart).to_be_visible()
    assert chart.locator("rect").count() == 28
    assert chart.locator("circle").count() == 14
    expect(page.locator("figcaption.legend")).to_contain_text("llama-3.1-8b")
    shot(page, screenshot_dir, "07-overview")

    phone = browser.new_context(
        base_url=page.url.split("/ui")[0], viewport={"width": 390, "height": 844}, is_mobile=True
    )
    phone_page = phone.new_page()
    sign_in(phone_page, ui_settings.master_key)
    for path, name in (("/ui", "08-overview-phone"), ("/ui/keys", "08-keys-phone")):
        phone_page.goto(path)
        width = phone_page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"{path} scrolls sideways on a phone (tables scroll inside)"
        shot(phone_page, screenshot_dir, name)
    phone.close()

    nav(page, "Usage").click()
    page.get_by_label("Team").select_option(label="research")
    page.get_by_role("button", name="Apply").click()
    expect(page.locator("svg.chart rect")).to_have_count(14)
    shot(page, screenshot_dir, "09-usage")
    with page.expect_download() as download:
        page.get_by_role("link", name="Export CSV").click()
    csv_text = Path(download.value.path()).read_text()
    assert csv_text.splitlines()[0].startswith("day,team_id,key_id,model,requests")
    assert len(csv_text.splitlines()) == 15 and "gpt-4o-mini" not in csv_text

    nav(page, "Teams").click()
    expect(page.get_by_role("heading", name="research")).to_be_visible()
    shot(page, screenshot_dir, "10-teams")
    page.get_by_role("link", name="Edit").click()
    shot(page, screenshot_dir, "11-team-edit")
    # A worker announces itself as a real one does: heartbeat key, worker set, model registry.
    model, worker = f"ui-test-{uuid.uuid4().hex[:8]}", "worker-1"
    beat = protocol.Heartbeat(
        worker_id=worker,
        model=model,
        served_model_name=model,
        version="test",
        time=time.time(),
        num_running=3,
        num_waiting=2,
        kv_blocks_total=1000,
        kv_blocks_used=420,
        kv_usage=0.42,
        tokens_per_s=812.5,
        tensor_parallel_size=2,
        dtype="bfloat16",
        weight_dtype="fp8",
        kv_cache_dtype="bfloat16",
    )
    client = redis.Redis.from_url(ui_settings.redis_url)
    client.set(redis_names.heartbeat_key(model, worker), protocol.encode(beat), px=30_000)
    client.sadd(redis_names.worker_registry(model), worker)
    client.zadd(redis_names.MODEL_REGISTRY, {model: time.time()})
    try:
        nav(page, "Models").click()
        expect(page.get_by_text("llama-3.1-8b").first).to_be_visible()
        row = page.get_by_role("row").filter(has_text=model)
        expect(row).to_contain_text("420/1000 blocks")
        # The bar is drawn without an inline style (the CSP forbids those), still 42 % full.
        meter = row.get_by_role("meter", name="KV cache used")
        filled = meter.locator("rect").bounding_box()
        whole = meter.bounding_box()
        assert filled and whole and abs(filled["width"] / whole["width"] - 0.42) < 0.02
        expect(row.get_by_role("cell")).to_have_text(
            [
                worker,
                model,
                "TP 2 · weights fp8 · KV bfloat16",
                "3",
                "2",
                re.compile("42%"),
                "812.5",
                re.compile("ago"),
            ]
        )
        shot(page, screenshot_dir, "12-models")
    finally:
        client.delete(redis_names.heartbeat_key(model, worker), redis_names.worker_registry(model))
        client.zrem(redis_names.MODEL_REGISTRY, model)
        client.close()


def test_a_team_admin_sees_only_their_team(
    context: BrowserContext, page: Page, admin: Admin, ui_settings: Settings, screenshot_dir: Path
) -> None:
    ours = admin.post("/admin/teams", {"name": "payments", "max_budget": 100})
    theirs = admin.post("/admin/teams", {"name": "growth"})
    lead = admin.post(
        "/admin/keys", {"name": "payments-lead", "team_id": ours["id"], "role": "team_admin"}
    )
    ours_key = admin.post("/admin/keys", {"name": "payments-api", "team_id": ours["id"]})
    theirs_key = admin.post("/admin/keys", {"name": "growth-api", "team_id": theirs["id"]})
    add_usage(
        ui_settings,
        [
            (ours_key["id"], ours["id"], "llama-3.1-8b", 1, 5_000, 1_000),
            (theirs_key["id"], theirs["id"], "gpt-4o-mini", 1, 7_000, 2_000),
        ],
    )

    sign_in(page, lead["key"])
    expect(page.get_by_text("team admin · payments")).to_be_visible()
    expect(page.locator("[data-stat=requests-30d]")).to_have_text("1")
    nav(page, "Keys").click()
    expect(page.get_by_role("cell", name="payments-api", exact=True)).to_be_visible()
    assert "growth" not in page.content()
    expect(page.get_by_label("Team")).to_have_count(0)
    shot(page, screenshot_dir, "13-team-admin-keys")

    page.get_by_label("Name").fill("payments-worker")
    page.get_by_role("button", name="Create key").click()
    expect(page.get_by_text("shown only this once")).to_be_visible()

    nav(page, "Teams").click()
    expect(page.get_by_role("heading", name="payments")).to_be_visible()
    assert "growth" not in page.content()
    nav(page, "Usage").click()
    assert "growth" not in page.content() and "gpt-4o-mini" not in page.content()
    nav(page, "Audit log").click()
    assert "growth" not in page.content()
    expect(page.get_by_role("cell", name="key.create").first).to_be_visible()

    response = page.goto(f"/ui/keys/{theirs_key['id']}")
    assert response is not None and response.status == 403
    expect(page.get_by_role("heading", name="Not allowed")).to_be_visible()
    response = page.goto(f"/ui/teams/{theirs['id']}")
    assert response is not None and response.status == 403
    shot(page, screenshot_dir, "14-team-admin-forbidden")
    csrf = context.request.get("/ui/keys")
    token = re.search(r'name="csrf_token" value="([^"]+)"', csrf.text()).group(1)  # type: ignore[union-attr]
    revoke = context.request.post(
        f"/ui/keys/{theirs_key['id']}/revoke", form={"csrf_token": token}, max_redirects=0
    )
    assert revoke.status == 403
    still = httpx.get(f"{admin.url}/admin/keys/{theirs_key['id']}", headers=admin.headers).json()
    assert still["revoked"] is False


def test_a_form_without_its_csrf_token_is_refused(
    context: BrowserContext, page: Page, admin: Admin, ui_settings: Settings, screenshot_dir: Path
) -> None:
    sign_in(page, ui_settings.master_key)
    page.goto("/ui/keys")
    form = page.locator("form[action='/ui/keys']")
    form.locator("input[name=csrf_token]").evaluate("input => input.remove()")
    page.get_by_label("Name").fill("sneaky")
    page.get_by_role("button", name="Create key").click()
    expect(page.get_by_role("heading", name="Form refused")).to_be_visible()
    shot(page, screenshot_dir, "15-csrf-refused")
    keys = httpx.get(f"{admin.url}/admin/keys", headers=admin.headers).json()["data"]
    assert keys == []

    forged = context.request.post("/ui/keys", form={"name": "forged", "csrf_token": "guess"})
    assert forged.status == 403
    no_cookie = httpx.post(
        f"{admin.url}/ui/sign-in", data={"key": ui_settings.master_key, "csrf_token": "x"}
    )
    assert no_cookie.status_code == 403
    assert httpx.get(f"{admin.url}/admin/keys", headers=admin.headers).json()["data"] == []
