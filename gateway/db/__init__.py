"""PostgreSQL side of the gateway: models, session factory, the queries admin and usage need."""

from gateway.db.models import ApiKey, UsageDaily, UsageRecord, metadata
from gateway.db.session import create_engine, create_sessionmaker

__all__ = [
    "ApiKey",
    "UsageDaily",
    "UsageRecord",
    "create_engine",
    "create_sessionmaker",
    "metadata",
]
