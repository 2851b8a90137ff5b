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

Money: admission reserves the worst-case cost (``gateway.pricing``) against the money budgets
of the key and its team; settle replaces it with the real cost, in integer micro-units.
Budget counters live in Redis but are not trusted to stay there: when one is missing (a new
period, a restart, an eviction, a FLUSHALL) the script books nothing and names it, and the
limiter re-seeds it from the period's committed usage in PostgreSQL before admitting.

Headers (OpenAI's): ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``; ``reset`` is
the time until the window has fully drained (back to the whole limit), e.g. ``1m12s``.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from gateway.errors import QuotaExceeded, RateLimited, ServiceUnavailable
from gateway.pricing import Price, from_micros
from gateway.telemetry import REJECTIONS

WINDOW_S = 60
SLOT_TTL_MARGIN_S = 30.0
"""A concurrency slot outlives the request deadline by this much, then frees itself (a
gateway that died mid-request must not hold a slot forever)."""

UNLIMITED = -1
_REJECTION_REASONS = {
    1: "rate_limit_requests",
    2: "rate_limit_tokens",
    3: "concurrency",
    4: "quota",
    6: "budget",
}

ADMIT_LUA = """
-- ARGV: now, window start, window length, tokens, cost (micros), member, slot ttl, scope count,
-- then per scope: rpm, tpm, parallel, token budget, money budget, budget ttl (-1 = no limit).
-- KEYS per scope (7): req cur, req prev, tok cur, tok prev, slots, token budget, money budget;
-- then, optionally, the reservation's held marker and the key's epoch (see SETTLE_LUA), with
-- one more ARGV: the epoch to start when the key has none (Redis started empty).
local now = tonumber(ARGV[1])
local elapsed = now - tonumber(ARGV[2])
local win = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local member = ARGV[6]
local slot_ttl = tonumber(ARGV[7])
local scopes = tonumber(ARGV[8])
local weight = 1 - elapsed / win

local function num(key) return tonumber(redis.call('get', key) or '0') end
local function arg(s, i) return tonumber(ARGV[8 + 6 * s + i]) end
local function key(s, i) return KEYS[7 * s + i] end

-- seconds until prev*weight(t) + cur + amount <= limit; -1 when it never will
local function wait_for(cur, prev, amount, limit)
  if amount > limit then return -1 end
  if cur + amount <= limit then
    if prev <= 0 then return 0 end
    local t = win * (1 - (limit - cur - amount) / prev)
    return math.max(0, t - elapsed)
  end
  local s = win * (1 - (limit - amount) / cur)
  return (win - elapsed) + s
end

-- seconds until both buckets have drained
local function drain(cur, prev)
  if cur > 0 then return (win - elapsed) + win end
  if prev > 0 then return win - elapsed end
  return 0
end

-- A budget counter that is missing (new period, Redis restart, eviction) is seeded by the
-- caller from the database first: answer which, and book nothing.
local missing = {}
for s = 0, scopes - 1 do
  if arg(s, 4) >= 0 and redis.call('exists', key(s, 6)) == 0 then table.insert(missing, 7 * s + 6) end
  if arg(s, 5) >= 0 and redis.call('exists', key(s, 7)) == 0 then table.insert(missing, 7 * s + 7) end
end
if #missing > 0 then return {5, -1, 0, missing} end

local code, failed, retry = 0, -1, 0
local state = {}
for s = 0, scopes - 1 do
  local rpm, tpm, parallel = arg(s, 1), arg(s, 2), arg(s, 3)
  local st = {req_cur = 0, req_prev = 0, tok_cur = 0, tok_prev = 0}
  if rpm >= 0 then st.req_cur = num(key(s, 1)); st.req_prev = num(key(s, 2)) end
  if tpm >= 0 then st.tok_cur = num(key(s, 3)); st.tok_prev = num(key(s, 4)) end
  st.req_used = st.req_prev * weight + st.req_cur
  st.tok_used = st.tok_prev * weight + st.tok_cur
  state[s] = st
  if code == 0 then
    if arg(s, 4) >= 0 and num(key(s, 6)) + tokens > arg(s, 4) then
      code = 4
    elseif arg(s, 5) >= 0 and num(key(s, 7)) + cost > arg(s, 5) then
      code = 6
    elseif rpm >= 0 and st.req_used + 1 > rpm then
      code, retry = 1, wait_for(st.req_cur, st.req_prev, 1, rpm)
    elseif tpm >= 0 and st.tok_used + tokens > tpm then
      code, retry = 2, wait_for(st.tok_cur, st.tok_prev, tokens, tpm)
    elseif parallel >= 0 then
      redis.call('zremrangebyscore', key(s, 5), '-inf', now)
      if redis.call('zcard', key(s, 5)) >= parallel then code, retry = 3, 1 end
    end
    if code ~= 0 then failed = s end
  end
end

local out = {code, failed, math.floor(retry * 1000), {}}
for s = 0, scopes - 1 do
  local st = state[s]
  local rpm, tpm = arg(s, 1), arg(s, 2)
  if code == 0 then
    if rpm >= 0 then
      st.req_cur = redis.call('incr', key(s, 1)); redis.call('expire', key(s, 1), 2 * win)
      st.req_used = st.req_used + 1
    end
    if tpm >= 0 then
      st.tok_cur = redis.call('incrby', key(s, 3), tokens); redis.call('expire', key(s, 3), 2 * win)
      st.tok_used = st.tok_used + tokens
    end
    if arg(s, 3) >= 0 then
      redis.call('zadd', key(s, 5), now + slot_ttl, member)
      redis.call('expire', key(s, 5), math.ceil(slot_ttl))
    end
    if arg(s, 4) >= 0 then
      redis.call('incrby', key(s, 6), tokens); redis.call('expire', key(s, 6), arg(s, 6))
    end
    if arg(s, 5) >= 0 then
      redis.call('incrby', key(s, 7), cost); redis.call('expire', key(s, 7), arg(s, 6))
    end
  end
  table.insert(out, math.floor(math.max(0, rpm - st.req_used)))
  table.insert(out, math.floor(drain(st.req_cur, st.req_prev) * 1000))
  table.insert(out, math.floor(math.max(0, tpm - st.tok_used)))
  table.insert(out, math.floor(drain(st.tok_cur, st.tok_prev) * 1000))
end
local epoch = ''
if code == 0 and #KEYS > 7 * scopes then
  redis.call('set', KEYS[7 * scopes + 1], '1', 'EX', math.ceil(slot_ttl))
  epoch = redis.call('get', KEYS[7 * scopes + 2])
  if not epoch then
    epoch = ARGV[#ARGV]
    redis.call('set', KEYS[7 * scopes + 2], epoch)
  end
end
table.insert(out, epoch)
return out
"""

SEED_LUA = """
-- KEYS: budget counters; ARGV: ttl, then one value per key. NX: a concurrent seed or a
-- booking that got there first is kept.
for i, name in ipairs(KEYS) do
  redis.call('set', name, ARGV[i + 1], 'NX', 'EX', tonumber(ARGV[1]))
end
return #KEYS
"""

SETTLE_LUA = """
-- ARGV: token delta, cost delta, member[, admission epoch, reserved tokens, reserved cost].
-- KEYS per scope (4): tok cur, token budget, money budget, slots; then, optionally, the held
-- marker and the key's epoch. A counter gone meanwhile is re-seeded from the database later.
local tokens, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
local scopes = math.floor(#KEYS / 4)
local extra = 4 * scopes
if #KEYS > extra and redis.call('del', KEYS[extra + 1]) == 0 then
  if #KEYS > extra + 1 and redis.call('get', KEYS[extra + 2]) ~= ARGV[4] then
    -- Redis lost the reservation (it restarted empty): the counters were re-seeded from the
    -- database without this request, so they take its whole real amount.
    tokens, cost = tokens + tonumber(ARGV[5]), cost + tonumber(ARGV[6])
  else
    -- Settled already (by the serving replica or a lease reaper): only free the slots.
    tokens, cost = 0, 0
  end
end
for s = 0, scopes - 1 do
  local base = 4 * s
  if tokens ~= 0 then
    if redis.call('exists', KEYS[base + 1]) == 1 then redis.call('incrby', KEYS[base + 1], tokens) end
    if redis.call('exists', KEYS[base + 2]) == 1 then redis.call('incrby', KEYS[base + 2], tokens) end
  end
  if cost ~= 0 and redis.call('exists', KEYS[base + 3]) == 1 then
    redis.call('incrby', KEYS[base + 3], cost)
  end
  redis.call('zrem', KEYS[base + 4], ARGV[3])
end
return 1
"""
"""Settles once: the held marker written at admission goes with the first settle, so when the
serving replica and a lease reaper (``gateway.leases``) both settle a request, the counters
are corrected once. A marker missing because Redis restarted empty (the key's epoch changed)
is told apart from one already settled, so such a request's tokens still reach the budget."""

SEED_ATTEMPTS = 3


class ScopeLimits(Protocol):
    """The limits of a key or of its team (``gateway.auth.ApiKeyRecord``, ``TeamLimits``)."""

    id: str
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    max_budget_micros: int | None
    budget_period: str | None


class KeyLimits(ScopeLimits, Protocol):
    team: ScopeLimits | None


class SpendSource(Protocol):
    """Where a missing budget counter is re-seeded from: the period's committed usage."""

    async def spent(self, kind: str, scope_id: str, period: str | None) -> tuple[int, int]:
        """``(tokens, cost micros)`` of the current period of ``period`` for a key or team."""
        ...


class PriceSource(Protocol):
    async def price_at(self, model: str, when: float | None = None) -> Price | None: ...


def format_reset(ms: int) -> str:
    """OpenAI's duration style: ``250ms``, ``7.5s``, ``1m12s``."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms / 1000, 60)
    seconds = f"{round(rest, 3):g}s"
    return f"{int(minutes)}m{seconds}" if minutes else seconds


def budget_period_id(period: str | None, now: float) -> tuple[str, int]:
    """The current period's bucket name and a TTL that outlives it."""
    return _period_of_minute(period, int(now // 60))


@functools.lru_cache(maxsize=64)
def _period_of_minute(period: str | None, minute: int) -> tuple[str, int]:
    # Days and months start on a minute boundary, so one answer serves the whole minute.
    moment = datetime.fromtimestamp(minute * 60, UTC)
    if period == "month":
        return moment.strftime("%Y%m"), 32 * 86400
    if period == "day":
        return moment.strftime("%Y%m%d"), 2 * 86400
    return "all", 400 * 86400


def _limit(value: int | None) -> int:
    return UNLIMITED if value is None else int(value)


def scope_tag(kind: str, scope_id: str, team_id: str | None) -> str:
    """Key names of a scope. A key of a team carries the team's hash tag, so one admission
    touches one Redis Cluster slot; a key without a team keeps ``{key-id}``."""
    if team_id is None:
        return f"sg:rl:{{{scope_id}}}"
    return f"sg:rl:{{{team_id}}}:team" if kind == "team" else f"sg:rl:{{{team_id}}}:k:{scope_id}"


def budget_keys(
    kind: str, scope: ScopeLimits, team_id: str | None, now: float
) -> tuple[str, str, int]:
    """``(token counter, money counter, ttl)`` of the current budget period of a scope."""
    tag = scope_tag(kind, scope.id, team_id)
    period, ttl = budget_period_id(scope.budget_period, now)
    return f"{tag}:b:{period}", f"{tag}:m:{period}", ttl


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

    def cost_micros(self, prompt_tokens: int, completion_tokens: int, cached: int = 0) -> int:
        """The real cost at the price in force at admission (0 for an unpriced model)."""
        if self.price is None:
            return 0
        return self.price.cost_micros(prompt_tokens, completion_tokens, cached)


def _scopes(key: KeyLimits) -> list[tuple[str, ScopeLimits]]:
    return [("key", key)] + ([("team", key.team)] if key.team is not None else [])


class RateLimiter:
    def __init__(
        self,
        redis: Redis,
        *,
        slot_ttl_s: float,
        spend: SpendSource | None = None,
        prices: PriceSource | None = None,
    ) -> None:
        self._redis = redis
        self._slot_ttl_s = slot_ttl_s + SLOT_TTL_MARGIN_S
        self._spend = spend
        self._prices = prices
        self._admit_sha = ""
        self._settle_sha = ""
        self._seed_sha = ""

    async def load(self) -> None:
        self._admit_sha = await self._redis.script_load(ADMIT_LUA)
        self._settle_sha = await self._redis.script_load(SETTLE_LUA)
        self._seed_sha = await self._redis.script_load(SEED_LUA)

    async def _evalsha(self, sha_attr: str, source: str, keys: list[str], args: list[Any]) -> Any:
        sha = getattr(self, sha_attr)
        try:
            if not sha:
                raise NoScriptError("not loaded yet")
            return await self._redis.evalsha(sha, len(keys), *keys, *args)
        except NoScriptError:
            # A Redis restart or failover forgets scripts; load again once.
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
    ) -> Admission:
        """Book one request of ``tokens`` (estimate; ``prompt_tokens`` of it the prompt) on the
        key and its team, or raise RateLimited / QuotaExceeded."""
        price = None
        if model is not None and self._prices is not None:
            price = await self._prices.price_at(model)
        prompt = tokens if prompt_tokens is None else prompt_tokens
        cost = price.worst_case_micros(prompt, tokens - prompt) if price is not None else 0
        for _ in range(SEED_ATTEMPTS):
            now = time.time()
            keys, args = self._admission_call(key, request_id, tokens, cost, now)
            result = await self._evalsha("_admit_sha", ADMIT_LUA, keys, args)
            if int(result[0]) != 5:
                break
            await self._seed(key, keys, [int(i) for i in result[3]], now)
        else:
            raise ServiceUnavailable("Budget counters could not be restored; try again shortly.")
        code, failed, retry_ms = int(result[0]), int(result[1]), int(result[2])
        scopes = _scopes(key)
        headers = _headers(scopes, result[4:])
        if code == 0:
            settle_keys = []
            for index in range(len(scopes)):
                base = 7 * index
                settle_keys += [keys[base + 2], keys[base + 5], keys[base + 6], keys[base + 4]]
            settle_keys += keys[-2:]
            return Admission(
                key.id,
                request_id,
                tokens,
                settle_keys,
                headers,
                price=price,
                reserved_micros=cost,
                team_id=key.team.id if key.team is not None else None,
                epoch=_text(result[-1]) if len(result) > 4 + 4 * len(scopes) else "",
            )
        REJECTIONS.labels(_REJECTION_REASONS[code]).inc()
        kind, scope = scopes[failed]
        raise _rejection(code, retry_ms, tokens, cost, kind, scope, headers)

    def _admission_call(
        self, key: KeyLimits, request_id: str, tokens: int, cost: int, now: float
    ) -> tuple[list[str], list[Any]]:
        window = int(now // WINDOW_S)
        keys: list[str] = []
        args: list[Any] = [
            repr(now),
            window * WINDOW_S,
            WINDOW_S,
            tokens,
            cost,
            request_id,
            repr(self._slot_ttl_s),
        ]
        scopes = _scopes(key)
        args.append(len(scopes))
        team_id = key.team.id if key.team is not None else None
        for kind, scope in scopes:
            tag = scope_tag(kind, scope.id, team_id)
            tokens_key, money_key, budget_ttl = budget_keys(kind, scope, team_id, now)
            keys += [
                f"{tag}:r:{window}",
                f"{tag}:r:{window - 1}",
                f"{tag}:t:{window}",
                f"{tag}:t:{window - 1}",
                f"{tag}:slots",
                tokens_key,
                money_key,
            ]
            args += [
                _limit(scope.rpm_limit),
                _limit(scope.tpm_limit),
                _limit(scope.max_parallel_requests),
                _limit(scope.token_budget),
                _limit(scope.max_budget_micros),
                budget_ttl,
            ]
        tag = scope_tag("key", key.id, team_id)
        args.append(os.urandom(6).hex())
        return [*keys, f"{tag}:held:{request_id}", f"{tag}:epoch"], args

    async def _seed(self, key: KeyLimits, keys: list[str], missing: list[int], now: float) -> None:
        """Restores missing budget counters from the period's committed usage in PostgreSQL."""
        if self._spend is None:
            values = dict.fromkeys(missing, 0)
        else:
            values = {}
            scopes = _scopes(key)
            for position in missing:
                index, slot = divmod(position - 1, 7)
                kind, scope = scopes[index]
                tokens, micros = await self._spend.spent(kind, scope.id, scope.budget_period)
                values[position] = tokens if slot == 5 else micros
        team_id = key.team.id if key.team is not None else None
        ttl = max(budget_keys(kind, scope, team_id, now)[2] for kind, scope in _scopes(key))
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
            *_settle_args(admission, actual_tokens, actual_micros),
        )

    async def settle(
        self, admission: Admission, actual_tokens: int, actual_micros: int = 0
    ) -> None:
        args = _settle_args(admission, actual_tokens, actual_micros)
        await self._evalsha("_settle_sha", SETTLE_LUA, admission.settle_keys, args)


def _settle_args(admission: Admission, actual_tokens: int, actual_micros: int) -> list[Any]:
    return [
        actual_tokens - admission.reserved_tokens,
        actual_micros - admission.reserved_micros,
        admission.request_id,
        admission.epoch,
        admission.reserved_tokens,
        admission.reserved_micros,
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _headers(scopes: list[tuple[str, ScopeLimits]], values: list[Any]) -> dict[str, str]:
    """OpenAI's headers for whichever limited scope has the least left."""
    headers: dict[str, str] = {}
    for name, limit_attr, offset in (("requests", "rpm_limit", 0), ("tokens", "tpm_limit", 2)):
        best: tuple[int, int, int] | None = None
        for index, (_, scope) in enumerate(scopes):
            limit = getattr(scope, limit_attr)
            if limit is None:
                continue
            left, reset = int(values[4 * index + offset]), int(values[4 * index + offset + 1])
            if best is None or left < best[1]:
                best = (int(limit), left, reset)
        if best is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(best[0])
            headers[f"x-ratelimit-remaining-{name}"] = str(best[1])
            headers[f"x-ratelimit-reset-{name}"] = format_reset(best[2])
    return headers


def _rejection(
    code: int,
    retry_ms: int,
    tokens: int,
    cost: int,
    kind: str,
    key: ScopeLimits,
    headers: dict[str, str],
) -> Exception:
    retry_s = retry_ms / 1000
    rpm, tpm = key.rpm_limit, key.tpm_limit
    owner = "this key" if kind == "key" else "this key's team"
    period = key.budget_period or "lifetime"
    if code == 4:
        return QuotaExceeded(
            f"This request needs up to {tokens} tokens, more than the remaining token budget "
            f"of {owner} ({key.token_budget} per {period}). "
            "Lower max_tokens or raise the budget.",
            headers=headers,
        )
    if code == 6:
        budget = from_micros(key.max_budget_micros or 0)
        return QuotaExceeded(
            f"This request may cost up to {from_micros(cost):.6f}, more than the remaining "
            f"budget of {owner} ({budget:g} per {period}). "
            "Lower max_tokens or raise the budget.",
            headers=headers,
        )
    if code == 1:
        return RateLimited(
            f"Rate limit reached for requests ({owner}): limit {rpm} per minute. "
            f"Please try again in {retry_s:.3g}s.",
            limit="requests",
            retry_after_s=retry_s,
            headers=headers,
        )
    if code == 2:
        if retry_ms < 0:
            return RateLimited(
                f"Request too large: it needs up to {tokens} tokens, more than the limit of "
                f"{tpm} tokens per minute. Lower max_tokens or shorten the prompt.",
                limit="tokens",
                retry_after_s=WINDOW_S,
                headers=headers,
            )
        return RateLimited(
            f"Rate limit reached for tokens ({owner}): limit {tpm} per minute, this request needs up "
            f"to {tokens}. Please try again in {retry_s:.3g}s.",
            limit="tokens",
            retry_after_s=retry_s,
            headers=headers,
        )
    return RateLimited(
        f"Too many parallel requests: {owner} may run {key.max_parallel_requests} at once.",
        limit="requests",
        retry_after_s=retry_s,
        headers=headers,
    )
