"""The LoRA adapters page in a real browser: a team admin registers an adapter for its team,
sees the global ones beside it but not another team's, is told why a bad one was refused, and
deletes its own; the master key registers a global one."""

from __future__ import annotations

from pathlib import Path

from playwright.sync_api import Page, expect

from .conftest import Admin
from .test_admin_ui import nav, shot, sign_in


def test_a_team_admin_registers_and_deletes_its_teams_adapters(
    admin: Admin, page: Page, screenshot_dir: Path
) -> None:
    ours = admin.post("/admin/teams", {"name": "support"})
    theirs = admin.post("/admin/teams", {"name": "growth"})
    lead = admin.post(
        "/admin/keys", {"name": "support-lead", "team_id": ours["id"], "role": "team_admin"}
    )
    admin.post("/admin/adapters", {"name": "shared", "base_model": "tiny", "path": "/a/shared"})
    admin.post(
        "/admin/adapters",
        {"name": "growth-only", "base_model": "tiny", "path": "/a/g", "team_id": theirs["id"]},
    )

    sign_in(page, lead["key"])
    nav(page, "Adapters").click()
    expect(page.get_by_role("heading", name="LoRA adapters")).to_be_visible()
    expect(page.get_by_role("cell", name="tiny:shared")).to_be_visible()
    assert "growth-only" not in page.content()
    expect(page.get_by_label("Team")).to_have_count(0)
    expect(page.get_by_role("button", name="Delete tiny:shared")).to_have_count(0)

    page.get_by_label("Adapter name").fill("tone")
    page.get_by_label("Base model").fill("tiny")
    page.get_by_label("Path on the workers").fill("/adapters/tone")
    page.get_by_label("Input price per 1M tokens (USD)").fill("0.5")
    page.get_by_label("Output price per 1M tokens (USD)").fill("1.5")
    page.get_by_role("button", name="Register adapter").click()
    expect(page.get_by_text("Adapter registered.")).to_be_visible()
    row = page.get_by_role("row").filter(has_text="tiny:tone")
    expect(row).to_contain_text("support")
    expect(row).to_contain_text("0.5 in / 1.5 out USD")
    shot(page, screenshot_dir, "20-team-admin-adapters")

    page.get_by_label("Adapter name").fill("tone")
    page.get_by_label("Base model").fill("tiny")
    page.get_by_label("Path on the workers").fill("/adapters/again")
    page.get_by_role("button", name="Register adapter").click()
    expect(page.get_by_role("alert")).to_contain_text("already has an adapter named 'tone'")

    page.get_by_role("button", name="Delete tiny:tone").click()
    expect(page.get_by_text("Adapter deleted.")).to_be_visible()
    expect(page.get_by_role("cell", name="tiny:tone")).to_have_count(0)


def test_the_master_key_registers_a_global_adapter(admin: Admin, page: Page) -> None:
    admin.post("/admin/teams", {"name": "search"})
    sign_in(page, admin.headers["authorization"].removeprefix("Bearer "))
    nav(page, "Adapters").click()
    page.get_by_label("Adapter name").fill("everyone")
    page.get_by_label("Base model").fill("tiny")
    page.get_by_label("Path on the workers").fill("/adapters/everyone")
    expect(page.get_by_label("Team")).to_have_value("")
    page.get_by_role("button", name="Register adapter").click()
    row = page.get_by_role("row").filter(has_text="tiny:everyone")
    expect(row).to_contain_text("global")
    expect(row).to_contain_text("the base model's")
