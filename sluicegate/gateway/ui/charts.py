"""Charts drawn on the server as inline SVG: no script, no network, readable without colour
(every bar and point has a text title, and the page shows the numbers in a table too)."""

from __future__ import annotations

import datetime as dt
import html
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup

PALETTE = ("#2563eb", "#16a34a", "#d97706", "#9333ea", "#dc2626", "#0891b2", "#4d7c0f", "#be185d")
OTHER_COLOUR = "#94a3b8"
MAX_SERIES = len(PALETTE)
WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 64, 32, 36


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    colour: str


def compact(value: float) -> str:
    """1234 -> 1.2k, 3_400_000 -> 3.4M."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}" if value else "0"


def money(micros: int, currency: str) -> str:
    """Cents for sums of a unit or more; four decimals below, where LLM spend often is."""
    amount = micros / 1e6
    if amount == 0:
        return f"0.00 {currency}"
    if abs(amount) < 0.0001:
        return f"{amount:.6f} {currency}"
    if abs(amount) < 1:
        return f"{amount:.4f} {currency}"
    return f"{amount:,.2f} {currency}"


def _nice_ceiling(value: float) -> float:
    """The smallest 1, 2, 4, 6 or 8 times a power of ten that is at least ``value`` (each
    divides into four round ticks)."""
    if value <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 4, 6, 8, 10):
        if value <= step * magnitude:
            return step * magnitude
    return 10 * magnitude


def series_of(models: Sequence[str]) -> list[Series]:
    """The biggest models get their own colour; the rest are drawn together as "other"."""
    named = [Series(name, PALETTE[i]) for i, name in enumerate(models[: MAX_SERIES - 1])]
    if len(models) > MAX_SERIES - 1:
        named.append(Series("other", OTHER_COLOUR))
    return named


def daily_chart(
    rows: Sequence[tuple[dt.date, str, int, int]],
    since: dt.date,
    until: dt.date,
    currency: str,
) -> tuple[Markup, list[Series]]:
    """Stacked bars of tokens per day and model, with the day's spend as a line on the right
    axis. Returns the SVG and its legend."""
    days = [since + dt.timedelta(days=i) for i in range((until - since).days + 1)]
    by_model: dict[str, int] = defaultdict(int)
    for _, model, tokens, _ in rows:
        by_model[model] += tokens
    ranked = sorted(by_model, key=lambda name: (-by_model[name], name))
    legend = series_of(ranked)
    colour = {s.name: s.colour for s in legend}
    tokens: dict[dt.date, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    spend: dict[dt.date, int] = defaultdict(int)
    for day, model, count, cost in rows:
        tokens[day][model if model in colour else "other"] += count
        spend[day] += cost
    top_tokens = _nice_ceiling(max((sum(tokens[d].values()) for d in days), default=0))
    top_spend = _nice_ceiling(max((spend[d] for d in days), default=0) / 1e6)

    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / max(len(days), 1)
    bar_w = max(2.0, slot * 0.7)
    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="Daily tokens by model (bars) and spend in {html.escape(currency)} (line)" '
        'xmlns="http://www.w3.org/2000/svg">'
    ]
    for i in range(5):
        y = TOP + plot_h * i / 4
        parts.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
            f'<text x="{LEFT - 8}" y="{y + 4:.1f}" class="axis" text-anchor="end">'
            f"{compact(top_tokens * (4 - i) / 4)}</text>"
            f'<text x="{WIDTH - RIGHT + 8}" y="{y + 4:.1f}" class="axis spend-axis">'
            f"{compact(top_spend * (4 - i) / 4)}</text>"
        )
    label_every = max(1, len(days) // 8)
    points = []
    for index, day in enumerate(days):
        x = LEFT + slot * index + (slot - bar_w) / 2
        base = TOP + plot_h
        for series in legend:
            value = tokens[day].get(series.name, 0)
            if not value:
                continue
            h = plot_h * value / top_tokens
            base -= h
            parts.append(
                f'<rect x="{x:.1f}" y="{base:.1f}" width="{bar_w:.1f}" height="{h:.1f}" '
                f'fill="{series.colour}"><title>{day.isoformat()} · '
                f"{html.escape(series.name)}: {value:,} tokens</title></rect>"
            )
        if index % label_every == 0 or index == len(days) - 1:
            parts.append(
                f'<text x="{x + bar_w / 2:.1f}" y="{HEIGHT - 12}" class="axis" '
                f'text-anchor="middle">{day.strftime("%b %d")}</text>'
            )
        cx = LEFT + slot * index + slot / 2
        cy = TOP + plot_h - plot_h * (spend[day] / 1e6) / top_spend
        points.append((cx, cy, day))
    if points:
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
        # A white halo keeps the line readable where it crosses bars of any colour.
        parts.append(f'<polyline points="{path}" class="spend-halo"/>')
        parts.append(f'<polyline points="{path}" class="spend-line"/>')
        for x, y, day in points:
            if spend[day]:
                parts.append(
                    f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" class="spend-dot">'
                    f"<title>{day.isoformat()} · spend {money(spend[day], currency)}</title>"
                    "</circle>"
                )
    parts.append(
        f'<text x="{LEFT - 8}" y="14" class="axis-title" text-anchor="end">tokens</text>'
        f'<text x="{WIDTH - RIGHT + 8}" y="14" class="axis-title">'
        f"{html.escape(currency)}</text></svg>"
    )
    return Markup("".join(parts)), legend
