"""A shutdown step that never finishes (even ignoring its cancellation) cannot hold the gateway."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from sluicegate.gateway import app as app_module


async def _stubborn() -> None:
    """Ignores its cancellation and finishes much later, as a stuck close would."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        await asyncio.sleep(2.0)


async def _failing() -> None:
    raise ConnectionError("socket gone")


async def test_a_stuck_step_is_abandoned_and_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(app_module, "SHUTDOWN_STEP_TIMEOUT_S", 0.05)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="sluicegate.gateway.app"):
        await app_module._bounded("lease book", _stubborn())
    assert time.monotonic() - started < 1.0
    assert "lease book did not close" in caplog.text


async def test_a_failing_step_is_logged_and_the_next_still_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []

    async def _closes() -> None:
        ran.append("closed")

    with caplog.at_level(logging.ERROR, logger="sluicegate.gateway.app"):
        await app_module._bounded("redis client", _failing())
        await app_module._bounded("database pool", _closes())
    assert "redis client failed" in caplog.text
    assert ran == ["closed"]
