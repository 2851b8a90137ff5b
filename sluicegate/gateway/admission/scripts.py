"""The Lua scripts of admission and settlement (``sluicegate.gateway.admission.limits`` builds their keys and args).

A request costs Redis two round trips: ``ADMIT_LUA`` checks and books every limit of the key
and its team, marks the reservation held and stores the request's lease (``sluicegate.gateway.leases.lease``);
``SETTLE_LUA`` (pipelined with the usage event) corrects the reservation, frees the slot and
releases the lease. Every key either script touches carries the key's hash tag: one Redis
Cluster slot.
"""

from __future__ import annotations

WINDOW_S = 60
"""The sliding window of requests/min and tokens/min (two buckets of this length)."""

ADMIT_LUA = """
-- ARGV: now, window start, window length, tokens, cost (micros), member, slot ttl, scope count,
-- then per scope: rpm, tpm, parallel, token budget, money budget, budget ttl (-1 = no limit).
-- KEYS per scope (7): req cur, req prev, tok cur, tok prev, slots, token budget, money budget;
-- then, optionally, the reservation's held marker and the key's epoch (see SETTLE_LUA), with
-- one more ARGV: the epoch to start when the key has none (Redis started empty); then,
-- optionally, the replica's lease hash (sluicegate.gateway.leases.lease), with one more ARGV: the lease.
-- Returns code, failed scope, retry ms, missing counters, four header numbers per scope, the
-- epoch, then the key's headroom after a booking (sluicegate.gateway.admission.speculation): the largest share of
-- any limit now used, in permille, and the tokens and micros left before the nearest token
-- and money limit (-1: none).
-- Every ARGV is read once and every global is a local: Lua looks globals up by name, and this
-- script runs once per request, with the request waiting on it.
local call, tonumber, floor, max, unpack = redis.call, tonumber, math.floor, math.max, unpack
local now = tonumber(ARGV[1])
local elapsed = now - tonumber(ARGV[2])
local win = tonumber(ARGV[3])
local tokens = tonumber(ARGV[4])
local cost = tonumber(ARGV[5])
local member = ARGV[6]
local slot_ttl = tonumber(ARGV[7])
local scopes = tonumber(ARGV[8])
local weight = 1 - elapsed / win

-- seconds until prev*weight(t) + cur + amount <= limit; -1 when it never will
local function wait_for(cur, prev, amount, limit)
  if amount > limit then return -1 end
  if cur + amount <= limit then
    if prev <= 0 then return 0 end
    local t = win * (1 - (limit - cur - amount) / prev)
    return max(0, t - elapsed)
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

-- One MGET reads every counter admission compares, per scope: the budget counters, then the
-- request and token windows, each only where its limit is set (a call costs more than a key).
-- A budget counter that is missing (new period, Redis restart, eviction) is seeded by the
-- caller from the database first: answer which, and book nothing.
local state, names = {}, {}
for s = 0, scopes - 1 do
  local a, k = 8 + 6 * s, 7 * s
  local st = {
    rpm = tonumber(ARGV[a + 1]), tpm = tonumber(ARGV[a + 2]), parallel = tonumber(ARGV[a + 3]),
    budget = tonumber(ARGV[a + 4]), money = tonumber(ARGV[a + 5]), budget_ttl = ARGV[a + 6],
    req_cur = 0, req_prev = 0, tok_cur = 0, tok_prev = 0, slots = 0, k = k,
  }
  if st.budget >= 0 then names[#names + 1] = KEYS[k + 6]; st.at_budget = #names end
  if st.money >= 0 then names[#names + 1] = KEYS[k + 7]; st.at_money = #names end
  if st.rpm >= 0 then
    names[#names + 1] = KEYS[k + 1]; names[#names + 1] = KEYS[k + 2]; st.at_req = #names - 1
  end
  if st.tpm >= 0 then
    names[#names + 1] = KEYS[k + 3]; names[#names + 1] = KEYS[k + 4]; st.at_tok = #names - 1
  end
  state[s] = st
end
local values = {}
if #names > 0 then values = call('mget', unpack(names)) end
local missing = {}
for s = 0, scopes - 1 do
  local st = state[s]
  if st.at_budget then
    st.spent = values[st.at_budget]
    if not st.spent then missing[#missing + 1] = st.k + 6 end
  end
  if st.at_money then
    st.spent_money = values[st.at_money]
    if not st.spent_money then missing[#missing + 1] = st.k + 7 end
  end
end
if #missing > 0 then return {5, -1, 0, missing} end

local code, failed, retry = 0, -1, 0
for s = 0, scopes - 1 do
  local st = state[s]
  local k, rpm, tpm, parallel = st.k, st.rpm, st.tpm, st.parallel
  if st.at_req then
    st.req_cur = tonumber(values[st.at_req] or '0')
    st.req_prev = tonumber(values[st.at_req + 1] or '0')
  end
  if st.at_tok then
    st.tok_cur = tonumber(values[st.at_tok] or '0')
    st.tok_prev = tonumber(values[st.at_tok + 1] or '0')
  end
  st.req_used = st.req_prev * weight + st.req_cur
  st.tok_used = st.tok_prev * weight + st.tok_cur
  if code == 0 then
    if st.budget >= 0 and tonumber(st.spent) + tokens > st.budget then
      code = 4
    elseif st.money >= 0 and tonumber(st.spent_money) + cost > st.money then
      code = 6
    elseif rpm >= 0 and st.req_used + 1 > rpm then
      code, retry = 1, wait_for(st.req_cur, st.req_prev, 1, rpm)
    elseif tpm >= 0 and st.tok_used + tokens > tpm then
      code, retry = 2, wait_for(st.tok_cur, st.tok_prev, tokens, tpm)
    elseif parallel >= 0 then
      call('zremrangebyscore', KEYS[k + 5], '-inf', now)
      st.slots = call('zcard', KEYS[k + 5])
      if st.slots >= parallel then code, retry = 3, 1 end
    end
    if code ~= 0 then failed = s end
  end
end

local out = {code, failed, floor(retry * 1000), {}}
for s = 0, scopes - 1 do
  local st = state[s]
  local k, rpm, tpm = st.k, st.rpm, st.tpm
  if code == 0 then
    -- A window counter expires two windows after it was made (it is read in its own window
    -- and the next): only an INCR that made it sets its TTL.
    if rpm >= 0 then
      st.req_cur = call('incr', KEYS[k + 1])
      if st.req_cur == 1 then call('expire', KEYS[k + 1], 2 * win) end
      st.req_used = st.req_used + 1
    end
    if tpm >= 0 then
      st.tok_cur = call('incrby', KEYS[k + 3], tokens)
      if st.tok_cur == tokens then call('expire', KEYS[k + 3], 2 * win) end
      st.tok_used = st.tok_used + tokens
    end
    if st.parallel >= 0 then
      call('zadd', KEYS[k + 5], now + slot_ttl, member)
      call('expire', KEYS[k + 5], math.ceil(slot_ttl))
    end
    if st.budget >= 0 then
      call('incrby', KEYS[k + 6], tokens); call('expire', KEYS[k + 6], st.budget_ttl)
    end
    if st.money >= 0 then
      call('incrby', KEYS[k + 7], cost); call('expire', KEYS[k + 7], st.budget_ttl)
    end
  end
  out[#out + 1] = floor(max(0, rpm - st.req_used))
  out[#out + 1] = floor(drain(st.req_cur, st.req_prev) * 1000)
  out[#out + 1] = floor(max(0, tpm - st.tok_used))
  out[#out + 1] = floor(drain(st.tok_cur, st.tok_prev) * 1000)
end
local epoch = ''
local extra_keys, extra_args = 7 * scopes, 8 + 6 * scopes
if code == 0 and #KEYS > extra_keys then
  call('set', KEYS[extra_keys + 1], '1', 'EX', math.ceil(slot_ttl))
  epoch = call('getex', KEYS[extra_keys + 2], 'EX', EPOCH_TTL_S)
  if not epoch then
    epoch = ARGV[extra_args + 1]
    call('set', KEYS[extra_keys + 2], epoch, 'EX', EPOCH_TTL_S)
  end
  if #KEYS > extra_keys + 2 then
    -- From here on, a replica that dies is settled by another (sluicegate.gateway.leases.lease).
    call('hset', KEYS[extra_keys + 3], member, ARGV[extra_args + 2])
  end
end
out[#out + 1] = epoch
if code == 0 then
  local load, token_room, money_room = 0, -1, -1
  local function share(used, limit)
    if limit > 0 and used / limit > load then load = used / limit end
  end
  local function least(room, left)
    if room < 0 or left < room then return max(0, left) end
    return room
  end
  for s = 0, scopes - 1 do
    local st = state[s]
    if st.rpm >= 0 then share(st.req_used, st.rpm) end
    if st.tpm >= 0 then
      share(st.tok_used, st.tpm); token_room = least(token_room, st.tpm - st.tok_used)
    end
    if st.parallel >= 0 then share(st.slots + 1, st.parallel) end
    if st.budget >= 0 then
      local spent = tonumber(st.spent) + tokens
      share(spent, st.budget); token_room = least(token_room, st.budget - spent)
    end
    if st.money >= 0 then
      local spent = tonumber(st.spent_money) + cost
      share(spent, st.money); money_room = least(money_room, st.money - spent)
    end
  end
  out[#out + 1] = floor(math.min(load, 1) * 1000)
  out[#out + 1] = floor(token_room)
  out[#out + 1] = floor(money_room)
end
return out
"""

EPOCH_TTL_S = 86400
"""How long a key's epoch outlives its last admission or lease renewal (one key per API key
ever served must not stay forever). It only has to outlast the latest settle of a request
admitted under it, which comes within SETTLED_MARKER_TTL_S of its last renewal."""

ADMIT_LUA = ADMIT_LUA.replace("EPOCH_TTL_S", str(EPOCH_TTL_S))

SEED_LUA = """
-- KEYS: budget counters; ARGV: ttl, then one value per key. NX: a concurrent seed or a
-- booking that got there first is kept.
for i, name in ipairs(KEYS) do
  redis.call('set', name, ARGV[i + 1], 'NX', 'EX', tonumber(ARGV[1]))
end
return #KEYS
"""

SETTLED_MARKER_TTL_S = 3600
"""How long a reservation settled after Redis lost it stays marked settled (see SETTLE_LUA);
it only has to outlast the serving replica's next lease renewal."""

SETTLE_LUA = f"""
-- ARGV: token delta, cost delta, member[, admission epoch, reserved tokens, reserved cost[,
-- seconds to remember what this settle billed (a lease reaper's), 0 when not[, per scope
-- three flags (tokens/min, token budget, money budget): '1' booked at admission, '0' not]]].
-- KEYS per scope (4): tok cur, token budget, money budget, slots; then, optionally, the held
-- marker, the key's epoch and the lease hash (at most three keys: the scope count is what
-- the division leaves). A counter gone meanwhile is re-seeded from the database later.
-- Returns 1 when this settle released the lease (or there is none), else 0.
local tokens, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
local scopes = math.floor(#KEYS / 4)
local extra = 4 * scopes
local released = 1
-- What a counter the admission did not book takes (it exists only to show the spend): the
-- real amount, where a booked one takes the delta; both the same once the reservation is gone.
local unbooked_tokens, unbooked_cost = nil, nil
local booked = ARGV[8] or ''
if #KEYS > extra + 2 then released = redis.call('hdel', KEYS[extra + 3], ARGV[3]) end
if #KEYS > extra then
  local marker = KEYS[extra + 1]
  local held = redis.call('get', marker)
  local real_tokens, real_cost = nil, nil
  if (ARGV[5] or '') ~= '' then
    real_tokens, real_cost = tokens + tonumber(ARGV[5]), cost + tonumber(ARGV[6])
  end
  local remember = tonumber(ARGV[7] or '0')
  if held == '1' then
    unbooked_tokens, unbooked_cost = real_tokens or 0, real_cost or 0
    if remember > 0 and real_tokens then
      -- A reaper settles a replica it takes for dead. If that replica was alive after all
      -- (a partition, a pause), its own settle comes later with the full counts: it must
      -- find what the reaper billed, to add only the difference.
      redis.call('set', marker, 's:' .. real_tokens .. ':' .. real_cost, 'EX', remember)
    else
      redis.call('del', marker)
    end
  elseif held and string.sub(held, 1, 2) == 's:' and real_tokens then
    -- Settled already, and what that settle billed is known: the counters take what this one
    -- bills beyond it (the serving replica's real counts after a reaper's partial ones).
    local was_tokens, was_cost = string.match(held, '^s:(-?%d+):(-?%d+)$')
    was_tokens, was_cost = tonumber(was_tokens), tonumber(was_cost)
    tokens = math.max(0, real_tokens - was_tokens)
    cost = math.max(0, real_cost - was_cost)
    if remember > 0 then
      local billed = 's:' .. math.max(real_tokens, was_tokens) .. ':' .. math.max(real_cost, was_cost)
      redis.call('set', marker, billed, 'KEEPTTL')
    else
      redis.call('del', marker)  -- the serving replica's settle: the last there will be
    end
  elseif not held and #KEYS > extra + 1 and (ARGV[4] or '') ~= ''
      and redis.call('get', KEYS[extra + 2]) ~= ARGV[4] then
    -- Redis lost the reservation (it restarted empty): the counters were re-seeded from the
    -- database without this request, so they take its whole real amount. Marked settled with
    -- that amount, so that a second settle (a lease put back by a renewal) adds only more.
    tokens, cost = real_tokens, real_cost
    redis.call('set', marker, 's:' .. real_tokens .. ':' .. real_cost,
      'EX', math.max({SETTLED_MARKER_TTL_S}, remember))
  else
    -- Settled already (by the serving replica or a lease reaper), or a lease written before
    -- its admission returned the epoch: only free the slots.
    tokens, cost = 0, 0
  end
end
local function amount(s, i, delta, real)
  if real ~= nil and string.sub(booked, 3 * s + i, 3 * s + i) == '0' then return real end
  return delta
end
local function add(name, value)
  if value ~= 0 and redis.call('exists', name) == 1 then redis.call('incrby', name, value) end
end
for s = 0, scopes - 1 do
  local base = 4 * s
  add(KEYS[base + 1], amount(s, 1, tokens, unbooked_tokens))
  add(KEYS[base + 2], amount(s, 2, tokens, unbooked_tokens))
  add(KEYS[base + 3], amount(s, 3, cost, unbooked_cost))
  redis.call('zrem', KEYS[base + 4], ARGV[3])
end
return released
"""
"""Settles once: the held marker written at admission goes with the first settle, so when the
serving replica and a lease reaper (``sluicegate.gateway.leases.lease``) both settle a request, the counters
are corrected once; a reaper's settle leaves what it billed in the marker, so the serving
replica's settle, if it comes after all, adds only what it bills beyond that. A marker missing because Redis restarted empty (the key's epoch changed)
is told apart from one already settled, so such a request's tokens still reach the budget."""
