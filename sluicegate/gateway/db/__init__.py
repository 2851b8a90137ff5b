"""PostgreSQL side of the gateway: models, session factory, the queries admin and usage need."""

from sluicegate.gateway.db.models import ApiKey, UsageDaily, UsageRecord, metadata
from sluicegate.gateway.db.session import create_engine, create_sessionmaker

__all__ = [
    "ApiKey",
    "UsageDaily",
    "UsageRecord",
    "create_engine",
    "create_sessionmaker",
    "metadata",
]
