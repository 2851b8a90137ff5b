"""LoRA adapters as model names: ``base:adapter``, or an alias from the routing YAML.

::

    adapter_aliases:
      support-bot: SmolLM2-135M-Instruct:support   # alias: base:adapter

The registry lives in PostgreSQL (``lora_adapters``, written by the admin API); every replica
reads it whole into an ``AdapterBook``, refreshed in the background every few seconds like
the prices, and at once after a change of its own. A request naming an adapter is served by
the engine deployments of the base model, with ``Request.lora`` set (``adapter_route``); a
key that may not call it (another team's adapter, or a model allow-list without it) is told
the model does not exist, exactly as for an unknown name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.engine.protocol import LoraAdapter
from sluicegate.gateway.db.adapters import list_adapters
from sluicegate.gateway.db.models import LoraAdapterRow
from sluicegate.gateway.routing.config import ConfigError, ModelRoute
from sluicegate.gateway.usage.pricing import Price

logger = logging.getLogger(__name__)

REFRESH_S = 5.0
ADAPTER_NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
"""No ``:``, so ``base:adapter`` splits at its last colon whatever the base's name."""


@dataclass(frozen=True, slots=True)
class Adapter:
    id: str
    name: str
    base_model: str
    path: str
    team_id: str | None
    """None: a global adapter, every key's."""
    price: Price | None
    """None: the base model's price applies."""

    @property
    def model_name(self) -> str:
        return f"{self.base_model}:{self.name}"

    def wire(self) -> LoraAdapter:
        return LoraAdapter(served_name(self.name, self.id), self.path)

    def visible_to(self, team_id: str | None) -> bool:
        return self.team_id is None or self.team_id == team_id


def served_name(name: str, adapter_id: str) -> str:
    """The name workers hold an adapter under: one per registration, so an adapter deleted and
    registered again under its old name (new weights, another path) is never answered from a
    copy a worker still holds, nor from prefix-cache blocks of the old one."""
    return f"{name}@{adapter_id.replace('-', '')[:8]}"


def adapter_of_row(row: LoraAdapterRow, currency: str) -> Adapter:
    price = None
    if row.input_micros is not None and row.output_micros is not None:
        cached = row.input_micros if row.cached_input_micros is None else row.cached_input_micros
        price = Price(row.input_micros, cached, row.output_micros, currency)
    team_id = str(row.team_id) if row.team_id is not None else None
    return Adapter(str(row.id), row.name, row.base_model, row.path, team_id, price)


def aliases_from_config(path: str) -> dict[str, str]:
    """``{alias: base:adapter}`` from the routing YAML's ``adapter_aliases`` (empty without)."""
    if not path:
        return {}
    config = yaml.safe_load(Path(path).read_text()) or {}
    aliases = config.get("adapter_aliases") or {}
    if not isinstance(aliases, dict) or not all(
        isinstance(alias, str) and isinstance(target, str) and ":" in target
        for alias, target in aliases.items()
    ):
        raise ConfigError("adapter_aliases must map names to adapters named 'base:adapter'")
    return dict(aliases)


class AdapterBook:
    """Every replica's view of the registry: ``base:adapter`` -> Adapter."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession] | None,
        currency: str,
        aliases: dict[str, str] | None = None,
        *,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._currency = currency
        self.aliases = dict(aliases or {})
        self._refresh_s = refresh_s
        self._adapters: dict[str, Adapter] = {}
        self._loaded_at = float("-inf")
        self._must_load = True
        self._loading: asyncio.Task[None] | None = None

    def invalidate(self) -> None:
        self._must_load = True

    async def find(self, called: str) -> Adapter | None:
        """The adapter a model name calls (an alias, or ``base:adapter``), if registered."""
        target = self.aliases.get(called, called)
        if ":" not in target:
            return None
        return (await self.adapters()).get(target)

    async def adapters(self) -> dict[str, Adapter]:
        """Every adapter by ``base:adapter``; the first read, and one after a local change,
        waits for the database, later ones refresh in the background."""
        if self._sessionmaker is not None:
            if self._must_load:
                await asyncio.shield(self._start_load())
            elif time.monotonic() - self._loaded_at > self._refresh_s:
                self._start_load()
        return self._adapters

    async def callable_by(self, team_id: str | None) -> list[tuple[str, Adapter]]:
        """``(model name, adapter)`` of every name a key of ``team_id`` may call: each
        adapter's ``base:adapter`` and its aliases."""
        adapters = await self.adapters()
        names = [(name, adapter) for name, adapter in adapters.items()]
        names += [(alias, adapters[t]) for alias, t in self.aliases.items() if t in adapters]
        return [(name, adapter) for name, adapter in names if adapter.visible_to(team_id)]

    def _start_load(self) -> asyncio.Task[None]:
        if self._loading is None or self._loading.done():
            self._must_load = False
            self._loading = asyncio.create_task(self._load(), name="adapter-book-load")
        return self._loading

    async def _load(self) -> None:
        assert self._sessionmaker is not None
        try:
            async with self._sessionmaker() as session:
                rows = await list_adapters(session)
        except Exception as exc:
            # Requests keep the adapters they had through a database outage.
            logger.warning("adapters not refreshed (%s); keeping the ones loaded", exc)
            self._loaded_at = time.monotonic()
            return
        adapters = [adapter_of_row(row, self._currency) for row in rows]
        self._adapters = {adapter.model_name: adapter for adapter in adapters}
        self._loaded_at = time.monotonic()


def adapter_route(called: str, adapter: Adapter, base: ModelRoute) -> ModelRoute:
    """The route of ``adapter`` called as ``called``: its base model's engine deployments
    (only our engine serves adapters), shared with the base so their load counts are one."""
    engines = [d for d in base.deployments if d.kind == "engine"]
    return ModelRoute(called, deployments=engines, adapter=adapter.model_name)
