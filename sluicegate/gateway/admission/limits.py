"""Admission in one Redis round trip: requests/min, tokens/min, concurrency, token and money
budgets — for the key and for its team.

One Lua script checks every limit of a key and of its team and, only if all pass, books them
all — atomic, so N gateway replicas sharing one Redis enforce one limit, not N. Every key a
script touches carries one hash tag (``{<team-id>}`` for a key of a team, else ``{<key-id>}``),
so a Redis Cluster keeps them on one slot.

Windows: requests/min and tokens/min use a *sliding window counter* — two fixed one-minute
buckets, the previous one weighted by how much of it still overlaps the last 60 s. It never
lets a burst of 2x the limit through at a minute boundary (a plain fixed window does), and
costs two GETs instead of a sorted set per request.

Tokens: admission reserves the estimate (prompt + max_tokens) against tokens/min and against
the budget of the current period (UTC day or month); ``settle`` replaces the reservation with
the real count and frees the concurrency slot. Since the reservation is the worst case, the
budget is never overshot, however many requests run at once.

Money: admission reserves the worst-case cost (``sluicegate.gateway.usage.pricing``) against the money budgets
of the key and its team; settle replaces it with the real cost, in integer micro-units.
Budget counters live in Redis but are not trusted to stay there: when one is missing (a new
period, a restart, an eviction, a FLUSHALL) the script books nothing and names it, and the
limiter re-seeds it from the period's committed usage in PostgreSQL before admitting.

Crash safety: the admission also stores the request's lease (``sluicegate.gateway.leases.lease``), and the
settle releases it, so a request costs one round trip in and one (with its usage event) out;
under load, both join other requests' commands in one pipeline (``sluicegate.gateway.redis.batch``).
The scripts are in ``sluicegate.gateway.admission.scripts``, a key's call to them in ``booking``; headers and refusals in ``sluicegate.gateway.admission.replies``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from sluicegate.gateway.admission.booking import MAX_BOOKINGS, Booking, key_scopes
from sluicegate.gateway.admission.keys import KeyLimits, ScopeLimits, budget_keys
from sluicegate.gateway.admission.replies import REJECTION_REASONS, limit_headers, rejection
from sluicegate.gateway.admission.scripts import ADMIT_LUA, SEED_LUA, SETTLE_LUA, WINDOW_S
from sluicegate.gateway.admission.speculation import HeadroomBook
from sluicegate.gateway.errors import InvalidRequest, ServiceUnavailable
from sluicegate.gateway.redis.batch import CommandBatcher
from sluicegate.gateway.redis.direct import DirectConnection
from sluicegate.gateway.telemetry import REJECTIONS
from sluicegate.gateway.usage.pricing import Price

SLOT_TTL_MARGIN_S = 30.0
"""A concurrency slot outlives the request deadline by this much, then frees itself (a
gateway that died mid-request must not hold a slot forever)."""

SEED_ATTEMPTS = 3


class SpendSource(Protocol):
    """Where a missing budget counter is re-seeded from: the period's committed usage."""

    async def spent(self, kind: str, scope_id: str, period: str | None) -> tuple[int, int]:
        """``(tokens, cost micros)`` of the current period of ``period`` for a key or team."""
        ...


class PriceSource(Protocol):
    async def price_at(self, model: str, when: float | None = None) -> Price | None: ...


@dataclass(slots=True)
class Admission:
    """A granted reservation; ``settle`` it exactly once when the request ends."""

    key_id: str
    request_id: str
    reserved_tokens: int
    settle_keys: list[str]
    headers: dict[str, str]
    price: Price | None = None
    reserved_micros: int = 0
    team_id: str | None = None
    epoch: str = ""
    """The key's counters' epoch at admission (see SETTLE_LUA)."""
    new_epoch: bool = False
    """The key had no epoch: it is new, or Redis lost everything (restarted empty)."""
    booked: str = ""
    """Per scope, whether admission booked its tokens/min, token budget and money budget
    counters ('1') or not ('0'); empty: all booked (a lease stored before this was known)."""

    def cost_micros(self, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> int:
        """The real cost at the price in force at admission (0 for an unpriced model)."""
        if self.price is None:
            return 0
        return self.price.cost_micros(prompt_tokens, completion_tokens, cached)


class LeaseDraft(Protocol):
    """The request's lease (``sluicegate.gateway.leases.lease``), stored by the admission script."""

    hash_key: str
    """The hash it goes into, under the key's hash tag (one Cluster slot with the rest)."""

    def encode(self, admission: Admission) -> bytes:
        """The lease of ``admission`` (its epoch not known yet) as stored."""
        ...


class RateLimiter:
    def __init__(
        self,
        redis: Redis,
        *,
        slot_ttl_s: float,
        spend: SpendSource | None = None,
        prices: PriceSource | None = None,
        direct: DirectConnection | None = None,
        headroom: HeadroomBook | None = None,
    ) -> None:
        self._redis = redis
        self.headroom = headroom or HeadroomBook(enabled=False)
        """Each key's headroom after its latest admission (``sluicegate.gateway.admission.speculation``)."""
        self.batch = CommandBatcher(redis, direct)
        """The request path's admission and settle commands go through this."""
        self._slot_ttl_s = slot_ttl_s + SLOT_TTL_MARGIN_S
        self._slot_ttl_arg = repr(self._slot_ttl_s)
        self._bookings: dict[str, Booking] = {}
        self._spend = spend
        self._prices = prices
        self._admit_sha = ""
        self._settle_sha = ""
        self._seed_sha = ""

    @property
    def slot_ttl_s(self) -> float:
        """How long a concurrency slot and held marker live past their last booking or renewal."""
        return self._slot_ttl_s

    async def load(self) -> None:
        self._admit_sha = await self._redis.script_load(ADMIT_LUA)
        self._settle_sha = await self._redis.script_load(SETTLE_LUA)
        self._seed_sha = await self._redis.script_load(SEED_LUA)

    async def _evalsha(self, sha_attr: str, source: str, keys: list[str], args: list[Any]) -> Any:
        sha = getattr(self, sha_attr)
        if sha:
            # Joined with other requests' commands while some are in flight (redis_batch).
            (reply,) = await self.batch.execute(("EVALSHA", sha, len(keys), *keys, *args))
            if not isinstance(reply, Exception):
                return reply
            if not isinstance(reply, NoScriptError):
                raise reply
        # Not loaded yet, or a Redis restart or failover forgot it: load it, once.
        setattr(self, sha_attr, await self._redis.script_load(source))
        return await self._redis.evalsha(getattr(self, sha_attr), len(keys), *keys, *args)

    async def admit(
        self,
        key: KeyLimits,
        request_id: str,
        tokens: int,
        *,
        model: str | None = None,
        prompt_tokens: int | None = None,
        lease: LeaseDraft | None = None,
        priced: tuple[Price | None, int] | None = None,
    ) -> Admission:
        """Book one request of ``tokens`` (estimate; ``prompt_tokens`` of it the prompt) on the
        key and its team, or raise RateLimited / QuotaExceeded. With a ``lease``, the same
        script stores it (``sluicegate.gateway.leases.lease``) and the settle releases it. ``priced``: what
        ``worst_case`` answered for this request, if the caller asked already."""
        if tokens < 0:
            # A negative reservation would credit every counter it is booked on: refused
            # here whatever let it through (the schemas bound every count a client sends).
            raise InvalidRequest("The request's token reservation must not be negative.")
        prompt = tokens if prompt_tokens is None else prompt_tokens
        price, cost = priced or await self.worst_case(model, prompt, tokens - prompt)
        if cost < 0:
            raise InvalidRequest("The request's cost reservation must not be negative.")
        for _ in range(SEED_ATTEMPTS):
            now = time.time()
            booking = self._booking(key, now)
            keys, args = booking.call(request_id, tokens, cost, now, self._slot_ttl_arg)
            proposed_epoch = args[-1]
            admission = Admission(
                key.id,
                request_id,
                tokens,
                [*booking.settle_keys, keys[-2], keys[-1]],
                {},
                price=price,
                reserved_micros=cost,
                team_id=booking.team_id,
                booked=booking.booked,
            )
            if lease is not None:
                keys.append(lease.hash_key)
                admission.settle_keys.append(lease.hash_key)
                args.append(lease.encode(admission))
            result = await self._evalsha("_admit_sha", ADMIT_LUA, keys, args)
            if int(result[0]) != 5:
                break
            await self._seed(key, keys, [int(i) for i in result[3]], now)
        else:
            raise ServiceUnavailable("Budget counters could not be restored; try again shortly.")
        scopes = booking.scopes
        code, failed, retry_ms = int(result[0]), int(result[1]), int(result[2])
        headers = limit_headers(scopes, result[4:])
        epoch_at = 4 + 4 * len(scopes)
        if code == 0:
            admission.headers = headers
            admission.epoch = _text(result[epoch_at])
            admission.new_epoch = admission.epoch == proposed_epoch
            self.headroom.record(key.id, result[epoch_at + 1 :])
            return admission
        self.headroom.forget(key.id)
        REJECTIONS.labels(REJECTION_REASONS[code]).inc()
        kind, scope = scopes[failed]
        raise rejection(code, retry_ms, tokens, cost, kind, scope, headers)

    async def worst_case(
        self, model: str | None, prompt_tokens: int, completion_tokens: int
    ) -> tuple[Price | None, int]:
        """The model's price now and the request's worst-case cost in micros (0 unpriced)."""
        if model is None or self._prices is None:
            return None, 0
        price = await self._prices.price_at(model)
        if price is None:
            return None, 0
        return price, price.worst_case_micros(prompt_tokens, completion_tokens)

    def may_dispatch_early(self, key_id: str, tokens: int, cost_micros: int) -> bool:
        """Whether a request may go upstream before its admission returns
        (``sluicegate.gateway.admission.speculation``). Speculation spends CPU (a task) to overlap two waits: only
        worth it while this replica has CPU to spare, which it has not when other requests
        are in flight."""
        return self.batch.quiet() and self.headroom.allows(key_id, tokens, cost_micros)

    def _admission_call(
        self, key: KeyLimits, request_id: str, tokens: int, cost: int, now: float
    ) -> tuple[list[str], list[Any]]:
        """ADMIT_LUA's keys and args for one request of ``key``."""
        return self._booking(key, now).call(request_id, tokens, cost, now, self._slot_ttl_arg)

    def _booking(self, key: KeyLimits, now: float) -> Booking:
        """What a key's admissions share within a window; made once per key and window (the
        key's record, from the key cache, is the same object until its limits change; budget
        periods start on a window's start)."""
        window = int(now // WINDOW_S)
        booking = self._bookings.get(key.id)
        if booking is None or booking.record is not key or booking.window != window:
            if len(self._bookings) >= MAX_BOOKINGS:
                self._bookings.clear()
            booking = self._bookings[key.id] = Booking.of(key, window, now)
        return booking

    async def _seed(self, key: KeyLimits, keys: list[str], missing: list[int], now: float) -> None:
        """Restores missing budget counters from the period's committed usage in PostgreSQL."""
        if self._spend is None:
            values = dict.fromkeys(missing, 0)
        else:
            values = {}
            scopes = key_scopes(key)
            for position in missing:
                index, slot = divmod(position - 1, 7)
                kind, scope = scopes[index]
                tokens, micros = await self._spend.spent(kind, scope.id, scope.budget_period)
                values[position] = tokens if slot == 5 else micros
        team_id = key.team.id if key.team is not None else None
        ttl = max(budget_keys(kind, scope, team_id, now)[2] for kind, scope in key_scopes(key))
        names = [keys[position - 1] for position in values]
        await self._evalsha("_seed_sha", SEED_LUA, names, [ttl, *values.values()])

    async def counters(self, kind: str, scope: ScopeLimits, team_id: str | None) -> tuple[int, int]:
        """``(tokens, cost micros)`` booked in a key's or team's current period: the numbers
        admission compares against the budgets (re-seeded first when missing)."""
        tokens_key, money_key, ttl = budget_keys(kind, scope, team_id, time.time())
        values = await self._redis.mget(tokens_key, money_key)
        if any(value is None for value in values):
            spent = (0, 0)
            if self._spend is not None:
                spent = await self._spend.spent(kind, scope.id, scope.budget_period)
            await self._evalsha(
                "_seed_sha", SEED_LUA, [tokens_key, money_key], [ttl, spent[0], spent[1]]
            )
            values = await self._redis.mget(tokens_key, money_key)
        return int(values[0] or 0), int(values[1] or 0)

    def settle_command(
        self, admission: Admission, actual_tokens: int, actual_micros: int = 0
    ) -> tuple[Any, ...]:
        """The EVALSHA that settles ``admission``, for a caller's pipeline."""
        keys = admission.settle_keys
        return (
            "EVALSHA",
            self._settle_sha,
            len(keys),
            *keys,
            *_settle_args(admission, actual_tokens, actual_micros, 0),
        )

    async def settle(
        self,
        admission: Admission,
        actual_tokens: int,
        actual_micros: int = 0,
        *,
        reaping: bool = False,
    ) -> bool:
        """Settle ``admission``; whether this call released its lease (True without one).
        A reaper's settle (``reaping``) leaves what it billed behind for as long as the request
        could still be running, so that the serving replica, if it was alive after all, adds
        only the difference when it settles."""
        remember = int(self._slot_ttl_s) + 1 if reaping else 0
        args = _settle_args(admission, actual_tokens, actual_micros, remember)
        released = await self._evalsha("_settle_sha", SETTLE_LUA, admission.settle_keys, args)
        return int(released) == 1


def _settle_args(
    admission: Admission, actual_tokens: int, actual_micros: int, remember_s: int
) -> list[Any]:
    # Real counts are never negative: an upstream's report is clamped (canonical.Usage), and
    # so is whatever reaches this, so a settle can take back at most the reservation.
    return [
        max(actual_tokens, 0) - admission.reserved_tokens,
        max(actual_micros, 0) - admission.reserved_micros,
        admission.request_id,
        admission.epoch,
        admission.reserved_tokens,
        admission.reserved_micros,
        remember_s,
        admission.booked,
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
