"""PostgreSQL side of the gateway: models, session factory, the queries admin and usage need."""

# The batch tables join the one metadata here, where migrations and tests read it from.
from sluicegate.gateway.db.batch_tables import Batch, BatchFile, BatchLine
from sluicegate.gateway.db.models import ApiKey, UsageDaily, UsageRecord, metadata
from sluicegate.gateway.db.session import create_engine, create_sessionmaker

__all__ = [
    "ApiKey",
    "Batch",
    "BatchFile",
    "BatchLine",
    "UsageDaily",
    "UsageRecord",
    "create_engine",
    "create_sessionmaker",
    "metadata",
]
