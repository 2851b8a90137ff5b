"""LoRA adapters as models through the whole gateway (real PostgreSQL, Redis and HTTP server,
scripted engine workers on the real streams): registration and team scoping through the admin
API, the 404 another team's key gets on every inbound API, what goes on the worker's stream,
the usage rows and their price, and ``/v1/models``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis
import yaml
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.db.scratch import scratch_database
from sluicegate.gateway.providers.engine.prefix_affinity import prefix_hashes
from sluicegate.gateway.settings import Settings

from ..api.servers import ServerThread
from .scripted_engine import ScriptedWorker

UNIQUE = uuid.uuid4().hex[:8]
BASE = f"lora-base-{UNIQUE}"
NO_LORA_BASE = f"plain-base-{UNIQUE}"
ALIAS = f"support-{UNIQUE}"
Gateway = tuple[str, Settings]


class Workers:
    def __init__(self, redis_url: str) -> None:
        self.plain = ScriptedWorker(redis_url, BASE)
        self.lora_empty = ScriptedWorker(redis_url, BASE, max_loras=4)
        self.lora_holding = ScriptedWorker(redis_url, BASE, max_loras=4)
        self.other_model = ScriptedWorker(redis_url, NO_LORA_BASE)
        self.all = [self.plain, self.lora_empty, self.lora_holding, self.other_model]


@pytest.fixture(scope="module")
def workers(redis_url: str) -> Iterator[Workers]:
    made = Workers(redis_url)
    for worker in made.all:
        worker.start()
    yield made
    for worker in made.all:
        worker.stop()


@pytest.fixture(scope="module")
def gateway(
    workers: Workers,
    admin_database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Gateway]:
    routing = {
        "models": [
            {"name": model, "deployments": [{"provider": "engine", "model": model}]}
            for model in (BASE, NO_LORA_BASE)
        ],
        "adapter_aliases": {ALIAS: f"{BASE}:support"},
    }
    config = Path(tmp_path_factory.mktemp("lora")) / "models.yaml"
    config.write_text(yaml.safe_dump(routing))
    with scratch_database(admin_database_url, prefix="sg_lora") as database_url:
        settings = Settings.from_env(
            database_url=database_url,
            redis_url=redis_url,
            master_key=f"sg-master-{UNIQUE}",
            config=str(config),
            usage_stream=f"sg:usage:lora:{UNIQUE}",
            usage_flush_interval_s=0.05,
        )
        server = ServerThread(create_asgi_app(settings)).start()
        yield server.url, settings
        server.stop()


def _call(
    gateway: Gateway,
    method: str,
    path: str,
    key: str | None = None,
    body: dict[str, Any] | None = None,
) -> httpx.Response:
    url, settings = gateway
    headers = {"authorization": f"Bearer {key or settings.master_key}"}
    return httpx.request(method, f"{url}{path}", json=body, headers=headers, timeout=30)


def _ok(response: httpx.Response, status: int = 200) -> Any:
    assert response.status_code == status, response.text
    return response.json()


def _team(gateway: Gateway) -> str:
    body = {"name": f"team-{uuid.uuid4().hex[:6]}"}
    return str(_ok(_call(gateway, "POST", "/admin/teams", body=body), 201)["id"])


def _key(gateway: Gateway, **fields: Any) -> str:
    body = {"name": f"k-{uuid.uuid4().hex[:6]}", **fields}
    return str(_ok(_call(gateway, "POST", "/admin/keys", body=body), 201)["key"])


def _register(gateway: Gateway, key: str | None = None, **fields: Any) -> httpx.Response:
    body = {"base_model": BASE, "path": f"/adapters/{fields.get('name')}", **fields}
    return _call(gateway, "POST", "/admin/adapters", key, body)


@pytest.fixture(scope="module")
def teams(gateway: Gateway) -> dict[str, str]:
    """Two teams, each with a team admin key and a member key."""
    made: dict[str, str] = {}
    for team in ("a", "b"):
        team_id = _team(gateway)
        made[team] = team_id
        made[f"{team}_admin"] = _key(gateway, team_id=team_id, role="team_admin")
        made[f"{team}_member"] = _key(gateway, team_id=team_id)
    return made


def _names(listing: dict[str, Any]) -> set[str]:
    return {adapter["model"] for adapter in listing["data"]}


def test_registration_is_scoped_to_the_team_admins_team(
    gateway: Gateway, teams: dict[str, str]
) -> None:
    mine = _ok(_register(gateway, teams["a_admin"], name="scoped-a"), 201)
    assert mine["team_id"] == teams["a"] and mine["model"] == f"{BASE}:scoped-a"
    assert mine["input"] is None and mine["output"] is None
    shared = _ok(_register(gateway, name="scoped-global", input=1.5, output=3), 201)
    assert shared["team_id"] is None and shared["cached_input"] == 1.5

    elsewhere = _register(gateway, teams["a_admin"], name="x", team_id=teams["b"])
    assert elsewhere.status_code == 403
    assert _register(gateway, name="scoped-a").status_code == 409
    assert _register(gateway, name="bad:name").status_code == 400
    half_priced = _register(gateway, name="half", input=1.0)
    assert half_priced.status_code == 400 and half_priced.json()["error"]["param"] == "output"
    assert _register(gateway, teams["a_member"], name="member").status_code == 403
    assert _register(gateway, name="lost", team_id=str(uuid.uuid4())).status_code == 404

    a_view = _names(_ok(_call(gateway, "GET", "/admin/adapters", teams["a_admin"])))
    b_view = _names(_ok(_call(gateway, "GET", "/admin/adapters", teams["b_admin"])))
    assert {f"{BASE}:scoped-a", f"{BASE}:scoped-global"} <= a_view
    assert f"{BASE}:scoped-global" in b_view and f"{BASE}:scoped-a" not in b_view
    only_a = _ok(_call(gateway, "GET", f"/admin/adapters?team_id={teams['a']}"))
    assert _names(only_a) == {f"{BASE}:scoped-a"}

    path = f"/admin/adapters/{mine['id']}"
    assert _call(gateway, "GET", path, teams["b_admin"]).status_code == 404
    assert _call(gateway, "DELETE", path, teams["b_admin"]).status_code == 404
    global_path = f"/admin/adapters/{shared['id']}"
    assert _call(gateway, "DELETE", global_path, teams["a_admin"]).status_code == 403
    assert _ok(_call(gateway, "GET", path, teams["a_admin"]))["path"] == "/adapters/scoped-a"
    _ok(_call(gateway, "DELETE", path, teams["a_admin"]))
    assert _call(gateway, "GET", path).status_code == 404
    again = _ok(_register(gateway, teams["a_admin"], name="scoped-a", path="/adapters/v2"), 201)
    # Workers may still hold the deleted one: the new one is held under another name.
    assert again["served_as"] != mine["served_as"]

    audit = _ok(_call(gateway, "GET", "/admin/audit?target_type=adapter"))["data"]
    actions = {(entry["action"], entry["target_id"]) for entry in audit}
    assert {("adapter.create", mine["id"]), ("adapter.delete", mine["id"])} <= actions


INBOUND = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"prompt": "hi"}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ),
}


@pytest.mark.parametrize("api", sorted(INBOUND))
def test_a_key_that_may_not_call_an_adapter_gets_the_unknown_model_404(
    gateway: Gateway, teams: dict[str, str], api: str
) -> None:
    name = f"private-{api}"
    _ok(_register(gateway, teams["a_admin"], name=name), 201)
    path, body = INBOUND[api]
    narrow = _key(gateway, team_id=teams["a"], allowed_models=[BASE])

    unknown = _call(gateway, "POST", path, teams["b_member"], {**body, "model": f"{BASE}:nope"})
    assert unknown.status_code == 404
    for key in (teams["b_member"], narrow):
        refused = _call(gateway, "POST", path, key, {**body, "model": f"{BASE}:{name}"})
        assert refused.status_code == 404, refused.text
        assert _error_shape(refused.json()) == _error_shape(unknown.json())
        assert f"{BASE}:{name}" in refused.text

    served = _call(gateway, "POST", path, teams["a_member"], {**body, "model": f"{BASE}:{name}"})
    assert served.status_code == 200, served.text


def _error_shape(body: dict[str, Any]) -> tuple[Any, ...]:
    error = body["error"]
    return body.get("type"), error.get("type"), error.get("code"), error.get("param")


def _requests_on(redis_url: str, stream: str) -> list[protocol.Request]:
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(stream)
    finally:
        client.close()
    decoded = [protocol.decode(fields[redis_names.MESSAGE_FIELD]) for _, fields in entries]
    return [message for message in decoded if isinstance(message, protocol.Request)]


def _sdk(gateway: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway[0]}/v1", api_key=key, max_retries=0)


def test_an_adapter_request_goes_only_to_a_lora_workers_own_stream(
    gateway: Gateway, teams: dict[str, str], workers: Workers
) -> None:
    held_adapter = _ok(_register(gateway, name="held"), 201)
    _ok(_register(gateway, name="fresh"), 201)
    workers.lora_holding.loras = [held_adapter["served_as"]]
    time.sleep(1.0)  # its next heartbeat says so, and the gateway's worker cache expires
    client = _sdk(gateway, teams["a_member"])
    redis_url = gateway[1].redis_url
    question = [{"role": "user", "content": f"which adapter? {uuid.uuid4().hex}"}]

    held = client.chat.completions.create(model=f"{BASE}:held", messages=question)  # type: ignore[arg-type]
    assert held.model == f"{BASE}:held" and held.choices[0].message.content
    own = _requests_on(redis_url, redis_names.worker_stream(BASE, workers.lora_holding.worker_id))
    sent = [r for r in own if r.messages and r.messages[-1].content == question[0]["content"]]
    assert len(sent) == 1
    assert sent[0].lora == protocol.LoraAdapter(held_adapter["served_as"], "/adapters/held")
    assert held_adapter["served_as"].startswith("held@")
    assert sent[0].model == BASE

    for _ in range(4):
        client.completions.create(model=f"{BASE}:fresh", prompt="fresh", max_tokens=4)
    lora_streams = [
        redis_names.worker_stream(BASE, worker.worker_id)
        for worker in (workers.lora_empty, workers.lora_holding)
    ]
    fresh = [
        request
        for stream in lora_streams
        for request in _requests_on(redis_url, stream)
        if request.lora is not None and request.lora.path == "/adapters/fresh"
    ]
    assert len(fresh) == 4
    shared = _requests_on(redis_url, redis_names.request_stream(BASE))
    plain_own = _requests_on(redis_url, redis_names.worker_stream(BASE, workers.plain.worker_id))
    assert not [request for request in shared + plain_own if request.lora is not None]
    assert not [request for request in workers.plain.requests if request.lora is not None]


def test_no_lora_worker_for_the_base_model_is_a_503(
    gateway: Gateway, teams: dict[str, str]
) -> None:
    _ok(_register(gateway, name="orphan", base_model=NO_LORA_BASE), 201)
    body = {"model": f"{NO_LORA_BASE}:orphan", "messages": [{"role": "user", "content": "x"}]}
    refused = _call(gateway, "POST", "/v1/chat/completions", teams["a_member"], body)
    assert refused.status_code == 503, refused.text
    assert "LoRA" in refused.json()["error"]["message"]


async def _usage_rows(database_url: str, request_ids: list[str]) -> list[tuple[Any, ...]]:
    engine = create_async_engine(database_url)
    query = text(
        "SELECT request_id, model, adapter, cost_micros, prompt_tokens, completion_tokens "
        "FROM usage_records WHERE request_id = ANY(:ids) ORDER BY started_at"
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            async with engine.connect() as connection:
                rows = (await connection.execute(query, {"ids": request_ids})).all()
            if len(rows) >= len(request_ids) or time.monotonic() > deadline:
                return [tuple(row) for row in rows]
            await asyncio.sleep(0.05)
    finally:
        await engine.dispose()


def test_usage_rows_carry_the_adapter_and_its_price(
    gateway: Gateway, teams: dict[str, str]
) -> None:
    _ok(_register(gateway, name="priced", input=2, output=4), 201)
    _ok(_register(gateway, name="support"), 201)
    price = {"model": BASE, "input": 1, "output": 3}
    _ok(_call(gateway, "POST", "/admin/prices", body=price), 201)
    client = _sdk(gateway, teams["a_member"])
    message = [{"role": "user", "content": "bill me"}]
    ids = []
    for model in (f"{BASE}:priced", f"{BASE}:support", ALIAS):
        raw = client.chat.completions.with_raw_response.create(model=model, messages=message)  # type: ignore[arg-type]
        ids.append(raw.headers["x-request-id"])
    rows = await_rows(gateway, ids)
    # The scripted worker bills one prompt token per message and two completion tokens.
    assert [row[1:] for row in rows] == [
        (f"{BASE}:priced", f"{BASE}:priced", (1 * 2 + 2 * 4), 1, 2),
        (f"{BASE}:support", f"{BASE}:support", (1 * 1 + 2 * 3), 1, 2),
        (ALIAS, f"{BASE}:support", (1 * 1 + 2 * 3), 1, 2),
    ]


def await_rows(gateway: Gateway, ids: list[str]) -> list[tuple[Any, ...]]:
    return asyncio.run(_usage_rows(gateway[1].database_url, ids))


def test_models_lists_the_adapters_a_key_may_call_with_their_base(
    gateway: Gateway, teams: dict[str, str]
) -> None:
    _ok(_register(gateway, teams["a_admin"], name="listed-a"), 201)
    _ok(_register(gateway, name="support-listing"), 201)
    listed: dict[str, dict[str, str | None]] = {}
    for team in ("a", "b"):
        cards = _ok(_call(gateway, "GET", "/v1/models", teams[f"{team}_member"]))["data"]
        listed[team] = {card["id"]: card.get("parent") for card in cards}
    assert listed["a"][f"{BASE}:listed-a"] == BASE
    assert listed["a"][f"{BASE}:support-listing"] == BASE
    assert listed["a"][BASE] is None
    assert f"{BASE}:listed-a" not in listed["b"]
    assert listed["b"][f"{BASE}:support-listing"] == BASE


def test_prefix_affinity_never_mixes_adapters() -> None:
    prompt = b"x" * 1024
    base = prefix_hashes(prompt)
    one, other = prefix_hashes(prompt, adapter="one"), prefix_hashes(prompt, adapter="two")
    assert len(base) == len(one) == len(other) == 4
    assert not (set(base) & set(one)) and not (set(one) & set(other))
    assert prefix_hashes(prompt, adapter="one") == one
