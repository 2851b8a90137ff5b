"""API key records for tests that drive the limiter and lease book without a database."""

from __future__ import annotations

import uuid
from typing import Any

from sluicegate.gateway.keys.records import ApiKeyRecord


def key_record(**fields: Any) -> ApiKeyRecord:
    """A fresh key with no limits but those given."""
    values: dict[str, Any] = {
        "id": str(uuid.uuid4()),
        "name": "k",
        "allowed_models": [],
        "rpm_limit": None,
        "tpm_limit": None,
        "max_parallel_requests": None,
        "token_budget": None,
        "budget_period": None,
        "expires_at": None,
        "revoked": False,
        "metadata": {},
    }
    values.update(fields)
    return ApiKeyRecord(**values)
