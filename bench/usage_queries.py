"""The admin API's and the UI's usage queries, and the flusher's batch, at a large deployment's size.

A scratch database, migrated to head, is filled with ``INSERT ... SELECT generate_series``:
``usage_daily`` with one row per day, key and model (1,000 keys x 10 models x 730 days =
7.3M rows by default) and ``usage_records`` with 10M requests. Keys belong to 50 teams of very
different sizes (team 0 holds ~14% of the keys, the smallest a handful) and every 20th key to
none; the records' keys and models are skewed (a few busy keys and models, a long tail) and
their finish times spread evenly over the days, in time order as a flusher writes them.
Indexes and primary keys of the two tables are dropped for the fill and rebuilt after it
(the same definitions: only the fill is faster), then the database is vacuumed, analyzed and
checkpointed. Whatever the schema derives from ``usage_daily`` (its triggers) fills with it.

Then each query runs through the real functions of ``sluicegate.gateway.db.usage_reports``, each run
in a session of its own as an endpoint opens it, the queries taking turns in rounds after a
warm-up round; the figure per query is the median (p50) of ``--runs`` runs, in ms. Last, the
flusher's write: ``insert_usage`` of 500 new records (``--batch``) of the last day in one
transaction, commit included, ``--flush-batches`` times, and where the schema has them the
fold of their rollup changes every ``--batches-per-fold`` batches and a retention batch
(``delete_usage_records_before``). Before the flusher's batches every usage table and index is
read into the OS cache (``pg_prewarm``, where the server has it).

``--baseline-revision 0002`` also fills a second database migrated only that far (the schema
before the derived rollups and the index drop; the fill touches only the two tables every
revision has) and the flusher's batches take turns between the two, the order flipping each
time, so the before/after of the write path is measured in one run on one machine state.

``--keys/--models/--days/--records/--teams`` scale the fill down for a quick run. Progress goes
to stderr; the last line of stdout is one JSON object: ``sizes`` (rows and MB of each usage
table and its indexes), ``queries`` (name -> p50 ms), ``max_ms`` (the slowest run of each),
``flush_batch_ms`` (p50; ``baseline_flush_batch_ms`` beside it), ``fold_ms`` (p50 of a fold of
``--batches-per-fold`` batches' rollup changes) and ``flush_batch_with_fold_ms`` (a batch plus
its share of a fold), ``retention_batch_ms``, ``fill_s``. Environment: ``SLUICEGATE_DATABASE_URL``, a database the bench may create
databases on (default the local ``test`` database).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from sluicegate.gateway.db import usage_reports as usage_queries
from sluicegate.gateway.db.migrate import upgrade
from sluicegate.gateway.db.scratch import execute_autocommit, scratch_database
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.db.usage import insert_usage
from sluicegate.gateway.db.usage_upkeep import delete_usage_records_before, fold_usage_rollups

STARTED = time.monotonic()
FILLED_TABLES = ("usage_daily", "usage_records")

Query = Callable[[AsyncSession], Awaitable[object]]


def log(message: str) -> None:
    print(f"[{time.monotonic() - STARTED:7.1f}s] {message}", file=sys.stderr, flush=True)


# The same key, team and model spreads in both tables and in the flusher's batch: key k is
# md5('key-k') as a uuid; its team is floor(teams * (k / keys)^2) (team 0 the largest), and
# none for every 20th key.
def _key_sql(k: str) -> str:
    return f"md5('key-' || {k})::uuid"


def _team_sql(k: str, keys: int, teams: int) -> str:
    return (
        f"CASE WHEN {k} % 20 = 19 THEN NULL ELSE "
        f"md5('team-' || floor({teams} * power({k}::float8 / {keys}, 2))::int)::uuid END"
    )


def key_id(k: int) -> uuid.UUID:
    return uuid.UUID(hashlib.md5(f"key-{k}".encode()).hexdigest())


def team_id(k: int, keys: int, teams: int) -> uuid.UUID | None:
    if k % 20 == 19:
        return None
    index = int(teams * (k / keys) ** 2)
    return uuid.UUID(hashlib.md5(f"team-{index}".encode()).hexdigest())


async def _indexes(engine: AsyncEngine, table: str) -> tuple[list[str], list[str]]:
    """(statements that drop the table's indexes and key, statements that recreate them)."""
    async with engine.connect() as connection:
        constraints = (
            await connection.execute(
                text(
                    "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
                    "WHERE conrelid = CAST(:t AS regclass) AND contype IN ('p', 'u')"
                ),
                {"t": table},
            )
        ).all()
        indexes = (
            await connection.execute(
                text(
                    "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = :t "
                    "AND indexname NOT IN (SELECT conname FROM pg_constraint "
                    "WHERE conrelid = CAST(:t AS regclass))"
                ),
                {"t": table},
            )
        ).all()
    drop = [f"ALTER TABLE {table} DROP CONSTRAINT {name}" for name, _ in constraints]
    drop += [f"DROP INDEX {name}" for name, _ in indexes]
    create = [f"ALTER TABLE {table} ADD CONSTRAINT {name} {d}" for name, d in constraints]
    create += [definition for _, definition in indexes]
    return drop, create


async def fill(engine: AsyncEngine, args: argparse.Namespace, last_day: dt.date) -> None:
    keys, models, days, teams = args.keys, args.models, args.days, args.teams
    first_day = last_day - dt.timedelta(days=days - 1)
    rebuild: list[str] = []
    for table in FILLED_TABLES:
        drop, create = await _indexes(engine, table)
        rebuild += create
        async with engine.begin() as connection:
            for statement in drop:
                await connection.execute(text(statement))
    async with engine.connect() as connection:
        folds = bool(
            (await connection.execute(text("SELECT to_regclass('usage_rollup_changes')"))).scalar()
        )
    # Busy keys and models make most requests: weights 1/(1 + k/20) and 1/(1 + m).
    chunk_days = max(1, 300_000 // max(1, keys * models))
    day = first_day
    while day <= last_day:
        end = min(last_day, day + dt.timedelta(days=chunk_days - 1))
        async with engine.begin() as connection:
            await connection.execute(text("SET LOCAL synchronous_commit = off"))
            await connection.execute(text("SELECT setseed(0.34)"))
            await connection.execute(
                text(
                    "INSERT INTO usage_daily (day, key_id, model, requests, prompt_tokens, "
                    "completion_tokens, cost_micros, errors, team_id) "
                    "SELECT day, key_id, model, requests, prompt, completion, "
                    "prompt * 2 + completion * 8, floor(requests * random() * 0.04), team_id "
                    "FROM (SELECT d::date AS day, "
                    f"{_key_sql('k')} AS key_id, 'model-' || m AS model, {_team_sql('k', keys, teams)} AS team_id, "
                    "r.requests, r.requests * (200 + floor(random() * 800))::bigint AS prompt, "
                    "r.requests * (20 + floor(random() * 400))::bigint AS completion "
                    "FROM generate_series(CAST(:first AS date), CAST(:last AS date), interval '1 day') AS d, "
                    f"generate_series(0, {keys - 1}) AS k, generate_series(0, {models - 1}) AS m, "
                    "LATERAL (SELECT 1 + floor(random() * 60 / ((1 + k / 20.0) * (1 + m)))::bigint "
                    "AS requests) AS r) AS rows"
                ),
                {"first": day, "last": end},
            )
        if folds:
            # What the flushers would have folded meanwhile (the triggers recorded it).
            async with create_sessionmaker(engine)() as session, session.begin():
                await fold_usage_rollups(session, limit=10**9)
        log(f"usage_daily: {day} .. {end}")
        day = end + dt.timedelta(days=1)
    span_s = days * 86400.0
    start = dt.datetime.combine(first_day, dt.time(), dt.UTC)
    step = 1_000_000
    for low in range(1, args.records + 1, step):
        high = min(args.records, low + step - 1)
        async with engine.begin() as connection:
            await connection.execute(text("SET LOCAL synchronous_commit = off"))
            await connection.execute(text("SELECT setseed(0.43)"))
            await connection.execute(
                text(
                    "INSERT INTO usage_records (request_id, key_id, model, deployment, "
                    "prompt_tokens, completion_tokens, cached_tokens, cost_micros, team_id, "
                    "status, finish_reason, latency_ms, ttft_ms, started_at, finished_at) "
                    "SELECT substr(md5(i::text), 1, 24), "
                    f"{_key_sql('k')}, 'model-' || m, 'openai:model-' || m, prompt, completion, "
                    f"0, prompt * 2 + completion * 8, {_team_sql('k', keys, teams)}, "
                    "CASE WHEN random() < 0.02 THEN 'error' ELSE 'ok' END, 'stop', latency, "
                    "latency / 5, finished - latency * interval '1 millisecond', finished "
                    "FROM (SELECT i, "
                    f"floor({keys} * power(random(), 3))::int AS k, "
                    f"floor({models} * power(random(), 2))::int AS m, "
                    "(200 + floor(random() * 1800))::int AS prompt, "
                    "(10 + floor(random() * 500))::int AS completion, "
                    "100 + random() * 4000 AS latency, "
                    f"CAST(:start AS timestamptz) + i * {span_s / args.records} * interval '1 second' "
                    "AS finished FROM generate_series(CAST(:low AS bigint), CAST(:high AS bigint)) AS i) AS rows"
                ),
                {"start": start, "low": low, "high": high},
            )
        log(f"usage_records: {high:,} of {args.records:,}")
    async with engine.begin() as connection:
        await connection.execute(text("SET LOCAL maintenance_work_mem = '512MB'"))
        for statement in rebuild:
            log(statement)
            await connection.execute(text(statement))


async def prewarm(url: str) -> bool:
    """Reads every usage table and index into the OS cache (pg_prewarm), where it is available:
    whichever database was filled last would otherwise start with more of its pages cached,
    and random index inserts (the flusher's) are worth several times more on cached pages."""
    try:
        await execute_autocommit(
            url,
            "CREATE EXTENSION IF NOT EXISTS pg_prewarm",
            "SELECT pg_prewarm(c.oid, 'read') FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'i') AND c.relname LIKE '%usage%'",
        )
    except Exception as exc:  # no contrib modules on this server: cold and warm pages mix
        log(f"no pg_prewarm ({type(exc).__name__}); the flusher's figures depend on the cache")
        return False
    return True


async def sizes(engine: AsyncEngine) -> dict[str, dict[str, float]]:
    async with engine.connect() as connection:
        rows = (
            await connection.execute(
                text(
                    "SELECT c.relname, c.reltuples, pg_relation_size(c.oid), "
                    "pg_indexes_size(c.oid) FROM pg_class c "
                    "JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE n.nspname = 'public' AND c.relkind = 'r' "
                    "AND c.relname LIKE 'usage%' ORDER BY c.relname"
                )
            )
        ).all()
    mb = 1024 * 1024
    return {
        name: {
            "rows": int(rows_),
            "table_mb": round(table / mb, 1),
            "indexes_mb": round(idx / mb, 1),
        }
        for name, rows_, table, idx in rows
    }


def queries(args: argparse.Namespace, last_day: dt.date) -> dict[str, Query]:
    """Each admin and UI usage query, in the forms the endpoints send them."""
    q = usage_queries
    month_ago = last_day - dt.timedelta(days=29)
    year_ago = last_day - dt.timedelta(days=365)
    key = key_id(0)
    team = team_id(0, args.keys, args.teams)
    model = "model-0"
    month_start = last_day.replace(day=1)
    page = {"since": month_ago, "until": last_day}

    def totals(**filters: Any) -> Query:
        return lambda session: q.usage_totals(session, **filters)

    return {
        # /admin/usage (master): all time, the last 30 days, each grouping.
        "admin_all_time": totals(),
        "admin_last_30_days": totals(since=month_ago),
        "admin_group_day": totals(group_by="day"),
        "admin_group_model": totals(group_by="model"),
        "admin_group_key": totals(group_by="key"),
        "admin_group_team": totals(group_by="team"),
        "admin_group_key_30_days": totals(since=month_ago, group_by="key"),
        "admin_group_team_30_days": totals(since=month_ago, group_by="team"),
        "admin_model_group_day": totals(model=model, group_by="day"),
        "admin_model_group_key": totals(model=model, group_by="key"),
        "admin_model_group_team": totals(model=model, group_by="team"),
        "admin_model_group_key_30_days": totals(model=model, since=month_ago, group_by="key"),
        # /admin/teams/{id}/usage and a team admin's /admin/usage (the largest team).
        "team_all_time": totals(team_id=team),
        "team_group_day": totals(team_id=team, group_by="day"),
        "team_group_model": totals(team_id=team, group_by="model"),
        "team_group_key": totals(team_id=team, group_by="key"),
        "team_model_group_key": totals(team_id=team, model=model, group_by="key"),
        # /admin/keys/{id}/usage.
        "key_all_time": totals(key_id=key),
        "key_group_model": totals(key_id=key, group_by="model"),
        "key_group_day": totals(key_id=key, group_by="day"),
        # /ui/usage, default 30 days: total, by day, by model, the chart, the model filter's
        # options; as the master and as the largest team's admin; and at the longest range.
        "ui_total": totals(**page),
        "ui_by_day": totals(**page, group_by="day"),
        "ui_by_model": totals(**page, group_by="model"),
        "ui_chart": lambda session: q.daily_by_model(session, **page),
        "ui_models_used": lambda session: q.models_used(session),
        "ui_team_total": totals(**page, team_id=team),
        "ui_team_by_day": totals(**page, team_id=team, group_by="day"),
        "ui_team_by_model": totals(**page, team_id=team, group_by="model"),
        "ui_team_chart": lambda session: q.daily_by_model(session, **page, team_id=team),
        "ui_team_models_used": lambda session: q.models_used(session, team),
        "ui_366_days_by_day": totals(since=year_ago, until=last_day, group_by="day"),
        "ui_366_days_chart": lambda session: q.daily_by_model(
            session, since=year_ago, until=last_day
        ),
        # /ui/usage.csv: one key's month; the largest team's and everyone's are exports of
        # 42k and 300k rows at the default size, timed for what they are.
        "ui_key_csv": lambda session: q.daily_rows(session, **page, key_id=key),
        "export_team_csv": lambda session: q.daily_rows(session, **page, team_id=team),
        "export_all_csv": lambda session: q.daily_rows(session, **page),
        # /ui overview (today) and budget re-seeding (a month, a lifetime).
        "ui_today": totals(since=last_day, until=last_day),
        "budget_key_month": lambda session: q.spent_since(session, key_id=key, since=month_start),
        "budget_team_month": lambda session: q.spent_since(
            session, team_id=team, since=month_start
        ),
        "budget_team_lifetime": lambda session: q.spent_since(session, team_id=team, since=None),
    }


def flush_rows(args: argparse.Namespace, day: dt.date, batch: int) -> list[dict[str, Any]]:
    import random

    now = dt.datetime.combine(day, dt.time(12), dt.UTC)
    rows = []
    for _ in range(batch):
        k = int(args.keys * random.random() ** 3)
        m = int(args.models * random.random() ** 2)
        finished = now + dt.timedelta(seconds=random.random() * 3600)
        rows.append(
            {
                "request_id": os.urandom(12).hex(),
                "key_id": key_id(k),
                "team_id": team_id(k, args.keys, args.teams),
                "model": f"model-{m}",
                "deployment": f"openai:model-{m}",
                "prompt_tokens": random.randint(200, 2000),
                "completion_tokens": random.randint(10, 500),
                "cost_micros": random.randint(0, 10_000),
                "status": "ok",
                "finish_reason": "stop",
                "latency_ms": 900.0,
                "ttft_ms": 120.0,
                "started_at": finished - dt.timedelta(milliseconds=900),
                "finished_at": finished,
            }
        )
    return rows


async def timed(
    sessionmaker: async_sessionmaker[AsyncSession], named: dict[str, Query], runs: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in named}
    for round_ in range(runs + 1):
        for name, query in named.items():
            began = time.perf_counter()
            async with sessionmaker() as session:
                await query(session)
            if round_:  # round 0 warms the caches and the prepared statements
                times[name].append((time.perf_counter() - began) * 1000)
        log(f"round {round_} of {runs}")
    return times


async def flush_batch(
    sessionmaker: async_sessionmaker[AsyncSession], rows: list[dict[str, Any]]
) -> float:
    began = time.perf_counter()
    async with sessionmaker() as session, session.begin():
        await insert_usage(session, rows)
    return (time.perf_counter() - began) * 1000


async def measure(url: str, baseline_url: str | None, args: argparse.Namespace) -> dict[str, Any]:
    last_day = dt.datetime.now(dt.UTC).date()
    engine = create_engine(url)
    sessionmaker = create_sessionmaker(engine)
    baseline = create_engine(baseline_url) if baseline_url else None
    result: dict[str, Any] = {
        "keys": args.keys,
        "models": args.models,
        "days": args.days,
        "records": args.records,
        "teams": args.teams,
    }
    try:
        began = time.monotonic()
        await fill(engine, args, last_day)
        await execute_autocommit(url, "VACUUM (ANALYZE)")
        result["fill_s"] = round(time.monotonic() - began, 1)
        if baseline is not None and baseline_url is not None:
            log(f"the baseline database, at revision {args.baseline_revision}")
            await fill(baseline, args, last_day)
            await execute_autocommit(baseline_url, "VACUUM (ANALYZE)")
        result["prewarmed"] = await prewarm(url) and (
            baseline_url is None or await prewarm(baseline_url)
        )
        await execute_autocommit(url, "CHECKPOINT")
        result["sizes"] = await sizes(engine)
        log(f"filled in {result['fill_s']} s: {json.dumps(result['sizes'])}")
        times = await timed(sessionmaker, queries(args, last_day), args.runs)
        result["queries"] = {name: round(statistics.median(t), 2) for name, t in times.items()}
        result["max_ms"] = {name: round(max(t), 2) for name, t in times.items()}
        for name, p50 in result["queries"].items():
            log(f"{name:30s} p50 {p50:9.2f} ms")
        # With a baseline, the two databases take turns batch by batch (the order flipping
        # each time), so that the machine's drift touches both alike.
        sides = {"ours": sessionmaker}
        if baseline is not None:
            sides["baseline"] = create_sessionmaker(baseline)
        flushes: dict[str, list[float]] = {side: [] for side in sides}
        folds: list[float] = []
        for index in range(args.flush_batches):
            order = list(sides) if index % 2 == 0 else list(reversed(sides))
            for side in order:
                rows = flush_rows(args, last_day, args.batch)
                flushes[side].append(await flush_batch(sides[side], rows))
                if side == "ours" and index % args.batches_per_fold == 0:
                    # The flushers' fold, of this many batches' changes (FOLD_INTERVAL_S).
                    began_fold = time.perf_counter()
                    async with sessionmaker() as session, session.begin():
                        await fold_usage_rollups(session)
                    if index:
                        folds.append((time.perf_counter() - began_fold) * 1000)
        result["flush_batch_ms"] = round(statistics.median(flushes["ours"]), 2)
        result["flush_batch_max_ms"] = round(max(flushes["ours"]), 2)
        log(f"flusher batch of {args.batch}: p50 {result['flush_batch_ms']} ms")
        if folds:
            result["fold_ms"] = round(statistics.median(folds), 2)
            result["batches_per_fold"] = args.batches_per_fold
            result["flush_batch_with_fold_ms"] = round(
                result["flush_batch_ms"] + result["fold_ms"] / args.batches_per_fold, 2
            )
            log(
                f"fold of {args.batches_per_fold} batches: p50 {result['fold_ms']} ms; "
                f"a batch and its share: {result['flush_batch_with_fold_ms']} ms"
            )
        if baseline is not None:
            result["baseline_revision"] = args.baseline_revision
            result["baseline_flush_batch_ms"] = round(statistics.median(flushes["baseline"]), 2)
            log(f"baseline flusher batch: p50 {result['baseline_flush_batch_ms']} ms")
        cutoff = dt.datetime.combine(
            last_day - dt.timedelta(days=args.days // 2), dt.time(), dt.UTC
        )
        deletes = []
        for _ in range(5):
            began_delete = time.perf_counter()
            async with sessionmaker() as session, session.begin():
                await delete_usage_records_before(session, cutoff, args.retention_batch)
            deletes.append((time.perf_counter() - began_delete) * 1000)
        result["retention_batch_ms"] = round(statistics.median(deletes), 2)
        log(f"retention batch of {args.retention_batch}: {result['retention_batch_ms']} ms")
    finally:
        await engine.dispose()
        if baseline is not None:
            await baseline.dispose()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--models", type=int, default=10)
    parser.add_argument("--days", type=int, default=730)
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--teams", type=int, default=50)
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each query")
    parser.add_argument("--batch", type=int, default=500, help="records in a flusher batch")
    parser.add_argument("--flush-batches", type=int, default=20)
    parser.add_argument(
        "--batches-per-fold",
        type=int,
        default=2,
        help="batches between folds: a second's worth at 1,000 requests/s (500-record batches)",
    )
    parser.add_argument("--retention-batch", type=int, default=5000)
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "SLUICEGATE_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
        ),
        help="a database this bench may create (and drop) databases on",
    )
    parser.add_argument(
        "--baseline-revision",
        help="also fill a database migrated only to this revision (0002: before the derived "
        "rollups and the index drop) and alternate the flusher's batches between the two",
    )
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(scratch_database(args.database_url, prefix="sg_bench_usage"))
        log(f"scratch database {url.rsplit('/', 1)[-1]}")
        baseline_url = None
        if args.baseline_revision:
            baseline_url = stack.enter_context(
                scratch_database(args.database_url, prefix="sg_bench_usage_base", migrate=False)
            )
            upgrade(baseline_url, args.baseline_revision)
        result = asyncio.run(measure(url, baseline_url, args))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
