"""A key's ``ADMIT_LUA`` call, the parts of it that hold for one window (``Booking``): every
counter's name (the window's and the budget period's), the limits, and what settling needs of
them, built once a window per key rather than per request (``limits.RateLimiter`` keeps them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from sluicegate.gateway.admission.keys import KeyLimits, ScopeLimits, budget_keys, scope_tag
from sluicegate.gateway.admission.scripts import WINDOW_S

UNLIMITED = -1


def limit_arg(value: int | None) -> int:
    return UNLIMITED if value is None else int(value)


def key_scopes(key: KeyLimits) -> list[tuple[str, ScopeLimits]]:
    return [("key", key)] + ([("team", key.team)] if key.team is not None else [])


MAX_BOOKINGS = 100_000
"""Keys whose admission call is kept at most; past that the cache starts afresh."""


@dataclass(slots=True)
class Booking:
    """The parts of a key's ADMIT_LUA call that hold for one window (``WINDOW_S``): every
    counter's name (the window's and the budget period's), the limits, and what settling
    needs of them. Built per request, they cost a tenth of the admission's own CPU."""

    record: KeyLimits
    window: int
    scopes: list[tuple[str, ScopeLimits]]
    keys: list[str]
    limits: list[Any]
    settle_keys: list[str]
    held_prefix: str
    epoch_key: str
    team_id: str | None
    booked: str

    @classmethod
    def of(cls, key: KeyLimits, window: int, now: float) -> Booking:
        scopes = key_scopes(key)
        team_id = key.team.id if key.team is not None else None
        keys: list[str] = []
        limits: list[Any] = [len(scopes)]
        settle_keys: list[str] = []
        for kind, scope in scopes:
            tag = scope_tag(kind, scope.id, team_id)
            tokens_key, money_key, budget_ttl = budget_keys(kind, scope, team_id, now)
            slots = f"{tag}:slots"
            tokens_now = f"{tag}:t:{window}"
            keys += [
                f"{tag}:r:{window}",
                f"{tag}:r:{window - 1}",
                tokens_now,
                f"{tag}:t:{window - 1}",
                slots,
                tokens_key,
                money_key,
            ]
            limits += [
                limit_arg(scope.rpm_limit),
                limit_arg(scope.tpm_limit),
                limit_arg(scope.max_parallel_requests),
                limit_arg(scope.token_budget),
                limit_arg(scope.max_budget_micros),
                budget_ttl,
            ]
            settle_keys += [tokens_now, tokens_key, money_key, slots]
        tag = scope_tag("key", key.id, team_id)
        return cls(
            key,
            window,
            scopes,
            keys,
            limits,
            settle_keys,
            f"{tag}:held:",
            f"{tag}:epoch",
            team_id,
            booked_flags(scopes),
        )

    def call(
        self, request_id: str, tokens: int, cost: int, now: float, slot_ttl: str
    ) -> tuple[list[str], list[Any]]:
        """ADMIT_LUA's keys and args for one request (``now`` within this booking's window)."""
        window_start = self.window * WINDOW_S
        args = [repr(now), window_start, WINDOW_S, tokens, cost, request_id, slot_ttl]
        args += self.limits
        args.append(os.urandom(6).hex())
        return [*self.keys, self.held_prefix + request_id, self.epoch_key], args


def booked_flags(scopes: list[tuple[str, ScopeLimits]]) -> str:
    """``Admission.booked`` for these scopes (as the admission script books them)."""
    return "".join(
        "".join(
            "1" if limit is not None else "0"
            for limit in (scope.tpm_limit, scope.token_budget, scope.max_budget_micros)
        )
        for _, scope in scopes
    )
