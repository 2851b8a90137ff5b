"""``sluicegate keys``: create, list and revoke API keys straight in the database.

The CLI twin of the admin routes, for bootstrapping before any gateway runs. Uses
``SLUICEGATE_DATABASE_URL``; ``revoke`` also publishes the invalidation on
``SLUICEGATE_REDIS_URL`` so running gateways drop the key at once.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import sys
import uuid
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy.exc import SQLAlchemyError

from sluicegate.engine.redis_client import async_client
from sluicegate.gateway.api.admin import service
from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db.audit import Actor
from sluicegate.gateway.db.models import ApiKey
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.keys.cache import publish_invalidation
from sluicegate.gateway.settings import Settings

CLI_ACTOR = Actor(name="cli")
"""Who the audit log names for changes made with ``sluicegate keys``."""


def _models(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluicegate keys", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    create = commands.add_parser("create", help="create a key and print it (shown only once)")
    create.add_argument("--name", required=True)
    create.add_argument("--models", type=_models, default=[], help="comma-separated; default all")
    create.add_argument("--rpm", type=_positive, help="requests per minute")
    create.add_argument("--tpm", type=_positive, help="tokens per minute")
    create.add_argument("--parallel", type=_positive, help="max parallel requests")
    create.add_argument("--budget-tokens", type=_positive, help="token budget per period")
    create.add_argument("--budget-period", choices=["day", "month"], help="default: lifetime")
    create.add_argument("--expires-in-days", type=_positive, help="expire after N days")
    create.add_argument("--json", action="store_true", help="print one JSON object")

    listing = commands.add_parser("list", help="list keys (never their plaintext)")
    listing.add_argument("--active", action="store_true", help="hide revoked keys")
    listing.add_argument("--json", action="store_true", help="print one JSON object per key")

    revoke = commands.add_parser("revoke", help="revoke a key on every gateway replica")
    revoke.add_argument("key_id", type=uuid.UUID)
    return parser


def _summary(row: ApiKey) -> dict[str, Any]:
    return {
        "id": str(row.id),
        "name": row.name,
        "key_prefix": row.key_prefix,
        "allowed_models": list(row.allowed_models),
        "rpm_limit": row.rpm_limit,
        "tpm_limit": row.tpm_limit,
        "max_parallel_requests": row.max_parallel_requests,
        "token_budget": row.token_budget,
        "budget_period": row.budget_period,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "revoked": row.revoked_at is not None,
        "created_at": row.created_at.isoformat(),
    }


async def _create(settings: Settings, args: argparse.Namespace) -> int:
    expires_at = None
    if args.expires_in_days:
        expires_at = dt.datetime.now(dt.UTC) + dt.timedelta(days=args.expires_in_days)
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        async with create_sessionmaker(engine)() as session, session.begin():
            fields = {
                "name": args.name,
                "allowed_models": args.models,
                "rpm_limit": args.rpm,
                "tpm_limit": args.tpm,
                "max_parallel_requests": args.parallel,
                "token_budget": args.budget_tokens,
                "budget_period": args.budget_period,
                "expires_at": expires_at,
            }
            # Through the admin service, so the CLI's changes are in the audit log too.
            row, plaintext = await service.create_key(session, CLI_ACTOR, fields, None, None)
    finally:
        await engine.dispose()
    if args.json:
        print(json.dumps({**_summary(row), "key": plaintext}))
    else:
        print(f"created key {row.id} ({row.name})")
        print("store it now, it is shown only this once:")
        print(plaintext)
    return 0


async def _list(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        async with create_sessionmaker(engine)() as session:
            rows = await key_queries.list_keys(session, include_revoked=not args.active, limit=None)
    finally:
        await engine.dispose()
    for row in rows:
        if args.json:
            print(json.dumps(_summary(row)))
        else:
            state = "revoked" if row.revoked_at else "active"
            models = ",".join(row.allowed_models) or "*"
            print(f"{row.id}  {row.key_prefix}…  {state:<7}  {row.name}  models={models}")
    return 0


async def _revoke(settings: Settings, args: argparse.Namespace) -> int:
    engine = create_engine(settings.database_url, pool_size=1)
    try:
        async with create_sessionmaker(engine)() as session, session.begin():
            row = await key_queries.get_key(session, args.key_id)
            if row is not None:
                row = await service.revoke_key(session, CLI_ACTOR, args.key_id, None)
    finally:
        await engine.dispose()
    if row is None:
        print(f"sluicegate keys: no key with id {args.key_id}", file=sys.stderr)
        return 1
    redis = async_client(settings.redis_url)
    try:
        await publish_invalidation(redis, str(row.id))
    except RedisError as exc:
        print(
            f"warning: revoked, but gateways were not notified ({exc}); "
            f"they drop the key within {settings.key_cache_ttl_s:g}s",
            file=sys.stderr,
        )
    finally:
        await redis.aclose()
    print(f"revoked key {row.id} ({row.name})")
    return 0


_COMMANDS = {"create": _create, "list": _list, "revoke": _revoke}


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    settings = Settings.from_env()
    try:
        return asyncio.run(_COMMANDS[args.command](settings, args))
    except OSError as exc:
        print(f"sluicegate keys: cannot reach the database or Redis: {exc}", file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        print(
            f"sluicegate keys: database error (has `sluicegate migrate` run?): "
            f"{getattr(exc, 'orig', None) or exc}",
            file=sys.stderr,
        )
        return 1
