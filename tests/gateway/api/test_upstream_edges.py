"""What an upstream's address, key and slowness may not do to a client.

Upstream base URLs, host:port pairs and keys never reach a client's error body or a metric
label (deployments are named by their model); a non-streaming call to an ``https://`` upstream
is bounded by the request's deadline, not the shared client's 60 s first-token timeout.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.canonical import ChatRequest, Sampling, text_message
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.providers.openai import OpenAIProvider
from sluicegate.gateway.settings import Settings

from .servers import ServerThread, dead_port, free_port, read_body, serve_lifespan

UPSTREAM_KEY = "sk-upstream-secret-0123456789abcdef"
ANSWER_DELAY_S = 1.5


class _Upstream:
    """Answers 401 echoing the key it was sent (as hosted APIs do, partly masked), or, for
    model ``sleepy``, a normal completion after ``ANSWER_DELAY_S``."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        raw = await read_body(receive)
        headers = dict(scope["headers"])
        if json.loads(raw)["model"] == "sleepy":
            await asyncio.sleep(ANSWER_DELAY_S)
            status, body = (
                200,
                {
                    "choices": [
                        {"index": 0, "message": {"content": "late"}, "finish_reason": "stop"}
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1},
                },
            )
        else:
            sent = headers.get(b"authorization", b"").decode().removeprefix("Bearer ")
            status, body = 401, {"error": {"message": f"Incorrect API key provided: {sent}."}}
        payload = json.dumps(body).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})


@pytest.fixture
def leaky_gateway(
    gateway_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, Settings, list[str]]]:
    upstream = ServerThread(_Upstream()).start()
    refused = f"http://127.0.0.1:{dead_port()}/v1"
    monkeypatch.setenv("SG_TEST_UPSTREAM_KEY", UPSTREAM_KEY)

    def deployment(base_url: str, model: str) -> dict[str, Any]:
        return {
            "provider": "openai",
            "base_url": base_url,
            "model": model,
            "api_key_env": "SG_TEST_UPSTREAM_KEY",
        }

    config = tmp_path / "models.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {"name": "refused", "deployments": [deployment(refused, "m-refused")]},
                    {
                        "name": "badkey",
                        "deployments": [deployment(upstream.url + "/v1", "m-badkey")],
                    },
                ]
            }
        )
    )
    settings = Settings.from_env(
        **{**gateway_settings.__dict__, "config": str(config), "instance_id": "edges"}
    )
    gateway = ServerThread(create_asgi_app(settings)).start()
    yield gateway.url, settings, [refused, upstream.url]
    gateway.stop()
    upstream.stop()


def test_errors_and_metric_labels_never_show_upstream_addresses_or_keys(
    leaky_gateway: tuple[str, Settings, list[str]],
) -> None:
    url, settings, upstream_urls = leaky_gateway
    created = httpx.post(
        f"{url}/admin/keys",
        json={"name": f"edges-{uuid.uuid4().hex[:6]}"},
        headers={"authorization": f"Bearer {settings.master_key}"},
    )
    assert created.status_code == 201, created.text
    auth = {"authorization": f"Bearer {created.json()['key']}"}
    secrets = [*upstream_urls, *(u.removeprefix("http://") for u in upstream_urls), UPSTREAM_KEY]
    secrets += ["127.0.0.1", UPSTREAM_KEY[:12]]
    for model, stream in [("refused", False), ("refused", True), ("badkey", False)]:
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
        response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=30)
        assert response.status_code in (502, 503), response.text
        error = response.json()["error"]
        assert f"openai:m-{model}" in error["message"]
        for secret in secrets:
            assert secret not in response.text, (model, response.text)
    metrics = httpx.get(
        f"{url}/metrics", headers={"authorization": f"Bearer {settings.master_key}"}
    )
    assert metrics.status_code == 200
    assert 'deployment="openai:m-refused"' in metrics.text or "openai:m-refused" in metrics.text
    for secret in secrets[:-2]:
        assert secret not in metrics.text


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.fixture
def https_upstream(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    cert, key = _self_signed(tmp_path)
    port = free_port()
    config = uvicorn.Config(
        _Upstream(),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        ssl_certfile=str(cert),
        ssl_keyfile=str(key),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "upstream did not start"
        time.sleep(0.02)
    yield f"https://127.0.0.1:{port}/v1", cert
    server.should_exit = True
    thread.join(15)


def _request(deadline_s: float) -> ChatRequest:
    return ChatRequest(
        request_id=uuid.uuid4().hex,
        model="sleepy",
        sampling=Sampling(max_tokens=4),
        messages=[text_message("user", "hi")],
        deadline=time.time() + deadline_s,
    )


async def test_non_streaming_https_call_waits_for_the_request_deadline(
    https_upstream: tuple[str, Path],
) -> None:
    base_url, cert = https_upstream
    sessions = Sessions(ssl=ssl.create_default_context(cafile=str(cert)))
    # The first-token timeout (a stream's per-read bound) is short here: a whole answer
    # must wait for the request's deadline instead.
    provider = OpenAIProvider(
        name="openai:sleepy",
        base_url=base_url,
        model="sleepy",
        sessions=sessions,
        first_token_timeout_s=ANSWER_DELAY_S / 3,
    )
    try:
        answer = await provider.complete(_request(deadline_s=ANSWER_DELAY_S * 4))
        assert answer.text() == "late"

        started = time.monotonic()
        with pytest.raises(ProviderError) as failure:
            await provider.complete(_request(deadline_s=ANSWER_DELAY_S / 2))
        assert "timed out" in failure.value.message
        assert time.monotonic() - started < ANSWER_DELAY_S
    finally:
        await provider.close()
        await sessions.close()
