"""The derived rollups (revision 0003) against usage_daily itself.

Every report is recomputed here from usage_daily's rows in Python, the way the reports were
answered before the derived rollups existed, and must come out identical from the rollups and
their pending changes, folded or not: every filter, grouping and range (ranges that start and
end mid-month, on month bounds, open, empty), after keys moved teams mid-day, after
corrections of stored records, after deletes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
import random
import time
import uuid
from collections import defaultdict
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db import usage_reports as usage_queries
from sluicegate.gateway.db.models import NO_TEAM
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.db.usage import insert_usage
from sluicegate.gateway.db.usage_reports import UsageTotals
from sluicegate.gateway.db.usage_upkeep import fold_usage_rollups
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import UsageEvent, UsageFlusher, UsageRecorder

TEAMS = [uuid.uuid4(), uuid.uuid4()]
KEYS = [uuid.uuid4() for _ in range(4)]
KEY_TEAM: dict[uuid.UUID, uuid.UUID | None] = {
    KEYS[0]: TEAMS[0],
    KEYS[1]: TEAMS[0],
    KEYS[2]: TEAMS[1],
    KEYS[3]: None,
}
MODELS = ["m-a", "m-b", "m-c"]
# Mid-March to mid-June: three month boundaries, whole months and partial ones.
FIRST = dt.date(2026, 3, 14)
LAST = dt.date(2026, 6, 17)
# Each derived rollup: its key columns, and the usage_daily expression of each.
DERIVED: dict[str, tuple[tuple[str, str], ...]] = {
    "usage_daily_keys": (
        ("day", "day"),
        ("team_id", "coalesce(team_id, :none)"),
        ("key_id", "key_id"),
    ),
    "usage_daily_models": (
        ("team_id", "coalesce(team_id, :none)"),
        ("model", "model"),
        ("day", "day"),
    ),
    "usage_daily_totals": (("model", "model"), ("day", "day")),
    "usage_monthly": (
        ("month", "date_trunc('month', day)::date"),
        ("team_id", "coalesce(team_id, :none)"),
        ("key_id", "key_id"),
        ("model", "model"),
    ),
    "usage_monthly_keys": (
        ("month", "date_trunc('month', day)::date"),
        ("team_id", "coalesce(team_id, :none)"),
        ("key_id", "key_id"),
    ),
}
SUMS = "requests, prompt_tokens, completion_tokens, cost_micros, errors"


def _record(
    key: uuid.UUID,
    model: str,
    when: dt.datetime,
    prompt: int,
    completion: int,
    *,
    team: uuid.UUID | None,
    request_id: str | None = None,
    status: str = "ok",
    cost: int = 0,
) -> dict[str, Any]:
    return {
        "request_id": request_id or uuid.uuid4().hex,
        "key_id": key,
        "team_id": team,
        "model": model,
        "deployment": None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cost_micros": cost,
        "status": status,
        "finish_reason": "stop",
        "latency_ms": 1.0,
        "ttft_ms": None,
        "started_at": when,
        "finished_at": when,
    }


def _random_records(rng: random.Random, count: int) -> list[dict[str, Any]]:
    records = []
    span = (LAST - FIRST).days
    for _ in range(count):
        key = rng.choice(KEYS)
        day = FIRST + dt.timedelta(days=rng.randrange(span + 1))
        when = dt.datetime.combine(day, dt.time(rng.randrange(24), rng.randrange(60)), dt.UTC)
        records.append(
            _record(
                key,
                rng.choice(MODELS),
                when,
                rng.randrange(1, 500),
                rng.randrange(0, 300),
                team=KEY_TEAM[key],
                status="error" if rng.random() < 0.1 else "ok",
                cost=rng.randrange(0, 9000),
            )
        )
    return records


async def _fill(sessionmaker: async_sessionmaker[AsyncSession]) -> None:
    rng = random.Random(34)
    records = _random_records(rng, 600)
    for start in range(0, len(records), 97):
        async with sessionmaker() as session, session.begin():
            await insert_usage(session, records[start : start + 97])
    # Folded: what follows (team moves, corrections) is pending against rows already folded.
    assert await _fold(sessionmaker) > 0
    noon = dt.datetime.combine(dt.date(2026, 4, 30), dt.time(12), dt.UTC)
    async with sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [
                # KEYS[0] moves from team 0 to team 1 on April 30: the whole day's row of m-a
                # (and only it) goes with it, as usage_daily's team_id does.
                _record(KEYS[0], "m-a", noon, 10, 5, team=TEAMS[0], request_id="move-1"),
                _record(KEYS[0], "m-b", noon, 3, 3, team=TEAMS[0], request_id="stays"),
            ],
        )
    async with sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [_record(KEYS[0], "m-a", noon, 7, 1, team=TEAMS[1], request_id="move-2")],
        )
    async with sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [
                # A key's only row of a day moves out of its team: that team's row of the day
                # empties and must go, not stay as a row of zeros.
                _record(KEYS[2], "m-c", noon, 4, 4, team=TEAMS[1], request_id="lonely"),
            ],
        )
    async with sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [
                _record(KEYS[2], "m-c", noon, 1, 1, team=TEAMS[0], request_id="lonely-2"),
                # A correction of a stored record: the larger counts win, the rollups take the
                # difference.
                _record(KEYS[0], "m-b", noon, 30, 30, team=TEAMS[0], request_id="stays"),
                # No team on the record: usage_daily keeps the row's team.
                _record(KEYS[1], "m-a", noon, 2, 2, team=None),
            ],
        )


async def _daily_rows(sessionmaker: async_sessionmaker[AsyncSession]) -> list[Any]:
    async with sessionmaker() as session:
        return await usage_queries.daily_rows(session)


def _reference(
    rows: list[Any],
    *,
    key_id: uuid.UUID | None = None,
    team_id: uuid.UUID | None = None,
    model: str | None = None,
    since: dt.date | None = None,
    until: dt.date | None = None,
    group_by: str | None = None,
) -> list[UsageTotals]:
    """The report as usage_daily alone answers it."""
    groups: dict[Any, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for row in rows:
        if team_id is not None and row.team_id != team_id:
            continue
        if key_id is not None and row.key_id != key_id:
            continue
        if model is not None and row.model != model:
            continue
        if (since is not None and row.day < since) or (until is not None and row.day > until):
            continue
        group = {
            None: None,
            "day": row.day,
            "model": row.model,
            "key": row.key_id,
            "team": row.team_id,
        }[group_by]
        total = groups[group]
        for i, value in enumerate(
            (row.requests, row.prompt_tokens, row.completion_tokens, row.cost_micros, row.errors)
        ):
            total[i] += value
    if group_by is None:
        return [UsageTotals(*groups[None])]
    # PostgreSQL's order: NULL (no team) last; uuids by their bytes.
    ordered = sorted(groups, key=lambda g: (g is None, g.bytes if isinstance(g, uuid.UUID) else g))
    return [
        UsageTotals(*groups[g], group=g.isoformat() if isinstance(g, dt.date) else str(g))
        for g in ordered
    ]


def _chart(
    rows: list[Any],
    since: dt.date,
    until: dt.date | None,
    team_id: uuid.UUID | None,
    key_id: uuid.UUID | None,
) -> list[tuple[dt.date, str, int, int]]:
    sums: dict[tuple[dt.date, str], list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        if (team_id is not None and row.team_id != team_id) or (
            key_id is not None and row.key_id != key_id
        ):
            continue
        if row.day < since or (until is not None and row.day > until):
            continue
        sums[(row.day, row.model)][0] += row.prompt_tokens + row.completion_tokens
        sums[(row.day, row.model)][1] += row.cost_micros
    return [(day, model, *sums[(day, model)]) for day, model in sorted(sums)]  # type: ignore[misc]


RANGES: list[tuple[dt.date | None, dt.date | None]] = [
    (None, None),
    (dt.date(2026, 4, 10), None),
    (None, dt.date(2026, 5, 20)),
    (dt.date(2026, 4, 1), dt.date(2026, 5, 31)),
    (dt.date(2026, 3, 20), dt.date(2026, 6, 2)),
    (dt.date(2026, 4, 30), dt.date(2026, 4, 30)),
    (dt.date(2026, 4, 2), dt.date(2026, 4, 28)),
    (dt.date(2026, 5, 10), dt.date(2026, 5, 1)),
]


async def _reports_match_usage_daily(sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    rows = await _daily_rows(sessionmaker)
    checked = 0
    async with sessionmaker() as session:
        for key, team, model, (since, until), group_by in itertools.product(
            [None, KEYS[0], KEYS[3]],
            [None, TEAMS[0], TEAMS[1], NO_TEAM],
            [None, "m-a"],
            RANGES,
            [None, "day", "model", "key", "team"],
        ):
            filters: dict[str, Any] = {
                "key_id": key,
                "team_id": team,
                "model": model,
                "since": since,
                "until": until,
            }
            got = await usage_queries.usage_totals(session, **filters, group_by=group_by)
            want = _reference(rows, **filters, group_by=group_by)  # type: ignore[arg-type]
            assert got == want, (filters, group_by)
            checked += 1
        for team in (None, TEAMS[0], TEAMS[1]):
            used = sorted({row.model for row in rows if team is None or row.team_id == team})
            assert await usage_queries.models_used(session, team) == used
            for key, (since, until) in itertools.product([None, KEYS[1]], RANGES):
                chart = await usage_queries.daily_by_model(
                    session, since=since or FIRST, until=until, team_id=team, key_id=key
                )
                assert chart == _chart(rows, since or FIRST, until, team, key)
        assert await usage_queries.models_used(session, NO_TEAM) == []
        for scope, since in itertools.product(
            [{"key_id": KEYS[0]}, {"team_id": TEAMS[0]}, {"team_id": TEAMS[1]}, {}],
            [None, dt.date(2026, 5, 1)],
        ):
            total = _reference(rows, since=since, **scope)[0]
            assert await usage_queries.spent_since(session, since=since, **scope) == (
                total.total_tokens,
                total.cost_micros,
            )
    return checked


async def _fold(sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    async with sessionmaker() as session, session.begin():
        return await fold_usage_rollups(session)


async def _pending(sessionmaker: async_sessionmaker[AsyncSession]) -> int:
    async with sessionmaker() as session:
        return int(
            (await session.execute(text("SELECT count(*) FROM usage_rollup_changes"))).scalar()
        )


async def _derived_match_usage_daily(sessionmaker: async_sessionmaker[AsyncSession]) -> None:
    """Folded, each derived rollup holds exactly usage_daily's groups, none empty, none missing."""
    await _fold(sessionmaker)
    assert await _pending(sessionmaker) == 0
    async with sessionmaker() as session:
        for table, key in DERIVED.items():
            names = ", ".join(name for name, _ in key)
            exprs = ", ".join(expr for _, expr in key)
            positions = ", ".join(str(i + 1) for i in range(len(key)))
            grouped = text(
                f"SELECT {exprs}, sum(requests), sum(prompt_tokens), sum(completion_tokens), "
                f"sum(cost_micros), sum(errors), count(*) FROM usage_daily "
                f"GROUP BY {positions} ORDER BY {positions}"
            )
            stored = text(f"SELECT {names}, {SUMS}, source_rows FROM {table} ORDER BY {positions}")
            want = (await session.execute(grouped, {"none": NO_TEAM})).all()
            got = (await session.execute(stored)).all()
            assert [tuple(r) for r in got] == [tuple(r) for r in want], table


async def test_every_report_from_the_rollups_equals_usage_daily_grouped(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    await _fill(db_sessionmaker)
    rows = await _daily_rows(db_sessionmaker)
    moved = [r for r in rows if r.key_id == KEYS[0] and r.day == dt.date(2026, 4, 30)]
    assert {(r.model, r.team_id) for r in moved} >= {("m-a", TEAMS[1]), ("m-b", TEAMS[0])}
    # Folded rollups with the team moves still pending (some of them taking rows away) ...
    async with db_sessionmaker() as session:
        negative = "SELECT count(*) FROM usage_rollup_changes WHERE source_rows < 0"
        assert (await session.execute(text(negative))).scalar() > 0
    checked = await _reports_match_usage_daily(db_sessionmaker)
    assert checked == 3 * 4 * 2 * len(RANGES) * 5
    # ... and all of it folded: the emptied groups are gone, not rows of zeros.
    await _derived_match_usage_daily(db_sessionmaker)
    await _reports_match_usage_daily(db_sessionmaker)

    # Deletes (an operator's, say) and a truncate reach the derived rollups too.
    async with db_sessionmaker() as session, session.begin():
        await session.execute(
            text("DELETE FROM usage_daily WHERE key_id = :key OR day = :day"),
            {"key": KEYS[2], "day": dt.date(2026, 5, 5)},
        )
    await _reports_match_usage_daily(db_sessionmaker)
    await _derived_match_usage_daily(db_sessionmaker)
    await _reports_match_usage_daily(db_sessionmaker)
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(session, _random_records(random.Random(5), 20))
        await session.execute(text("TRUNCATE usage_daily"))
    async with db_sessionmaker() as session:
        for table in [*DERIVED, "usage_rollup_changes"]:
            assert (await session.execute(text(f"SELECT count(*) FROM {table}"))).scalar() == 0


async def test_flushers_and_folds_at_once_neither_deadlock_nor_lose_counts(
    gateway_settings: Settings,
) -> None:
    """Batches on the same days, keys and models from many sessions at once, folds running
    between and beside them (one at a time: the others skip): every count lands once."""
    engine = create_engine(gateway_settings.database_url, pool_size=24)
    sessionmaker = create_sessionmaker(engine)
    rng = random.Random(11)
    batches = [_random_records(rng, 60) for _ in range(16)]

    async def write(batch: list[dict[str, Any]]) -> int:
        async with sessionmaker() as session, session.begin():
            return await insert_usage(session, batch)

    try:
        results = await asyncio.gather(
            *(write(b) for b in batches), *(_fold(sessionmaker) for _ in range(6))
        )
        assert sum(results[: len(batches)]) == 16 * 60
        async with sessionmaker() as session:
            (total,) = await usage_queries.usage_totals(session)
            by_team = await usage_queries.usage_totals(session, group_by="team")
        assert total.requests == 16 * 60
        assert total.prompt_tokens == sum(r["prompt_tokens"] for b in batches for r in b)
        assert sum(row.requests for row in by_team) == 16 * 60
        await _derived_match_usage_daily(sessionmaker)
    finally:
        await engine.dispose()


async def test_a_fold_moves_at_most_its_limit_and_only_one_folds_at_a_time(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(session, _random_records(random.Random(3), 50))
    pending = await _pending(db_sessionmaker)
    assert pending > 10
    async with db_sessionmaker() as holder, holder.begin():
        assert await fold_usage_rollups(holder, limit=10) == 10
        # Another replica's fold while this one holds the lock: skipped, nothing moved.
        assert await _fold(db_sessionmaker) == 0
    assert await _pending(db_sessionmaker) == pending - 10
    assert await _fold(db_sessionmaker) == pending - 10
    await _derived_match_usage_daily(db_sessionmaker)


async def test_a_teams_last_row_of_a_model_moving_away_takes_the_model_off_its_list(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    old_team, new_team, key = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    noon = dt.datetime(2026, 5, 2, 12, tzinfo=dt.UTC)
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(session, [_record(key, "solo", noon, 5, 5, team=old_team)])
    assert await _fold(db_sessionmaker) == 1
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(session, [_record(key, "solo", noon, 1, 1, team=new_team)])
    for folded in (False, True):
        async with db_sessionmaker() as session:
            assert await usage_queries.models_used(session, old_team) == [], folded
            assert await usage_queries.models_used(session, new_team) == ["solo"], folded
            assert await usage_queries.models_used(session) == ["solo"], folded
            assert await usage_queries.usage_totals(session, group_by="team") == [
                UsageTotals(2, 6, 6, group=str(new_team))
            ], folded
        await _fold(db_sessionmaker)


async def test_the_flusher_folds_what_it_flushed(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    recorder = UsageRecorder(redis_client, gateway_settings)
    key = uuid.uuid4()
    now = time.time()
    for index in range(5):
        await recorder.record(
            UsageEvent(
                request_id=f"fold-{index}",
                key_id=str(key),
                model="m-a",
                prompt_tokens=10,
                completion_tokens=index,
                started_at=now - 1,
                finished_at=now,
            )
        )
    flusher = UsageFlusher(redis_client, db_sessionmaker, gateway_settings)
    await flusher.start()
    try:
        deadline = time.monotonic() + 10
        while True:
            async with db_sessionmaker() as session:
                folded = (
                    await session.execute(text("SELECT sum(requests) FROM usage_daily_totals"))
                ).scalar()
            if folded == 5 and await _pending(db_sessionmaker) == 0:
                break
            assert time.monotonic() < deadline, "the flusher did not fold its batch"
            await asyncio.sleep(0.05)
    finally:
        await flusher.stop()
