"""Prices per model and the cost of a request, in exact integer micro-units.

A price is micro-units of the currency per million tokens (``input: 2.0`` USD per million is
2_000_000). A request costs ``(uncached_prompt * input + cached * cached_input + completion *
output) / 1e6`` micro-units, rounded half up once, so a usage record's cost, the budget counter
settled with it and any sum of records agree to the micro-unit.

Prices come from the routing YAML (``price: {input, cached_input, output, currency}`` on a
model, in force from the start of time) and from ``model_prices`` rows (admin API), each in
force from its ``effective_from``; the newest row already in force wins over the YAML. A LoRA
adapter's name with neither is priced by the adapter registry: the adapter's own price, else
its base model's. Past usage keeps the cost it was given at settle: a new price never rewrites
it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Protocol

import yaml
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.models import ModelPrice

logger = logging.getLogger(__name__)

MICROS = 1_000_000
REFRESH_S = 5.0
"""How long a replica trusts its price table before reading ``model_prices`` again."""


def to_micros(amount: float | int | str | Decimal) -> int:
    """Currency amount -> integer micro-units (half up); a ValueError for non-numbers."""
    try:
        value = Decimal(str(amount))
    except InvalidOperation as exc:
        raise ValueError(f"not an amount: {amount!r}") from exc
    if not value.is_finite() or value < 0:
        raise ValueError(f"an amount must be a finite number >= 0: {amount!r}")
    return int((value * MICROS).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def from_micros(micros: int) -> float:
    return micros / MICROS


@dataclass(frozen=True, slots=True)
class Price:
    input_micros: int
    cached_input_micros: int
    output_micros: int
    currency: str

    def cost_micros(
        self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
    ) -> int:
        cached = min(max(cached_tokens, 0), prompt_tokens)
        scaled = (
            (prompt_tokens - cached) * self.input_micros
            + cached * self.cached_input_micros
            + completion_tokens * self.output_micros
        )
        return (scaled + MICROS // 2) // MICROS

    def worst_case_micros(self, prompt_tokens: int, max_completion_tokens: int) -> int:
        """An upper bound for any real outcome: every prompt token uncached, at the dearer rate."""
        dearest_prompt = max(self.input_micros, self.cached_input_micros)
        scaled = prompt_tokens * dearest_prompt + max_completion_tokens * self.output_micros
        return (scaled + MICROS // 2) // MICROS

    def as_dict(self) -> dict[str, Any]:
        return {
            "input": from_micros(self.input_micros),
            "cached_input": from_micros(self.cached_input_micros),
            "output": from_micros(self.output_micros),
            "currency": self.currency,
        }


def price_from_spec(spec: Any, currency: str, where: str) -> Price:
    """A ``price:`` mapping of the routing YAML; ValueError naming what is wrong."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: price must be a mapping with input and output")
    unknown = set(spec) - {"input", "cached_input", "output", "currency"}
    if unknown:
        raise ValueError(f"{where}: unknown price fields {sorted(unknown)}")
    if "input" not in spec or "output" not in spec:
        raise ValueError(f"{where}: price needs input and output (per million tokens)")
    spec_currency = str(spec.get("currency", currency)).upper()
    if spec_currency != currency:
        raise ValueError(
            f"{where}: price currency {spec_currency} differs from the gateway's {currency}"
        )
    input_micros = to_micros(spec["input"])
    return Price(
        input_micros=input_micros,
        cached_input_micros=to_micros(spec.get("cached_input", spec["input"])),
        output_micros=to_micros(spec["output"]),
        currency=currency,
    )


def prices_from_config(path: str, currency: str) -> dict[str, Price]:
    """``{model name or alias: price}`` from the routing YAML (empty without a file)."""
    if not path:
        return {}
    config = yaml.safe_load(Path(path).read_text()) or {}
    prices: dict[str, Price] = {}
    for entry in config.get("models") or []:
        if isinstance(entry, dict) and entry.get("price") is not None:
            price = price_from_spec(entry["price"], currency, f"model {entry.get('name')!r}")
            for name in [entry["name"], *(entry.get("aliases") or [])]:
                prices[name] = price
    return prices


def price_of_row(row: ModelPrice) -> Price:
    return Price(row.input_micros, row.cached_input_micros, row.output_micros, row.currency)


class PricedAdapter(Protocol):
    @property
    def base_model(self) -> str: ...

    @property
    def price(self) -> Price | None:
        """None: the base model's price applies."""


class AdapterSource(Protocol):
    async def find(self, called: str) -> PricedAdapter | None: ...


class PriceBook:
    """Every replica's view of the prices: the YAML's, then the database's by time."""

    def __init__(
        self,
        configured: dict[str, Price],
        sessionmaker: async_sessionmaker[AsyncSession] | None,
        *,
        refresh_s: float = REFRESH_S,
        adapters: AdapterSource | None = None,
    ) -> None:
        self._adapters = adapters
        self._configured = configured
        self._sessionmaker = sessionmaker
        self._refresh_s = refresh_s
        self._history: dict[str, tuple[list[float], list[Price]]] = {}
        self._loaded_at = float("-inf")
        self._must_load = True
        """Until the first load, and after a local change: answer only from a fresh table."""
        self._loading: asyncio.Task[None] | None = None

    @property
    def configured(self) -> dict[str, Price]:
        return dict(self._configured)

    def invalidate(self) -> None:
        self._must_load = True

    async def price_at(self, model: str, when: float | None = None) -> Price | None:
        """The price in force for ``model`` at Unix time ``when`` (now by default).

        A table older than ``refresh_s`` is refreshed in the background (requests are not held
        up by the database), one load at a time however many requests ask."""
        when = time.time() if when is None else when
        if self._sessionmaker is not None:
            if self._must_load:
                await asyncio.shield(self._start_load())
            elif time.monotonic() - self._loaded_at > self._refresh_s:
                self._start_load()
        history = self._history.get(model)
        if history is not None:
            index = bisect.bisect_right(history[0], when) - 1
            if index >= 0:
                return history[1][index]
        configured = self._configured.get(model)
        if configured is None and self._adapters is not None:
            adapter = await self._adapters.find(model)
            if adapter is not None:
                return adapter.price or await self.price_at(adapter.base_model, when)
        return configured

    def _start_load(self) -> asyncio.Task[None]:
        if self._loading is None or self._loading.done():
            self._must_load = False
            self._loading = asyncio.create_task(self._load(), name="price-book-load")
        return self._loading

    async def _load(self) -> None:
        assert self._sessionmaker is not None
        try:
            async with self._sessionmaker() as session:
                rows = await current_price_rows(session)
        except Exception as exc:
            # Requests keep the prices they had through a database outage.
            logger.warning("prices not refreshed (%s); keeping the ones loaded", exc)
            self._loaded_at = time.monotonic()
            return
        history: dict[str, tuple[list[float], list[Price]]] = {}
        for row in rows:
            times, prices = history.setdefault(row.model, ([], []))
            times.append(row.effective_from.timestamp())
            prices.append(price_of_row(row))
        self._history = history
        self._loaded_at = time.monotonic()


async def current_price_rows(session: AsyncSession) -> list[ModelPrice]:
    query = select(ModelPrice).order_by(ModelPrice.model, ModelPrice.effective_from)
    return list((await session.execute(query)).scalars())
