"""What admission answers a client: OpenAI's rate-limit headers and the refusals.

Headers (OpenAI's): ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``; ``reset`` is
the time until the window has fully drained (back to the whole limit), e.g. ``1m12s``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sluicegate.gateway.admission.scripts import WINDOW_S
from sluicegate.gateway.errors import QuotaExceeded, RateLimited
from sluicegate.gateway.usage.pricing import from_micros

if TYPE_CHECKING:
    from sluicegate.gateway.admission.keys import ScopeLimits

REJECTION_REASONS = {
    1: "rate_limit_requests",
    2: "rate_limit_tokens",
    3: "concurrency",
    4: "quota",
    6: "budget",
}
"""The admission script's refusal codes, as the rejections metric names them."""


def format_reset(ms: int) -> str:
    """OpenAI's duration style: ``250ms``, ``7.5s``, ``1m12s`` (in integers: every answer
    carries two of these)."""
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    whole, thousandths = divmod(rest, 1000)
    seconds = f"{whole}.{thousandths:03d}".rstrip("0") + "s" if thousandths else f"{whole}s"
    return f"{minutes}m{seconds}" if minutes else seconds


def limit_headers(scopes: list[tuple[str, ScopeLimits]], values: list[Any]) -> dict[str, str]:
    """OpenAI's headers for whichever limited scope has the least left."""
    headers: dict[str, str] = {}
    for name, limit_attr, offset in (("requests", "rpm_limit", 0), ("tokens", "tpm_limit", 2)):
        best: tuple[int, int, int] | None = None
        for index, (_, scope) in enumerate(scopes):
            limit = getattr(scope, limit_attr)
            if limit is None:
                continue
            left, reset = int(values[4 * index + offset]), int(values[4 * index + offset + 1])
            if best is None or left < best[1]:
                best = (int(limit), left, reset)
        if best is not None:
            headers[f"x-ratelimit-limit-{name}"] = str(best[0])
            headers[f"x-ratelimit-remaining-{name}"] = str(best[1])
            headers[f"x-ratelimit-reset-{name}"] = format_reset(best[2])
    return headers


def rejection(
    code: int,
    retry_ms: int,
    tokens: int,
    cost: int,
    kind: str,
    key: ScopeLimits,
    headers: dict[str, str],
) -> Exception:
    retry_s = retry_ms / 1000
    rpm, tpm = key.rpm_limit, key.tpm_limit
    owner = "this key" if kind == "key" else "this key's team"
    period = key.budget_period or "lifetime"
    if code == 4:
        return QuotaExceeded(
            f"This request needs up to {tokens} tokens, more than the remaining token budget "
            f"of {owner} ({key.token_budget} per {period}). "
            "Lower max_tokens or raise the budget.",
            headers=headers,
        )
    if code == 6:
        budget = from_micros(key.max_budget_micros or 0)
        return QuotaExceeded(
            f"This request may cost up to {from_micros(cost):.6f}, more than the remaining "
            f"budget of {owner} ({budget:g} per {period}). "
            "Lower max_tokens or raise the budget.",
            headers=headers,
        )
    if code == 1:
        return RateLimited(
            f"Rate limit reached for requests ({owner}): limit {rpm} per minute. "
            f"Please try again in {retry_s:.3g}s.",
            limit="requests",
            retry_after_s=retry_s,
            headers=headers,
        )
    if code == 2:
        if retry_ms < 0:
            return RateLimited(
                f"Request too large: it needs up to {tokens} tokens, more than the limit of "
                f"{tpm} tokens per minute. Lower max_tokens or shorten the prompt.",
                limit="tokens",
                retry_after_s=WINDOW_S,
                headers=headers,
            )
        return RateLimited(
            f"Rate limit reached for tokens ({owner}): limit {tpm} per minute, this request needs up "
            f"to {tokens}. Please try again in {retry_s:.3g}s.",
            limit="tokens",
            retry_after_s=retry_s,
            headers=headers,
        )
    return RateLimited(
        f"Too many parallel requests: {owner} may run {key.max_parallel_requests} at once.",
        limit="requests",
        retry_after_s=retry_s,
        headers=headers,
    )
