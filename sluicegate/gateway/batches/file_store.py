"""Where the bytes of batch files live: PostgreSQL (``batch_files.content``, the default) or an
S3-compatible object store (``SLUICEGATE_BATCH_FILE_STORE=s3``).

The S3 store speaks the object API itself (PUT, GET, DELETE on path-style URLs, signed with
botocore's SigV4 signer, credentials from the standard AWS chain resolved off the event loop):
three calls do not need an SDK's client and its thread pool.
"""

from __future__ import annotations

import hashlib
from typing import Protocol
from urllib.parse import quote

import httpx
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.session import Session

from sluicegate.gateway.errors import ServiceUnavailable
from sluicegate.gateway.providers.aws_credentials import AwsCredentials
from sluicegate.gateway.settings import Settings

_TIMEOUT_S = 60.0


class FileStore(Protocol):
    name: str
    """What ``batch_files.store`` records for the files it holds."""

    async def put(self, file_id: str, content: bytes) -> bytes | None:
        """Keep ``content``; what goes into ``batch_files.content`` (None: kept elsewhere)."""
        ...

    async def get(self, file_id: str, stored: bytes | None) -> bytes: ...

    async def delete(self, file_id: str) -> None: ...

    async def close(self) -> None: ...


class PostgresFiles:
    """The bytes are the row's own ``content``."""

    name = "postgres"

    async def put(self, file_id: str, content: bytes) -> bytes | None:
        return content

    async def get(self, file_id: str, stored: bytes | None) -> bytes:
        return stored or b""

    async def delete(self, file_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


class S3Files:
    """One object per file, ``<bucket>/<file id>``; the row keeps only its metadata."""

    name = "s3"

    def __init__(self, endpoint_url: str, bucket: str, region: str) -> None:
        if not endpoint_url or not bucket:
            raise ValueError(
                "SLUICEGATE_BATCH_FILE_STORE=s3 needs SLUICEGATE_BATCH_S3_ENDPOINT_URL and "
                "SLUICEGATE_BATCH_S3_BUCKET"
            )
        self._base = f"{endpoint_url.rstrip('/')}/{quote(bucket, safe='')}"
        self._region = region
        self._credentials = AwsCredentials(Session())
        self._client = httpx.AsyncClient(timeout=_TIMEOUT_S)

    async def _send(self, method: str, file_id: str, body: bytes = b"") -> httpx.Response:
        url = f"{self._base}/{quote(file_id, safe='')}"
        frozen = await self._credentials.frozen()
        if frozen is None:
            raise ServiceUnavailable("The file store has no AWS credentials.")
        request = AWSRequest(
            method=method,
            url=url,
            data=body,
            headers={"x-amz-content-sha256": hashlib.sha256(body).hexdigest()},
        )
        S3SigV4Auth(frozen, "s3", self._region).add_auth(request)
        try:
            return await self._client.request(
                method, url, content=body, headers=dict(request.headers.items())
            )
        except httpx.HTTPError as exc:
            raise ServiceUnavailable(f"The file store is unreachable: {exc}") from exc

    @staticmethod
    def _check(response: httpx.Response, what: str) -> None:
        if response.status_code >= 300:
            raise ServiceUnavailable(
                f"The file store refused to {what} ({response.status_code}): {response.text[:200]}"
            )

    async def put(self, file_id: str, content: bytes) -> bytes | None:
        self._check(await self._send("PUT", file_id, content), "store a file")
        return None

    async def get(self, file_id: str, stored: bytes | None) -> bytes:
        response = await self._send("GET", file_id)
        self._check(response, "read a file")
        return response.content

    async def delete(self, file_id: str) -> None:
        response = await self._send("DELETE", file_id)
        if response.status_code != 404:
            self._check(response, "delete a file")

    async def close(self) -> None:
        await self._client.aclose()


def file_store(settings: Settings) -> FileStore:
    if settings.batch_file_store == "postgres":
        return PostgresFiles()
    if settings.batch_file_store == "s3":
        return S3Files(
            settings.batch_s3_endpoint_url, settings.batch_s3_bucket, settings.batch_s3_region
        )
    raise ValueError(
        f"SLUICEGATE_BATCH_FILE_STORE must be postgres or s3, not {settings.batch_file_store!r}"
    )
