"""Crash-safe settlement: every admitted request leaves a lease that outlives its replica.

A request is settled (reservation corrected, concurrency slot freed, usage event written) by
the replica that serves it when it ends. A replica that dies mid-request (OOM, node loss)
never gets there. So the admission script (``sluicegate.gateway.admission.scripts``) also stores a *lease*:
what is known of the request so far (key, model, reservation, prompt tokens, tokens relayed
to the client), and the settle script releases it — no round trip of its own. The lease lives
in the hash ``<key's tag>:leases:<instance>``, under the key's hash tag so that one script
touches one Redis Cluster slot; the replica lists those hashes in the set
``sg:gw:{<instance>}:lease-hashes`` (written before the first lease goes into a new hash).

The replica (``sluicegate.gateway.leases.book``) rewrites its leases (tokens relayed so far) every
``lease_s / 3`` and renews its own entry in the sorted set ``<usage stream>:replicas``
(score: the time it expires, on Redis's clock). A reaper on every replica
(``sluicegate.gateway.leases.reaper``) settles the leases of replicas whose entry expired, as the dead
replica would have — only once its own replica has reached Redis for a whole lease (after an
outage, live peers need that long to renew). Should a reaper still settle a live replica's
request (a partition), that replica's own settle adds what it served beyond the reaper's
count to the budgets, and its usage record raises the stored one (``sluicegate.gateway.db.usage``).

Settling twice is harmless: the reservation's ``held`` marker (see ``sluicegate.gateway.admission.scripts``)
lets only the first settle correct the counters, only the settle that releases the lease
writes the reaper's usage event, and usage rows are idempotent on request id.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec

from sluicegate.gateway.admission.keys import KeyLimits, scope_tag
from sluicegate.gateway.admission.limits import Admission
from sluicegate.gateway.admission.scripts import EPOCH_TTL_S
from sluicegate.gateway.usage.pricing import Price
from sluicegate.gateway.usage.stream import UsageEvent

RENEW_LUA = """
-- KEYS: a lease hash, the key's epoch, the concurrency slots of the key (and of its team),
-- then each lease's held marker; ARGV: the number of slot keys, now, the slot ttl, then per
-- lease its request id, the lease, its admission epoch. A lease is written only while its
-- request is unsettled (held marker '1'), or put back when Redis lost it (restarted empty: no
-- marker, another epoch). A settled one is never written back: that would settle it a second
-- time. The key's epoch lives as long as a request of the key does. A live request's held marker and slots are pushed out by a slot ttl: they outlive a
-- request that runs longer than its deadline margin (a stream with no total bound) as long as
-- its replica renews, and free themselves that long after the renewals stop.
local current = redis.call('get', KEYS[2])
if current then redis.call('expire', KEYS[2], EPOCH_TTL_S) end
local slots, now, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local first = 3 + slots
for i = first, #KEYS do
  local a = 3 + 3 * (i - first)
  local held = redis.call('get', KEYS[i])
  if held == '1' then
    redis.call('hset', KEYS[1], ARGV[a + 1], ARGV[a + 2])
    redis.call('expire', KEYS[i], math.ceil(ttl))
    for s = 3, first - 1 do
      redis.call('zadd', KEYS[s], 'XX', 'GT', now + ttl, ARGV[a + 1])
    end
  elseif not held and ARGV[a + 3] ~= '' and current ~= ARGV[a + 3] then
    redis.call('hset', KEYS[1], ARGV[a + 1], ARGV[a + 2])
  end
end
for s = 3, first - 1 do
  if redis.call('ttl', KEYS[s]) >= 0 and redis.call('ttl', KEYS[s]) < ttl then
    redis.call('expire', KEYS[s], math.ceil(ttl))
  end
end
return 1
"""


ALIVE_LUA = """
-- KEYS: the replicas' sorted set; ARGV: this replica, its lease in seconds. Its entry expires
-- lease seconds from now on Redis's clock, the one every reaper judges expiry by (a replica
-- whose clock runs ahead must not reap live peers, one running behind must not outlive itself).
local now = redis.call('time')
redis.call('zadd', KEYS[1], now[1] + now[2] / 1000000 + tonumber(ARGV[2]), ARGV[1])
return 1
"""

EXPIRED_LUA = """
-- KEYS: the replicas' sorted set. The replicas whose entry expired, on Redis's clock.
local now = redis.call('time')
return redis.call('zrangebyscore', KEYS[1], '-inf', now[1] + now[2] / 1000000)
"""


RENEW_LUA = RENEW_LUA.replace("EPOCH_TTL_S", str(EPOCH_TTL_S))


def replicas_key(usage_stream: str) -> str:
    """The replicas of one deployment: those that write usage to the same stream (replicas of
    another deployment on the same Redis bill into another database and must not reap ours)."""
    return f"{usage_stream}:replicas"


def lease_hashes_key(instance_id: str) -> str:
    """The set naming every lease hash a replica has written to."""
    return f"sg:gw:{{{instance_id}}}:lease-hashes"


def lease_hash_key(key: KeyLimits, instance_id: str) -> str:
    """A replica's leases of one API key: under the key's hash tag, like its reservation."""
    team_id = key.team.id if key.team is not None else None
    return f"{scope_tag('key', key.id, team_id)}:leases:{instance_id}"


class Lease(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    key_id: str
    model: str
    reserved_tokens: int
    settle_keys: list[str]
    """The settle script's keys: per scope four, then held marker, epoch and lease hash."""
    reserved_micros: int = 0
    price: Price | None = None
    team_id: str | None = None
    epoch: str = ""
    """Empty in the copy the admission stored (the epoch comes back with its answer)."""
    started_at: float
    prompt_tokens: int = 0
    """The real prompt count once the provider reported it, else the admission estimate."""
    delivered_tokens: int = 0
    first_token: bool = False
    """Whether anything was generated: a request that produced nothing is billed nothing."""
    deployment: str | None = None
    renewed_at: float = 0.0
    booked: str = ""
    reply_to: str = ""
    """The engine reply stream the request's deltas come back on (empty: not an engine
    request, or none relayed yet): a reaper bills what the replica had read of it."""
    max_completion: int = 0
    """The most completion tokens the request may generate (max_tokens times n; 0: unknown)."""
    adapter: str | None = None
    """The LoRA adapter the request runs with (its usage record's ``adapter``)."""

    def admission(self) -> Admission:
        return Admission(
            self.key_id,
            self.request_id,
            self.reserved_tokens,
            self.settle_keys,
            {},
            price=self.price,
            reserved_micros=self.reserved_micros,
            team_id=self.team_id,
            epoch=self.epoch,
            booked=self.booked,
        )

    def usage_event(self) -> UsageEvent:
        prompt = self.prompt_tokens if self.first_token else 0
        completion = self.delivered_tokens if self.first_token else 0
        finished = self.renewed_at or self.started_at
        return UsageEvent(
            request_id=self.request_id,
            key_id=self.key_id,
            model=self.model,
            deployment=self.deployment,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cost_micros=self.admission().cost_micros(prompt, completion),
            team_id=self.team_id,
            status="error",
            adapter=self.adapter,
            latency_ms=max(0.0, finished - self.started_at) * 1000,
            started_at=self.started_at,
            finished_at=finished,
        )


encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(Lease)


@dataclass(slots=True)
class LeaseDraft:
    """A request's lease before its admission (``sluicegate.gateway.admission.limits.LeaseDraft``)."""

    hash_key: str
    model: str
    prompt_estimate: int
    started_at: float
    max_completion: int = 0
    adapter: str | None = None
    lease: Lease | None = field(default=None)

    def encode(self, admission: Admission) -> bytes:
        self.lease = Lease(
            request_id=admission.request_id,
            key_id=admission.key_id,
            model=self.model,
            reserved_tokens=admission.reserved_tokens,
            settle_keys=admission.settle_keys,
            reserved_micros=admission.reserved_micros,
            price=admission.price,
            team_id=admission.team_id,
            booked=admission.booked,
            started_at=self.started_at,
            prompt_tokens=self.prompt_estimate,
            renewed_at=time.time(),
            max_completion=self.max_completion,
            adapter=self.adapter,
        )
        return encoder.encode(self.lease)


def renew_call(
    leases: list[Lease], now: float, slot_ttl_s: float
) -> tuple[list[str], list[str | bytes]]:
    """RENEW_LUA's keys and args for leases of one hash (one key: the same slots)."""
    settle_keys = leases[0].settle_keys
    _, epoch, hash_key = settle_keys[-3:]
    slots = [settle_keys[4 * scope + 3] for scope in range((len(settle_keys) - 3) // 4)]
    keys = [hash_key, epoch, *slots]
    args: list[str | bytes] = [str(len(slots)), repr(now), repr(slot_ttl_s)]
    for lease in leases:
        keys.append(lease.settle_keys[-3])
        args += [lease.request_id, encoder.encode(lease), lease.epoch]
    return keys, args
