"""The served gateway freezes what its startup made and collects young objects less often;
an app made in a shared process (tests, an embedding program) leaves the collector alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from sluicegate.gateway.settings import Settings

PROBE = textwrap.dedent(
    """
    import asyncio, gc
    from litestar.testing import AsyncTestClient
    from sluicegate.gateway.app import create_app, create_served_app

    async def main():
        async with AsyncTestClient(create_app()):
            print(gc.get_threshold()[0], gc.get_freeze_count())
        async with AsyncTestClient(create_served_app()) as client:
            assert (await client.get("/health/live")).status_code == 200
            print(gc.get_threshold()[0], gc.get_freeze_count() > 10_000)

    asyncio.run(main())
    """
)


def test_only_the_served_app_tunes_the_collector(gateway_settings: Settings) -> None:
    env = {
        **os.environ,
        "SLUICEGATE_DATABASE_URL": gateway_settings.database_url,
        "SLUICEGATE_REDIS_URL": gateway_settings.redis_url,
        "SLUICEGATE_USAGE_STREAM": gateway_settings.usage_stream,
        "SLUICEGATE_RUN_USAGE_FLUSHER": "false",
    }
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    plain, served = done.stdout.split("\n")[:2]
    assert plain == "700 0"
    assert served == "10000 True"
