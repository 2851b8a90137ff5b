"""Acceptance 3 of issue 30 with real processes: a team admin registers a peft adapter (non-zero
B) for the tiny model served by a real LoRA worker, its team's key calls it with the openai SDK
and gets transformers + peft's greedy tokens for that adapter, another team's key gets a 404,
and the usage row carries the adapter and its price."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from sluicegate.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer
from sluicegate.gateway.usage.pricing import Price
from tests.engine.lora import adapters

from .conftest import MASTER_KEY, Cluster, Gateway, model_name, wait_until

NEW_TOKENS = 12
PROMPT = [5, 17, 33, 101, 7, 64, 250, 12, 90, 3, 44, 180]
PRICE = Price(
    input_micros=2_000_000, cached_input_micros=2_000_000, output_micros=8_000_000, currency="USD"
)


def _admin(gateway: Gateway, path: str, body: dict[str, Any], key: str = MASTER_KEY) -> Any:
    response = httpx.post(
        f"{gateway.base_url}{path}",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 201, response.text
    return response.json()


def _text_of(model_dir: Path, tokens: list[int]) -> str:
    """What the worker streams for ``tokens`` after ``PROMPT``: its own detokenizer's text."""
    detokenizer = IncrementalDetokenizer(Tokenizer(model_dir), PROMPT)
    seen = ""
    for token in tokens:
        detokenizer.add_token(token)
        seen += detokenizer.pop_delta()
    return seen


async def _usage_row(database_url: str, request_id: str) -> tuple[Any, ...] | None:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            row = (
                await connection.execute(
                    text(
                        "SELECT model, adapter, prompt_tokens, completion_tokens, cost_micros "
                        "FROM usage_records WHERE request_id = :id"
                    ),
                    {"id": request_id},
                )
            ).first()
    finally:
        await engine.dispose()
    return tuple(row) if row is not None else None


def test_a_team_calls_its_adapter_through_the_gateway(
    cluster: Cluster,
    gateway: Gateway,
    redis_url: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    base = model_name("lora-gw")
    cluster.worker(base, redis_url, "--max-loras", "2", "--max-lora-rank", "16")
    folder = adapters.make_adapter(tiny_model_dir, tmp_path / "support", seed=7)
    expected = adapters.peft_greedy(tiny_model_dir, folder, [PROMPT], NEW_TOKENS)[0]
    from_base = adapters.peft_greedy(tiny_model_dir, None, [PROMPT], NEW_TOKENS)[0]
    assert expected != from_base, "the adapter must change the greedy tokens to be told apart"

    ours = _admin(gateway, "/admin/teams", {"name": f"ours-{uuid.uuid4().hex[:6]}"})
    theirs = _admin(gateway, "/admin/teams", {"name": f"theirs-{uuid.uuid4().hex[:6]}"})
    lead = _admin(
        gateway, "/admin/keys", {"name": "lead", "team_id": ours["id"], "role": "team_admin"}
    )
    member = _admin(gateway, "/admin/keys", {"name": "member", "team_id": ours["id"]})
    outsider = _admin(gateway, "/admin/keys", {"name": "outsider", "team_id": theirs["id"]})
    registered = _admin(
        gateway,
        "/admin/adapters",
        {"name": "support", "base_model": base, "path": str(folder), "input": 2, "output": 8},
        key=lead["key"],
    )
    adapter = f"{base}:support"
    assert registered["model"] == adapter and registered["team_id"] == ours["id"]

    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=member["key"])
    wait_until(lambda: adapter in {m.id for m in client.models.list()}, 60, f"{adapter} listed")
    raw = client.completions.with_raw_response.create(
        model=adapter,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    answer = raw.parse()
    assert answer.model == adapter
    assert answer.choices[0].text == _text_of(tiny_model_dir, expected)
    assert answer.usage is not None and answer.usage.completion_tokens == NEW_TOKENS

    stranger = openai.OpenAI(
        base_url=f"{gateway.base_url}/v1", api_key=outsider["key"], max_retries=0
    )
    with pytest.raises(openai.NotFoundError) as refused:
        stranger.completions.create(model=adapter, prompt=PROMPT, max_tokens=2)
    assert refused.value.code == "model_not_found"
    assert adapter not in {m.id for m in stranger.models.list()}

    request_id = raw.headers["x-request-id"]
    rows: list[tuple[Any, ...]] = []

    def recorded() -> bool:
        row = asyncio.run(_usage_row(gateway.database_url, request_id))
        rows[:] = [row] if row is not None else []
        return bool(rows)

    wait_until(recorded, 20, "the adapter's usage row", interval=0.2)
    model, used_adapter, prompt_tokens, completion_tokens, cost = rows[0]
    assert (model, used_adapter) == (adapter, adapter)
    assert (prompt_tokens, completion_tokens) == (len(PROMPT), NEW_TOKENS)
    assert cost == PRICE.cost_micros(prompt_tokens, completion_tokens)
