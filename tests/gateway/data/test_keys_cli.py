"""``sluicegate keys``: create/list/revoke straight in the database, invalidation over Redis."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.models import ApiKey, AuditEntry
from sluicegate.gateway.errors import AuthenticationFailed
from sluicegate.gateway.keys.cache import KeyCache
from sluicegate.gateway.keys.cli import main
from sluicegate.gateway.settings import Settings


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch, gateway_settings: Settings) -> None:
    monkeypatch.setenv("SLUICEGATE_DATABASE_URL", gateway_settings.database_url)
    monkeypatch.setenv("SLUICEGATE_REDIS_URL", gateway_settings.redis_url)


async def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, list(argv))
    return code, capsys.readouterr().out


async def test_create_prints_the_key_once_and_stores_its_hash(
    capsys: pytest.CaptureFixture[str], db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    code, out = await _run(
        capsys,
        "create",
        "--name",
        "cli",
        "--models",
        "a, b",
        "--rpm",
        "5",
        "--tpm",
        "900",
        "--budget-tokens",
        "1000",
        "--budget-period",
        "day",
        "--json",
    )
    assert code == 0
    created = json.loads(out)
    assert created["allowed_models"] == ["a", "b"] and created["rpm_limit"] == 5
    assert created["tpm_limit"] == 900 and created["budget_period"] == "day"
    async with db_sessionmaker() as session:
        row = (await session.execute(select(ApiKey))).scalar_one()
    assert row.key_hash == hashlib.sha256(created["key"].encode()).hexdigest()
    assert row.token_budget == 1000

    code, out = await _run(capsys, "create", "--name", "human")
    plaintext = [line for line in out.splitlines() if line.startswith("sk-")]
    assert code == 0 and len(plaintext) == 1

    code, listing = await _run(capsys, "list")
    assert code == 0 and created["id"] in listing and "human" in listing
    assert created["key"] not in listing and plaintext[0] not in listing


async def test_revoke_invalidates_running_caches(
    capsys: pytest.CaptureFixture[str], key_cache: KeyCache
) -> None:
    _, out = await _run(capsys, "create", "--name", "doomed", "--json")
    created = json.loads(out)
    await key_cache.lookup(created["key"])

    started = time.monotonic()
    code, _ = await _run(capsys, "revoke", created["id"])
    assert code == 0
    while time.monotonic() - started < 2.0:
        try:
            await key_cache.lookup(created["key"])
        except AuthenticationFailed as exc:
            assert "revoked" in exc.message
            break
        await asyncio.sleep(0.005)
    assert time.monotonic() - started < 1.0, "still accepted a second after the revoke"

    _, active = await _run(capsys, "list", "--active", "--json")
    assert active == ""


async def test_bad_input_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = await _run(capsys, "revoke", str(uuid.uuid4()))
    assert code == 1
    with pytest.raises(SystemExit):
        main(["create", "--name", "x", "--budget-period", "week"])
    with pytest.raises(SystemExit):
        main(["create", "--name", "x", "--rpm", "0"])


async def test_cli_changes_are_in_the_audit_log(
    capsys: pytest.CaptureFixture[str], db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    _, out = await _run(capsys, "create", "--name", "audited", "--json")
    created = json.loads(out)
    code, _ = await _run(capsys, "revoke", created["id"])
    assert code == 0
    async with db_sessionmaker() as session:
        entries = (
            (await session.execute(select(AuditEntry).order_by(AuditEntry.id))).scalars().all()
        )
    assert [(e.actor, e.action, e.target_id) for e in entries] == [
        ("cli", "key.create", created["id"]),
        ("cli", "key.revoke", created["id"]),
    ]
    assert created["key"] not in str([(e.before, e.after) for e in entries])
