"""A Bedrock deployment's AWS credentials, resolved and refreshed off the event loop.

botocore's credential chain is synchronous and can take seconds: the instance-metadata probe
alone waits up to a second for an answer that never comes off EC2, a ``credential_process`` or
an STS call as long as they take. Run on the event loop, that stalls every request of the whole
gateway. So the chain and every refresh run in a worker thread, one at a time; the answer is
kept, "no credentials" included (for ``none_ttl_s``, so a deployment without credentials does
not re-run the chain for every request, yet picks up credentials that appear later). Between
refreshes, signing reads the current credentials on the loop (no I/O: botocore only refreshes
within its advisory window before expiry, which is when a thread takes over).
"""

from __future__ import annotations

import asyncio
import time

from botocore.credentials import Credentials, ReadOnlyCredentials, RefreshableCredentials
from botocore.session import Session

NONE_TTL_S = 60.0


def _refresh_due(credentials: Credentials) -> bool:
    """Whether reading ``credentials`` would make botocore refresh them (I/O)."""
    return isinstance(credentials, RefreshableCredentials) and credentials.refresh_needed()


class AwsCredentials:
    def __init__(
        self,
        session: Session,
        given: Credentials | None = None,
        *,
        none_ttl_s: float = NONE_TTL_S,
    ) -> None:
        self._session = session
        self._credentials = given
        self._none_ttl_s = none_ttl_s
        self._none_until = 0.0
        self._lock = asyncio.Lock()

    async def frozen(self) -> ReadOnlyCredentials | None:
        """The credentials to sign with now; None when the chain found none."""
        credentials = self._credentials
        if credentials is not None and not _refresh_due(credentials):
            return credentials.get_frozen_credentials()
        if credentials is None and time.monotonic() < self._none_until:
            return None
        # One resolution or refresh at a time; requests that queued behind it use its answer.
        async with self._lock:
            credentials = self._credentials
            if credentials is None:
                if time.monotonic() < self._none_until:
                    return None
                credentials = await asyncio.to_thread(self._session.get_credentials)
                if credentials is None:
                    self._none_until = time.monotonic() + self._none_ttl_s
                    return None
                self._credentials = credentials
            if _refresh_due(credentials):
                return await asyncio.to_thread(credentials.get_frozen_credentials)
            return credentials.get_frozen_credentials()
