"""Bedrock's credentials come from botocore's synchronous chain; resolving and refreshing them
must not stall the event loop, and a chain that finds nothing must not be re-run (with its
instance-metadata probe) for every request. The chain is the real one: a ``credential_process``
that takes its time, or an instance-metadata endpoint that answers slowly with no role."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from botocore.session import Session

from sluicegate.gateway.canonical import ChatRequest, text_message
from sluicegate.gateway.providers.aws_credentials import AwsCredentials
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.bedrock import BedrockProvider
from sluicegate.gateway.providers.hosted import Sessions

from ..api.servers import ServerThread, serve_lifespan
from . import fake_bedrock

T = TypeVar("T")
SLOW_S = 0.5
"""How long each credential source takes to answer; a stalled loop stalls at least this."""
STALL_S = 0.25

_PROCESS = """
import datetime, json, pathlib, sys, time
runs = pathlib.Path(sys.argv[1])
runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
time.sleep(float(sys.argv[2]))
# The first answer expires inside botocore's advisory window (15 min), so it is refreshed.
minutes = 11 if len(runs.read_text()) == 1 else 60
expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=minutes)
print(json.dumps({"Version": 1, "AccessKeyId": sys.argv[3], "SecretAccessKey": sys.argv[4],
                  "SessionToken": "session-token", "Expiration": expiry.isoformat()}))
"""


class SlowMetadata:
    """An instance-metadata endpoint that knows no role, slowly (as one off EC2 times out)."""

    def __init__(self) -> None:
        self.hits = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        self.hits += 1
        await asyncio.sleep(SLOW_S)
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"not found"})


@pytest.fixture
def aws_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No credentials anywhere in the chain but what a test puts there."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return tmp_path


@pytest.fixture
async def sessions() -> AsyncIterator[Sessions]:
    shared = Sessions()
    yield shared
    await shared.close()


@pytest.fixture
def slow_metadata(monkeypatch: pytest.MonkeyPatch, aws_home: Path) -> Iterator[SlowMetadata]:
    app = SlowMetadata()
    server = ServerThread(app).start()
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "false")
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", server.url)
    monkeypatch.setenv("AWS_METADATA_SERVICE_TIMEOUT", "5")
    yield app
    server.stop()


async def longest_stall(work: Awaitable[T]) -> tuple[T, float]:
    """``work``'s result, and the longest the event loop went without running a timer."""
    ticks = [time.perf_counter()]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.01)
            ticks.append(time.perf_counter())

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    try:
        result = await work
    finally:
        ticker.cancel()
    # A stall that ends with ``work`` ends before the ticker runs again: time to now counts.
    ticks.append(time.perf_counter())
    return result, max(b - a for a, b in itertools.pairwise(ticks)) - 0.01


def _bedrock(fakes: dict[str, Any], sessions: Sessions) -> BedrockProvider:
    return BedrockProvider(
        name="bedrock:chain",
        model="plain",
        sessions=sessions,
        region=fake_bedrock.REGION,
        base_url=fakes["bedrock"][1],
    )


REQUEST = ChatRequest(model="m", messages=[text_message("user", "say some words")])


async def test_credentials_are_resolved_and_refreshed_off_the_event_loop(
    aws_home: Path, fakes: dict[str, Any], sessions: Sessions
) -> None:
    runs = aws_home / "runs"
    command = [sys.executable, str(aws_home / "process.py"), str(runs), str(SLOW_S)]
    command += [fake_bedrock.ACCESS_KEY, fake_bedrock.SECRET_KEY]
    (aws_home / "process.py").write_text(_PROCESS)
    (aws_home / "config").write_text(f"[default]\ncredential_process = {' '.join(command)}\n")
    provider = _bedrock(fakes, sessions)

    answer, stall = await longest_stall(provider.complete(REQUEST))
    assert answer.text() and stall < STALL_S, f"the loop stalled {stall:.2f}s"
    assert runs.read_text() == "xx", "resolved, then refreshed inside the advisory window"

    async def streamed() -> list[Any]:
        return [chunk async for chunk in provider.generate(REQUEST)]

    chunks, stall = await longest_stall(streamed())
    assert chunks and stall < STALL_S
    assert runs.read_text() == "xx", "fresh credentials are reused"
    assert fakes["bedrock"][0].headers[-1]["x-amz-security-token"] == "session-token"


async def test_no_credentials_is_remembered_not_probed_for_every_request(
    slow_metadata: SlowMetadata, fakes: dict[str, Any], sessions: Sessions
) -> None:
    provider = _bedrock(fakes, sessions)

    async def fails() -> ProviderError:
        with pytest.raises(ProviderError) as caught:
            await provider.complete(REQUEST)
        return caught.value

    error, stall = await longest_stall(fails())
    assert error.retryable and "no AWS credentials" in error.message
    assert stall < STALL_S, f"the loop stalled {stall:.2f}s"
    probed = slow_metadata.hits
    assert probed > 0, "the chain asked the instance-metadata endpoint"
    began = time.perf_counter()
    for _ in range(3):
        again = await fails()
        assert again.retryable and "no AWS credentials" in again.message
    assert slow_metadata.hits == probed and time.perf_counter() - began < SLOW_S


async def test_no_credentials_is_asked_again_after_its_ttl(slow_metadata: SlowMetadata) -> None:
    credentials = AwsCredentials(Session(), none_ttl_s=0.05)
    assert await credentials.frozen() is None
    probed = slow_metadata.hits
    assert await credentials.frozen() is None and slow_metadata.hits == probed
    await asyncio.sleep(0.06)
    assert await credentials.frozen() is None and slow_metadata.hits > probed
