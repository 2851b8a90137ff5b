"""The admin API under ``/admin``: one controller per resource.

The master key may do everything; a team admin key (``role: team_admin``) manages its own
team's keys and LoRA adapters and reads its team's usage, and gets a 403 anywhere else. Every mutation writes an
audit row in its own transaction.
"""

from sluicegate.gateway.api.admin.adapters import AdaptersController
from sluicegate.gateway.api.admin.audit import AuditController
from sluicegate.gateway.api.admin.keys import KeysController
from sluicegate.gateway.api.admin.prices import PricesController
from sluicegate.gateway.api.admin.teams import TeamsController
from sluicegate.gateway.api.admin.usage import UsageController

ADMIN_CONTROLLERS = [
    KeysController,
    TeamsController,
    UsageController,
    AuditController,
    PricesController,
    AdaptersController,
]

__all__ = ["ADMIN_CONTROLLERS"]
