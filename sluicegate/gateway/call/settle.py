"""Settling a call: the real token counts and cost replace the admission's reservation, the
lease is released and the usage event appended (one Redis round trip, shared with other
requests' commands under load: ``sluicegate.gateway.redis.batch``), metrics and the GenAI span record the
outcome. Runs once per admitted call, whatever its end."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from sluicegate.gateway.call.spans import record_outcome
from sluicegate.gateway.telemetry import model_metrics
from sluicegate.gateway.usage.stream import UsageEvent

if TYPE_CHECKING:
    from sluicegate.gateway.call.state import CallState

logger = logging.getLogger(__name__)

_SETTLE_ATTEMPTS = 4


async def settle(call: CallState) -> None:
    now = time.perf_counter()
    usage = call.billed()
    billed_total = usage.prompt_tokens + usage.completion_tokens
    cost = call.admission.cost_micros(
        usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
    )
    ttft_ms = (
        (call.first_token_at - call.started) * 1000 if call.first_token_at is not None else None
    )
    event = UsageEvent(
        request_id=call.request_id,
        key_id=call.key.id,
        model=call.public_model,
        deployment=call.deployment.name if call.deployment else None,
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
        cost_micros=cost,
        team_id=call.admission.team_id,
        status=call.status,  # type: ignore[arg-type]
        finish_reason=call.finish_reason if call.status == "ok" else None,
        latency_ms=(now - call.started) * 1000,
        ttft_ms=ttft_ms,
        started_at=time.time() - (now - call.started),
        finished_at=time.time(),
        adapter=call.adapter,
    )
    services = call.services
    settled = False
    for attempt in range(_SETTLE_ATTEMPTS):
        try:
            await _settle_and_record(call, event, billed_total, cost)
            settled = True
            break
        except RedisError:
            # A pooled connection Redis closed (restart, failover) fails once; settling again
            # is safe: the held marker lets only one settle move the counters, and usage rows
            # are idempotent on request id.
            if attempt + 1 < _SETTLE_ATTEMPTS:
                await asyncio.sleep(0.2 * 2**attempt)
    leases = services.leases
    if settled:
        if leases is not None:
            # Only now: until the settle landed, the lease is what gets this request counted.
            leases.forget(call.request_id)
    elif leases is not None:
        # Redis is away for longer than the attempts: the lease stays renewed with the final
        # counts (a peer settles it if this replica dies meanwhile) and the renewal loop
        # settles it once Redis is back.
        leases.settle_later(
            call.request_id,
            functools.partial(_settle_and_record, call, event, billed_total, cost),
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
        )
    else:
        logger.error("could not settle %s or record its usage: Redis unreachable", call.request_id)
    metrics = model_metrics(call.public_model)
    metrics.requests(call.status).inc()
    metrics.prompt_tokens.inc(usage.prompt_tokens)
    metrics.completion_tokens.inc(usage.completion_tokens)
    if ttft_ms is not None:
        metrics.time_to_first_token.observe(ttft_ms / 1000)
    if call.span.is_recording():
        record_outcome(call, usage)
    call.span.end()


async def _settle_and_record(
    call: CallState, event: UsageEvent, billed_total: int, cost: int
) -> None:
    services = call.services
    settled, recorded = await services.limiter.batch.execute(
        services.limiter.settle_command(call.admission, billed_total, cost),
        services.recorder.record_command(event),
    )
    if isinstance(recorded, Exception):
        logger.error("usage of %s not recorded: %s", call.request_id, recorded)
    if isinstance(settled, Exception):
        # The settle script was forgotten (Redis restart): load it, settle again.
        await services.limiter.settle(call.admission, billed_total, cost)
