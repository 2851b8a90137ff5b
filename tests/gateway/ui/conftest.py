"""A real gateway (uvicorn, PostgreSQL, Redis) and headless Chromium driven by Playwright.

Chromium is Debian's ``chromium`` package (``scripts/test`` installs it); Playwright's own
browser download is never used. Screenshots of every page go to ``SLUICEGATE_SCREENSHOT_DIR``
or a temporary folder, printed at the end of the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import uuid
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from playwright.sync_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Page,
    Playwright,
    sync_playwright,
)

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.db.scratch import execute_autocommit, scratch_database
from sluicegate.gateway.settings import Settings

from ..api.servers import ServerThread

_SHOT_DIRS: list[Path] = []


def run_async(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Runs a coroutine to the end on a thread of its own: sync Playwright keeps an event loop
    running on the test's thread, where ``asyncio.run`` refuses to start."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def chromium_path() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise RuntimeError(
        "Chromium is needed for the UI tests: apt-get install -y chromium (scripts/test does)"
    )


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("SLUICEGATE_SCREENSHOT_DIR")
    path = Path(configured) if configured else tmp_path_factory.mktemp("ui-screenshots")
    path.mkdir(parents=True, exist_ok=True)
    _SHOT_DIRS.append(path)
    return path


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for path in _SHOT_DIRS:
        terminalreporter.write_line(f"UI screenshots: {path}")


@pytest.fixture(scope="module")
def ui_settings(
    admin_database_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Settings]:
    config = tmp_path_factory.mktemp("ui-routing") / "models.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "llama-3.1-8b",
                        "aliases": ["llama3"],
                        "price": {"input": 0.2, "output": 0.6, "currency": "USD"},
                        "deployments": [
                            {
                                "provider": "openai",
                                "base_url": "http://127.0.0.1:9/v1",
                                "model": "m",
                            }
                        ],
                    },
                    {
                        "name": "gpt-4o-mini",
                        "price": {"input": 0.15, "cached_input": 0.075, "output": 0.6},
                        "deployments": [
                            {
                                "provider": "openai",
                                "base_url": "http://127.0.0.1:9/v1",
                                "model": "m",
                            }
                        ],
                    },
                ]
            }
        )
    )
    with scratch_database(admin_database_url, prefix="sg_ui") as url:
        unique = uuid.uuid4().hex[:10]
        yield Settings.from_env(
            database_url=url,
            redis_url=redis_url,
            master_key=f"sg-master-{unique}",
            config=str(config),
            usage_stream=f"sg:usage:ui:{unique}",
            run_usage_flusher=False,
        )


@pytest.fixture(scope="module")
def gateway_url(ui_settings: Settings) -> Iterator[str]:
    server = ServerThread(create_asgi_app(ui_settings)).start()
    yield server.url
    server.stop()


@pytest.fixture
def clean_database(ui_settings: Settings) -> None:
    run_async(
        execute_autocommit(
            ui_settings.database_url,
            "TRUNCATE lora_adapters, api_keys, teams, model_prices, audit_log, usage_records, "
            "usage_daily",
        )
    )


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as driver:
        yield driver


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(
        executable_path=chromium_path(), args=["--no-sandbox", "--disable-dev-shm-usage"]
    )
    yield browser
    browser.close()


@pytest.fixture
def context(browser: Browser, gateway_url: str) -> Iterator[BrowserContext]:
    context = browser.new_context(base_url=gateway_url, viewport={"width": 1280, "height": 900})
    elsewhere: list[str] = []
    context.on("request", lambda request: _note_foreign(request.url, gateway_url, elsewhere))
    yield context
    context.close()
    # The UI works offline: no page asks anything of a CDN or any other host.
    assert not elsewhere, f"the UI requested other hosts: {elsewhere}"


def _note_foreign(url: str, gateway_url: str, elsewhere: list[str]) -> None:
    if not url.startswith((f"{gateway_url}/", "data:", "blob:", "about:")):
        elsewhere.append(url)


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())
    refused: list[str] = []
    page.on("console", lambda message: _note_csp_refusal(message, refused))
    yield page
    # Chromium logs, and does not apply, whatever the UI's Content-Security-Policy refuses.
    assert not refused, f"the UI's own pages broke its Content-Security-Policy: {refused}"


def _note_csp_refusal(message: ConsoleMessage, refused: list[str]) -> None:
    if "Content Security Policy" in message.text:
        refused.append(f"{message.location.get('url')}: {message.text}")


class Admin:
    """The admin API over HTTP with the master key, to set a scene quickly."""

    def __init__(self, url: str, settings: Settings) -> None:
        self.url = url
        self.headers = {"authorization": f"Bearer {settings.master_key}"}

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{self.url}{path}", json=body, headers=self.headers)
        assert response.status_code in (200, 201), response.text
        return response.json()  # type: ignore[no-any-return]


@pytest.fixture
def admin(gateway_url: str, ui_settings: Settings, clean_database: None) -> Admin:
    return Admin(gateway_url, ui_settings)
