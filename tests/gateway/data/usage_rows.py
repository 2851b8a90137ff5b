"""Committed usage rows as the data tests insert them (``sluicegate.gateway.db.usage.insert_usage``)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any


def usage_row(
    key_id: str,
    model: str,
    when: dt.datetime,
    prompt: int,
    completion: int,
    *,
    team_id: str | None = None,
) -> dict[str, Any]:
    """One finished request's row: ``prompt`` and ``completion`` tokens at ``when``."""
    return {
        "request_id": uuid.uuid4().hex,
        "key_id": key_id,
        "team_id": team_id,
        "model": model,
        "deployment": None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "status": "ok",
        "finish_reason": "stop",
        "latency_ms": 1.0,
        "ttft_ms": None,
        "started_at": when,
        "finished_at": when,
    }
