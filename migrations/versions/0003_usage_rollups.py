"""Coarser usage rollups derived from usage_daily; usage_records loses the indexes no query read.

At 1,000 keys x 10 models x 730 days (7.3M usage_daily rows) every report over all keys summed
millions of usage_daily rows (0.1-3.3 s on a 2-core VM). Five rollups derived from usage_daily
answer them from thousands: per (day, team, key), (team, model, day), (model, day),
(model, month, team, key) and (month, team, key). Each one plus the changes not yet added to
it (usage_rollup_changes) is exactly usage_daily grouped by its key (team NULL stored as the
nil uuid): statement triggers on usage_daily append what each statement changed (new rows
minus old rows, from its transition tables) in the statement's own transaction, and the
flushers fold those changes into the rollups in the background (fold_usage_rollups). So a key
moving teams mid-day moves its row's totals just as usage_daily's ``team_id`` moves. The
upgrade fills the rollups from usage_daily, with usage_daily locked against writes meanwhile
(the flushers retry; no usage is lost).

usage_records: (key_id, finished_at), (model, finished_at) and (team_id, finished_at) were read
by no query; (finished_at) stays for retention's oldest-first deletes. usage_daily's primary
key becomes (day, model, key_id), so that one model's rows of a day are one range of it (the
days at the edges of a by-key report of one model read it so).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_TEAM = "coalesce(team_id, '00000000-0000-0000-0000-000000000000'::uuid)"
_MONTH = "date_trunc('month', day)::date"
_MEASURES = ("requests", "prompt_tokens", "completion_tokens", "cost_micros", "errors")

# table -> its key columns (primary key order) with the usage_daily expression of each, and
# its secondary indexes. Frozen here as the revision created them; the models mirror them.
_Key = tuple[tuple[str, str], ...]
_Indexes = tuple[tuple[str, tuple[str, ...]], ...]
_ROLLUPS: dict[str, tuple[_Key, _Indexes]] = {
    "usage_daily_keys": (
        (("day", "day"), ("team_id", _TEAM), ("key_id", "key_id")),
        (("ix_usage_daily_keys_team_day", ("team_id", "day")),),
    ),
    "usage_daily_models": (
        (("team_id", _TEAM), ("model", "model"), ("day", "day")),
        (("ix_usage_daily_models_model_day", ("model", "day")),),
    ),
    "usage_daily_totals": ((("model", "model"), ("day", "day")), ()),
    # Read only by model: the key starts with it, and includes the sums (index-only reads).
    "usage_monthly": (
        (("model", "model"), ("month", _MONTH), ("team_id", _TEAM), ("key_id", "key_id")),
        (),
    ),
    "usage_monthly_keys": (
        (("month", _MONTH), ("team_id", _TEAM), ("key_id", "key_id")),
        (("ix_usage_monthly_keys_team_month", ("team_id", "month")),),
    ),
}
_COVERED = {"usage_monthly"}
_TYPES = {"day": sa.Date, "month": sa.Date, "team_id": sa.Uuid, "key_id": sa.Uuid, "model": sa.Text}
_DROPPED_RECORD_INDEXES = {
    "ix_usage_records_key_finished": ["key_id", "finished_at"],
    "ix_usage_records_model_finished": ["model", "finished_at"],
    "ix_usage_records_team_finished": ["team_id", "finished_at"],
}


def _add(table: str, change: str, *, skip_unchanged: bool) -> str:
    """Adds ``change`` (usage_daily rows with a ``sign`` column: +1 new, -1 old) to a rollup."""
    keys = _ROLLUPS[table][0]
    names = [name for name, _ in keys]
    positions = ", ".join(str(i + 1) for i in range(len(keys)))
    sums = ", ".join(f"sum(sign * {m})" for m in _MEASURES)
    # An UPDATE that left a group's totals as they were writes nothing to that group.
    having = (
        " HAVING " + " OR ".join(f"sum(sign * {m}) <> 0" for m in (*_MEASURES, "1"))
        if skip_unchanged
        else ""
    )
    columns = ", ".join((*names, *_MEASURES, "source_rows"))
    added = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in (*_MEASURES, "source_rows"))
    return (
        f"INSERT INTO {table} ({columns}) "
        f"SELECT {', '.join(expr for _, expr in keys)}, {sums}, sum(sign) FROM ({change}) AS change "
        f"GROUP BY {positions}{having} ORDER BY {positions} "
        f"ON CONFLICT ({', '.join(names)}) DO UPDATE SET {added};"
    )


_COLUMNS = "day, key_id, model, team_id, " + ", ".join(_MEASURES)
_CHANGES_COLUMNS = f"{_COLUMNS}, source_rows"
# What each statement on usage_daily changed, at usage_daily's own grain: the new rows minus
# the old ones (an update that moved a row to another team is -old for the old team and +new
# for the new). Appending it costs the flusher's transaction one insert of about its own rows;
# sluicegate.gateway.db.usage_upkeep.fold_usage_rollups adds the changes to the rollups later, many
# batches at once, and until then every report reads them beside the rollups.
_APPEND = (
    f"INSERT INTO usage_rollup_changes ({_CHANGES_COLUMNS}) "
    "SELECT day, key_id, model, team_id, "
    + ", ".join(f"sum(sign * {m})" for m in _MEASURES)
    + ", sum(sign) FROM ({rows}) AS change GROUP BY day, key_id, model, team_id "
    "HAVING " + " OR ".join(f"sum(sign * {m}) <> 0" for m in (*_MEASURES, "1")) + ";"
)
_NEW = f"SELECT {_COLUMNS}, 1 AS sign FROM new_rows"
_OLD = f"SELECT {_COLUMNS}, -1 AS sign FROM old_rows"


def _function(name: str, body: str) -> str:
    return (
        f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$\n"
        f"BEGIN\n    {body}\n    RETURN NULL;\nEND\n$$"
    )


def _functions() -> dict[str, str]:
    everything = ", ".join([*_ROLLUPS, "usage_rollup_changes"])
    return {
        "usage_rollups_insert": _function(
            "usage_rollups_insert", _APPEND.format(rows=_NEW)
        ),
        "usage_rollups_update": _function(
            "usage_rollups_update", _APPEND.format(rows=f"{_NEW} UNION ALL {_OLD}")
        ),
        "usage_rollups_delete": _function(
            "usage_rollups_delete", _APPEND.format(rows=_OLD)
        ),
        "usage_rollups_truncate": _function("usage_rollups_truncate", f"TRUNCATE {everything};"),
    }


_TRIGGERS = {
    "usage_rollups_insert": "AFTER INSERT ON usage_daily REFERENCING NEW TABLE AS new_rows "
    "FOR EACH STATEMENT",
    "usage_rollups_update": "AFTER UPDATE ON usage_daily REFERENCING OLD TABLE AS old_rows "
    "NEW TABLE AS new_rows FOR EACH STATEMENT",
    "usage_rollups_delete": "AFTER DELETE ON usage_daily REFERENCING OLD TABLE AS old_rows "
    "FOR EACH STATEMENT",
    "usage_rollups_truncate": "AFTER TRUNCATE ON usage_daily FOR EACH STATEMENT",
}


def upgrade() -> None:
    # No flusher writes usage_daily between the fill below and the triggers taking over.
    op.execute("LOCK TABLE usage_daily IN SHARE ROW EXCLUSIVE MODE")
    for name in _DROPPED_RECORD_INDEXES:
        op.drop_index(name, table_name="usage_records")
    # (day, model, key_id): a model's rows of a day become one range of the key.
    op.drop_constraint("pk_usage_daily", "usage_daily", type_="primary")
    op.create_primary_key("pk_usage_daily", "usage_daily", ["day", "model", "key_id"])
    for table, (keys, indexes) in _ROLLUPS.items():
        op.create_table(
            table,
            *(sa.Column(name, _TYPES[name](), nullable=False) for name, _ in keys),
            *(sa.Column(m, sa.BigInteger(), nullable=False) for m in _MEASURES),
            sa.Column("source_rows", sa.BigInteger(), nullable=False),
            sa.PrimaryKeyConstraint(
                *(name for name, _ in keys),
                name=f"pk_{table}",
                postgresql_include=[*_MEASURES, "source_rows"] if table in _COVERED else [],
            ),
        )
        if table not in _COVERED:
            # Today's and this month's rows are rewritten by every flush: free room on their
            # pages keeps those updates HOT (no index writes). A covering key makes every
            # update write the index anyway, so usage_monthly is left dense.
            op.execute(f"ALTER TABLE {table} SET (fillfactor = 50)")
        for index, columns in indexes:
            op.create_index(index, table, list(columns))
        op.execute(
            _add(table, f"SELECT {_COLUMNS}, 1 AS sign FROM usage_daily", skip_unchanged=False)
        )
        op.execute(f"ANALYZE {table}")
    op.create_table(
        "usage_rollup_changes",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=True),
        *(sa.Column(m, sa.BigInteger(), nullable=False) for m in _MEASURES),
        sa.Column("source_rows", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_usage_rollup_changes"),
    )
    for name, sql in _functions().items():
        op.execute(sql)
        op.execute(f"CREATE TRIGGER {name} {_TRIGGERS[name]} EXECUTE FUNCTION {name}()")


def downgrade() -> None:
    for name in _TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON usage_daily")
        op.execute(f"DROP FUNCTION {name}()")
    op.drop_table("usage_rollup_changes")
    for table in _ROLLUPS:
        op.drop_table(table)
    op.drop_constraint("pk_usage_daily", "usage_daily", type_="primary")
    op.create_primary_key("pk_usage_daily", "usage_daily", ["day", "key_id", "model"])
    for name, columns in _DROPPED_RECORD_INDEXES.items():
        op.create_index(name, "usage_records", columns)
