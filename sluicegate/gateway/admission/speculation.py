"""Speculative dispatch: a request of a key far from its limits goes upstream while its
admission is still in Redis, instead of after it.

Admission is one Redis round trip, and on an instant upstream it is the largest single part of
what the gateway adds (a loopback round trip plus the script: ~140 µs of ~500 on the 2-core
dev machine). Most keys, most of the time, are nowhere near their limits, so the answer is
almost always known before it comes. Each admission's reply says how much of the key's (and
its team's) tightest limit is now used, and how many tokens and micros are left before its
nearest token and money limits (``sluicegate.gateway.admission.scripts``). A key whose latest admission, less
than ``MAX_AGE_S`` ago, left every limit under half used — and whose new request reserves at
most half of the room left — has its request sent upstream at the same time as its admission.
Only while the replica is quiet (no other Redis exchange in flight but a previous settle,
``CommandBatcher.quiet``): the overlap costs a task per request, which a replica under load
would pay in throughput and win nothing, its CPU being the wait. Whole answers only (chat and
text completions, Responses, Anthropic messages, embeddings); a stream's first token is a
model's time to first token, against which the admission's round trip is noise.

What does not change: every request is still booked by the same atomic script before any of
its answer reaches the client, so counters, budgets, usage rows and the client's 429s are
exactly as without speculation. What it costs: a request refused after it was sent (its key's
use more than doubled within a second, from other replicas or a burst) has its upstream call
cancelled and its answer, if any, discarded; the upstream may have done (and charged) some work
that no key is billed for. ``sluicegate_speculative_dispatches_total{outcome="refused"}``
counts those. A key near any of its limits is always admitted first, so a key being throttled
never reaches the upstream through this path. ``SLUICEGATE_SPECULATIVE_DISPATCH=false`` turns
it off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

MAX_AGE_S = 1.0
"""How long an admission's view of a key's headroom is trusted."""
MAX_LOAD_PERMILLE = 500
"""Speculate only while every limit of the key (and its team) is less than half used."""
MAX_ENTRIES = 100_000
"""Keys remembered at most; past that the book starts afresh (only speculation is lost)."""


@dataclass(slots=True)
class _Headroom:
    at: float
    load_permille: int
    token_room: int
    """Tokens left before the nearest token limit (tokens/min or budget); -1: none."""
    money_room: int
    """Micros left before the nearest money budget; -1: none."""


class HeadroomBook:
    """Each key's headroom as its latest admission left it, in this replica."""

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self._keys: dict[str, _Headroom] = {}

    def allows(self, key_id: str, tokens: int, cost_micros: int) -> bool:
        """Whether a request reserving ``tokens`` and ``cost_micros`` may go upstream before
        its admission returns."""
        headroom = self._keys.get(key_id)
        if headroom is None or time.monotonic() - headroom.at > MAX_AGE_S:
            return False
        return (
            headroom.load_permille < MAX_LOAD_PERMILLE
            and (headroom.token_room < 0 or 2 * tokens <= headroom.token_room)
            and (headroom.money_room < 0 or 2 * cost_micros <= headroom.money_room)
        )

    def record(self, key_id: str, reply_tail: list[Any]) -> None:
        """Remember what an admission's reply says of the key's headroom (its last three
        numbers, ``sluicegate.gateway.admission.scripts``)."""
        if not self.enabled or len(reply_tail) != 3:
            return
        if len(self._keys) >= MAX_ENTRIES and key_id not in self._keys:
            self._keys.clear()
        load, token_room, money_room = (int(value) for value in reply_tail)
        self._keys[key_id] = _Headroom(time.monotonic(), load, token_room, money_room)

    def forget(self, key_id: str) -> None:
        """A refusal: the next request of the key is admitted first."""
        self._keys.pop(key_id, None)
