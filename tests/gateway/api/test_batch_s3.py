"""Batch files in an S3-compatible store (``SLUICEGATE_BATCH_FILE_STORE=s3``), against a real
S3-compatible server process (moto's ``moto_server``): the input and output files' bytes live
there, not in PostgreSQL, and deleting a file deletes its object."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.settings import Settings

from .servers import ServerThread, free_port

pytestmark = pytest.mark.timeout(120)

ACCESS_KEY = "testing"


@pytest.fixture(scope="module")
def s3_url() -> Iterator[str]:
    binary = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    port = free_port()
    process = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


@pytest.fixture(scope="module")
def s3(s3_url: str) -> Any:
    """A boto3 client of the same store and account, to look at what the gateway stored."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_url,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=ACCESS_KEY,
    )


@pytest.fixture(scope="module")
def bucket(s3: Any) -> str:
    name = f"sg-batches-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=name)
    return name


def stored(s3: Any, bucket: str, key: str) -> bytes | None:
    try:
        return bytes(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except s3.exceptions.NoSuchKey:
        return None


@pytest.fixture(scope="module")
def gateway(api_settings: Settings, s3_url: str, bucket: str) -> Iterator[str]:
    settings = dataclasses.replace(
        api_settings,
        batch_file_store="s3",
        batch_s3_endpoint_url=s3_url,
        batch_s3_bucket=bucket,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        patch.setenv("AWS_SECRET_ACCESS_KEY", ACCESS_KEY)
        server = ServerThread(create_asgi_app(settings)).start()
        yield server.url
        server.stop()


def test_files_live_in_the_object_store(
    gateway: str, make_key: Callable[..., str], s3: Any, bucket: str
) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=make_key(), max_retries=0)
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    line = {"custom_id": "one", "method": "POST", "url": "/v1/chat/completions", "body": body}
    content = json.dumps(line).encode() + b"\n"
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    assert stored(s3, bucket, uploaded.id) == content
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.2)
    assert batch.output_file_id is not None
    output = client.files.content(batch.output_file_id).content
    assert stored(s3, bucket, batch.output_file_id) == output
    result = json.loads(output)
    assert result["custom_id"] == "one"
    assert result["response"]["body"]["choices"][0]["message"]["content"] == "w0 w1 "
    client.files.delete(uploaded.id)
    assert stored(s3, bucket, uploaded.id) is None
