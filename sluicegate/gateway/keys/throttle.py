"""Per client address caps on failed authentications: database lookups of unknown API keys
(``sluicegate.gateway.keys.cache``) and wrong admin keys (``sluicegate.gateway.api.admin.guards``)."""

from __future__ import annotations

import time
from collections import OrderedDict

THROTTLE_WINDOW_S = 60.0
ADDRESSES_KEPT = 10_000
"""Addresses remembered at most (the least recently failing go first)."""


class FailureThrottle:
    """Per client address: how many failures it had this window.

    A fixed window per address, in a bounded LRU map, so a flood of addresses cannot grow it.
    """

    def __init__(self, limit: int, window_s: float = THROTTLE_WINDOW_S) -> None:
        self._limit = limit
        self._window_s = window_s
        self._failures: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def retry_after(self, address: str) -> float | None:
        """Seconds until ``address`` may try again; None when it may now."""
        if self._limit <= 0:
            return None
        started, count = self._failures.get(address, (0.0, 0))
        left = started + self._window_s - time.monotonic()
        if left <= 0 or count < self._limit:
            return None
        return left

    def record_failure(self, address: str) -> None:
        now = time.monotonic()
        started, count = self._failures.pop(address, (now, 0))
        if now - started >= self._window_s:
            started, count = now, 0
        self._failures[address] = (started, count + 1)
        if len(self._failures) > ADDRESSES_KEPT:
            self._failures.popitem(last=False)
