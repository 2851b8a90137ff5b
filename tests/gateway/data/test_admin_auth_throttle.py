"""Guesses at the master key: wrong admin keys are throttled per client address, on the admin
API and the UI's sign-in alike, and a throttled address gets no answer that tells a right
guess from a wrong one."""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

from litestar import Litestar
from litestar.testing import AsyncTestClient

from sluicegate.gateway.app import create_app
from sluicegate.gateway.keys.records import generate_key
from sluicegate.gateway.keys.throttle import FailureThrottle
from sluicegate.gateway.settings import Settings

Client = AsyncTestClient[Litestar]
TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')
GUESSER, ADMIN = "203.0.113.66", "198.51.100.10"


def _settings(base: Settings, routing_yaml: Path) -> Settings:
    # One ingress in front, so that tests can speak from several addresses.
    return dataclasses.replace(
        base, config=str(routing_yaml), admin_auth_failures_per_min=3, trusted_proxy_count=1
    )


def _from(address: str, key: str | None = None) -> dict[str, str]:
    headers = {"x-forwarded-for": address}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return headers


async def test_wrong_master_keys_are_throttled_and_then_the_right_one_too(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = _settings(gateway_settings, routing_yaml)
    async with AsyncTestClient(create_app(settings)) as client:
        # Guesses shaped like a master key and like an API key both count.
        for guess in ("hunter2", "sg-master-guess", generate_key()[0]):
            wrong = await client.get("/admin/keys", headers=_from(GUESSER, guess))
            assert wrong.status_code == 401, wrong.text

        for key in ("another-guess", settings.master_key):
            refused = await client.get("/admin/keys", headers=_from(GUESSER, key))
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "admin_auth_rate_limited" and error["type"] == "requests"
            assert 1 <= int(refused.headers["retry-after"]) <= 60

        # Another address is not held back, and neither is a request with no key at all.
        mine = await client.get("/admin/keys", headers=_from(ADMIN, settings.master_key))
        assert mine.status_code == 200
        assert (await client.get("/admin/keys", headers=_from(GUESSER))).status_code == 401


async def test_a_plain_key_refused_with_403_is_no_failed_guess(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = _settings(gateway_settings, routing_yaml)
    async with AsyncTestClient(create_app(settings)) as client:
        created = await client.post(
            "/admin/keys", json={"name": "m"}, headers=_from(ADMIN, settings.master_key)
        )
        member = created.json()["key"]
        for _ in range(5):
            denied = await client.get("/admin/keys", headers=_from(GUESSER, member))
            assert denied.status_code == 403
        ok = await client.get("/admin/keys", headers=_from(GUESSER, settings.master_key))
        assert ok.status_code == 200


async def test_ui_sign_in_shares_the_throttle(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = _settings(gateway_settings, routing_yaml)
    async with AsyncTestClient(create_app(settings), base_url="https://testserver.local") as client:

        async def sign_in(key: str, address: str) -> tuple[int, str, dict[str, str]]:
            page = await client.get("/ui", headers=_from(address))
            token = TOKEN.search(page.text).group(1)  # type: ignore[union-attr]
            response = await client.post(
                "/ui/sign-in",
                data={"csrf_token": token, "key": key},
                headers=_from(address),
                follow_redirects=False,
            )
            return response.status_code, response.text, dict(response.headers)

        for n in range(3):
            assert (await sign_in(f"guess-{n}", GUESSER))[0] == 401
        status, page, headers = await sign_in(settings.master_key, GUESSER)
        assert status == 429 and "Too many failed sign-ins" in page
        assert int(headers["retry-after"]) >= 1
        assert "sg_ui_session" not in client.cookies
        # The admin API from that address is held back as well: one count per address.
        api = await client.get("/admin/keys", headers=_from(GUESSER, settings.master_key))
        assert api.status_code == 429
        assert (await sign_in(settings.master_key, ADMIN))[0] == 303


def test_the_throttle_lets_an_address_in_again_once_its_window_has_passed() -> None:
    throttle = FailureThrottle(limit=2, window_s=0.3)
    for _ in range(2):
        assert throttle.retry_after("a") is None
        throttle.record_failure("a")
    held = throttle.retry_after("a")
    assert held is not None and 0 < held <= 0.3
    assert throttle.retry_after("b") is None
    time.sleep(0.35)
    assert throttle.retry_after("a") is None
    throttle.record_failure("a")
    assert throttle.retry_after("a") is None, "a new window counts from zero"


def test_no_cap_when_the_limit_is_zero() -> None:
    throttle = FailureThrottle(limit=0)
    for _ in range(100):
        throttle.record_failure("a")
    assert throttle.retry_after("a") is None
