"""Per-key admission in one Redis round trip: requests/min, tokens/min, concurrency, budget.

One Lua script checks every limit of a key and, only if all pass, books them all — atomic,
so N gateway replicas sharing one Redis enforce one limit, not N. Every key a script touches
carries the hash tag ``{<key-id>}``, so a Redis Cluster keeps them on one slot.

Windows: requests/min and tokens/min use a *sliding window counter* — two fixed one-minute
buckets, the previous one weighted by how much of it still overlaps the last 60 s. It never
lets a burst of 2x the limit through at a minute boundary (a plain fixed window does), and
costs two GETs instead of a sorted set per request.

Tokens: admission reserves the estimate (prompt + max_tokens) against tokens/min and against
the budget of the current period (UTC day or month); ``settle`` replaces the reservation with
the real count and frees the concurrency slot. Since the reservation is the worst case, the
budget is never overshot, however many requests run at once.

Headers (OpenAI's): ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``; ``reset`` is
the time until the window has fully drained (back to the whole limit), e.g. ``1m12s``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from gateway.errors import QuotaExceeded, RateLimited
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
}

ADMIT_LUA = """
local now = tonumber(ARGV[1])
local elapsed = now - tonumber(ARGV[2])
local win = tonumber(ARGV[3])
local rpm = tonumber(ARGV[4])
local tpm = tonumber(ARGV[5])
local cost = tonumber(ARGV[6])
local parallel = tonumber(ARGV[7])
local budget = tonumber(ARGV[8])
local weight = 1 - elapsed / win

local function num(key) return tonumber(redis.call('get', key) or '0') end

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

local req_cur, req_prev, tok_cur, tok_prev = 0, 0, 0, 0
if rpm >= 0 then req_cur = num(KEYS[1]); req_prev = num(KEYS[2]) end
if tpm >= 0 then tok_cur = num(KEYS[3]); tok_prev = num(KEYS[4]) end
local req_used = req_prev * weight + req_cur
local tok_used = tok_prev * weight + tok_cur

local code, retry = 0, 0
if budget >= 0 and num(KEYS[6]) + cost > budget then
  code = 4
elseif rpm >= 0 and req_used + 1 > rpm then
  code, retry = 1, wait_for(req_cur, req_prev, 1, rpm)
elseif tpm >= 0 and tok_used + cost > tpm then
  code, retry = 2, wait_for(tok_cur, tok_prev, cost, tpm)
elseif parallel >= 0 then
  redis.call('zremrangebyscore', KEYS[5], '-inf', now)
  if redis.call('zcard', KEYS[5]) >= parallel then code, retry = 3, 1 end
end

if code == 0 then
  if rpm >= 0 then
    req_cur = redis.call('incr', KEYS[1]); redis.call('expire', KEYS[1], 2 * win)
    req_used = req_used + 1
  end
  if tpm >= 0 then
    tok_cur = redis.call('incrby', KEYS[3], cost); redis.call('expire', KEYS[3], 2 * win)
    tok_used = tok_used + cost
  end
  if parallel >= 0 then
    redis.call('zadd', KEYS[5], now + tonumber(ARGV[10]), ARGV[9])
    redis.call('expire', KEYS[5], math.ceil(tonumber(ARGV[10])))
  end
  if budget >= 0 then
    redis.call('incrby', KEYS[6], cost); redis.call('expire', KEYS[6], tonumber(ARGV[11]))
  end
end

return {code, math.floor(retry * 1000),
        math.floor(math.max(0, rpm - req_used)), math.floor(drain(req_cur, req_prev) * 1000),
        math.floor(math.max(0, tpm - tok_used)), math.floor(drain(tok_cur, tok_prev) * 1000)}
"""

SETTLE_LUA = """
local delta = tonumber(ARGV[1])
if delta ~= 0 then
  if redis.call('exists', KEYS[1]) == 1 then redis.call('incrby', KEYS[1], delta) end
  if redis.call('exists', KEYS[2]) == 1 then redis.call('incrby', KEYS[2], delta) end
end
redis.call('zrem', KEYS[3], ARGV[2])
return 1
"""


class KeyLimits(Protocol):
    """The limit fields of ``gateway.auth.ApiKeyRecord``."""

    id: str
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    budget_period: str | None


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


@dataclass(slots=True)
class Admission:
    """A granted reservation; ``settle`` it exactly once when the request ends."""

    key_id: str
    request_id: str
    reserved_tokens: int
    tokens_key: str
    budget_key: str
    slots_key: str
    headers: dict[str, str]


class RateLimiter:
    def __init__(self, redis: Redis, *, slot_ttl_s: float) -> None:
        self._redis = redis
        self._slot_ttl_s = slot_ttl_s + SLOT_TTL_MARGIN_S
        self._admit_sha = ""
        self._settle_sha = ""

    async def load(self) -> None:
        self._admit_sha = await self._redis.script_load(ADMIT_LUA)
        self._settle_sha = await self._redis.script_load(SETTLE_LUA)

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

    async def admit(self, key: KeyLimits, request_id: str, tokens: int) -> Admission:
        """Book one request of ``tokens`` (estimate) or raise RateLimited / QuotaExceeded."""
        now = time.time()
        window = int(now // WINDOW_S)
        tag = f"sg:rl:{{{key.id}}}"
        period, budget_ttl = budget_period_id(key.budget_period, now)
        keys = [
            f"{tag}:r:{window}",
            f"{tag}:r:{window - 1}",
            f"{tag}:t:{window}",
            f"{tag}:t:{window - 1}",
            f"{tag}:slots",
            f"{tag}:b:{period}",
        ]
        rpm, tpm = _limit(key.rpm_limit), _limit(key.tpm_limit)
        args = [
            repr(now),
            window * WINDOW_S,
            WINDOW_S,
            rpm,
            tpm,
            tokens,
            _limit(key.max_parallel_requests),
            _limit(key.token_budget),
            request_id,
            repr(self._slot_ttl_s),
            budget_ttl,
        ]
        code, retry_ms, req_left, req_reset, tok_left, tok_reset = await self._evalsha(
            "_admit_sha", ADMIT_LUA, keys, args
        )
        headers: dict[str, str] = {}
        if rpm >= 0:
            headers["x-ratelimit-limit-requests"] = str(rpm)
            headers["x-ratelimit-remaining-requests"] = str(req_left)
            headers["x-ratelimit-reset-requests"] = format_reset(req_reset)
        if tpm >= 0:
            headers["x-ratelimit-limit-tokens"] = str(tpm)
            headers["x-ratelimit-remaining-tokens"] = str(tok_left)
            headers["x-ratelimit-reset-tokens"] = format_reset(tok_reset)
        if code == 0:
            return Admission(key.id, request_id, tokens, keys[2], keys[5], keys[4], headers)
        REJECTIONS.labels(_REJECTION_REASONS[code]).inc()
        raise _rejection(code, retry_ms, tokens, rpm, tpm, key, headers)

    def settle_command(self, admission: Admission, actual_tokens: int) -> tuple[Any, ...]:
        """The EVALSHA that settles ``admission``, for a caller's pipeline."""
        keys = [admission.tokens_key, admission.budget_key, admission.slots_key]
        delta = actual_tokens - admission.reserved_tokens
        return ("EVALSHA", self._settle_sha, len(keys), *keys, delta, admission.request_id)

    async def settle(self, admission: Admission, actual_tokens: int) -> None:
        keys = [admission.tokens_key, admission.budget_key, admission.slots_key]
        delta = actual_tokens - admission.reserved_tokens
        await self._evalsha("_settle_sha", SETTLE_LUA, keys, [delta, admission.request_id])


def _rejection(
    code: int,
    retry_ms: int,
    tokens: int,
    rpm: int,
    tpm: int,
    key: KeyLimits,
    headers: dict[str, str],
) -> Exception:
    retry_s = retry_ms / 1000
    if code == 4:
        return QuotaExceeded(
            f"This request needs up to {tokens} tokens, more than the remaining token budget "
            f"of this key ({key.token_budget} per {key.budget_period or 'lifetime'}). "
            "Lower max_tokens or raise the budget.",
            headers=headers,
        )
    if code == 1:
        return RateLimited(
            f"Rate limit reached for requests: limit {rpm} per minute. "
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
            f"Rate limit reached for tokens: limit {tpm} per minute, this request needs up "
            f"to {tokens}. Please try again in {retry_s:.3g}s.",
            limit="tokens",
            retry_after_s=retry_s,
            headers=headers,
        )
    return RateLimited(
        f"Too many parallel requests: this key may run {key.max_parallel_requests} at once.",
        limit="requests",
        retry_after_s=retry_s,
        headers=headers,
    )
