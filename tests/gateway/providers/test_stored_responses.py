"""Stored Responses with the official ``openai`` SDK: ``store`` (on unless false), three turns
chained by ``previous_response_id`` against an Anthropic-wire upstream and an engine worker
(each sent the whole rebuilt conversation), streamed and not; retrieve, input_items and delete;
and the 404 every other team's key gets."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.db.scratch import scratch_database
from sluicegate.gateway.settings import Settings

from ..api.servers import ServerThread
from . import fake_anthropic
from .fake_anthropic import FakeAnthropic
from .scripted_engine import ScriptedWorker

ANSWER = "w0 w1 w2 w3 w4 "
"""The fake Anthropic model's answer to any question without tools."""


@pytest.fixture(scope="module")
def anthropic_upstream() -> Iterator[tuple[FakeAnthropic, str]]:
    app = FakeAnthropic()
    server = ServerThread(app).start()
    yield app, server.url
    server.stop()


@pytest.fixture(scope="module")
def engine_worker(redis_url: str) -> Iterator[ScriptedWorker]:
    worker = ScriptedWorker(redis_url, f"stored-{uuid.uuid4().hex[:8]}").start()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def gateway(
    anthropic_upstream: tuple[FakeAnthropic, str],
    engine_worker: ScriptedWorker,
    admin_database_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch_module: pytest.MonkeyPatch,
) -> Iterator[tuple[str, Settings]]:
    monkeypatch_module.setenv("TEST_STORED_ANTHROPIC_KEY", fake_anthropic.API_KEY)
    anthropic = {
        "provider": "anthropic",
        "model": "plain",
        "base_url": anthropic_upstream[1],
        "api_key_env": "TEST_STORED_ANTHROPIC_KEY",
    }
    routing = {
        "models": [
            {"name": "claude", "deployments": [anthropic]},
            {
                "name": "engine",
                "deployments": [{"provider": "engine", "model": engine_worker.model}],
            },
        ]
    }
    config = Path(tmp_path_factory.mktemp("stored")) / "models.yaml"
    config.write_text(yaml.safe_dump(routing))
    unique = uuid.uuid4().hex[:10]
    with scratch_database(admin_database_url, prefix="sg_stored") as database_url:
        settings = Settings.from_env(
            database_url=database_url,
            redis_url=redis_url,
            master_key=f"sg-master-{unique}",
            config=str(config),
            usage_stream=f"sg:usage:stored:{unique}",
            run_usage_flusher=False,
        )
        server = ServerThread(create_asgi_app(settings)).start()
        yield server.url, settings
        server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def new_client(gateway: tuple[str, Settings]) -> Callable[..., openai.OpenAI]:
    """``new_client(team_id=None)``: an SDK client with a new key (in that team)."""
    url = gateway[0]

    def make(team_id: str | None = None) -> openai.OpenAI:
        body: dict[str, Any] = {"name": f"stored-{uuid.uuid4().hex[:6]}"}
        if team_id is not None:
            body["team_id"] = team_id
        answer = _admin(gateway, "/admin/keys", body)
        return openai.OpenAI(base_url=f"{url}/v1", api_key=answer["key"], max_retries=0)

    return make


def _admin(gateway: tuple[str, Settings], path: str, body: dict[str, Any]) -> dict[str, Any]:
    url, settings = gateway
    response = httpx.post(
        f"{url}{path}", json=body, headers={"authorization": f"Bearer {settings.master_key}"}
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def _team(gateway: tuple[str, Settings]) -> str:
    return str(_admin(gateway, "/admin/teams", {"name": f"team-{uuid.uuid4().hex[:6]}"})["id"])


def _create(client: openai.OpenAI, stream: bool, **kwargs: Any) -> Any:
    """A response, created whole or streamed (then the response object of its last event),
    continued at once by the caller: a stored response must be readable when its answer ends."""
    if not stream:
        return client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert events[-1].type == "response.completed"
    return events[-1].response


def _texts(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(role, text) of each Anthropic message."""
    out = []
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(block.get("text", "") for block in content)
        out.append((message["role"], content.strip()))
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_three_turns_reach_an_anthropic_upstream_in_full(
    new_client: Callable[..., openai.OpenAI],
    anthropic_upstream: tuple[FakeAnthropic, str],
    stream: bool,
) -> None:
    client = new_client()
    first = _create(client, stream, model="claude", instructions="old rules", input="one")
    assert first.store is True  # left out, as OpenAI's default
    second = _create(
        client, stream, model="claude", input="two", previous_response_id=first.id, store=True
    )
    assert second.previous_response_id == first.id
    third = _create(
        client,
        stream,
        model="claude",
        instructions="new rules",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "three"}]}],
        previous_response_id=second.id,
    )
    assert third.output_text == ANSWER
    body = anthropic_upstream[0].bodies[-1]
    assert _texts(body["messages"]) == [
        ("user", "one"),
        ("assistant", ANSWER.strip()),
        ("user", "two"),
        ("assistant", ANSWER.strip()),
        ("user", "three"),
    ]
    # Instructions are each request's own, as OpenAI's: the first turn's are not carried over.
    system = body["system"]
    assert "new rules" in str(system) and "old rules" not in str(system)
    assert bool(body.get("stream")) is stream


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_three_turns_reach_an_engine_worker_in_full(
    new_client: Callable[..., openai.OpenAI], engine_worker: ScriptedWorker, stream: bool
) -> None:
    client = new_client()
    first = _create(client, stream, model="engine", input="one")
    n = len(engine_worker.requests)
    second = _create(client, stream, model="engine", input="two", previous_response_id=first.id)
    third = _create(client, stream, model="engine", input="three", previous_response_id=second.id)
    assert third.output_text == f"answer {n + 2}"
    messages = engine_worker.requests[-1].messages or []
    assert [(m.role, m.content) for m in messages] == [
        ("user", "one"),
        ("assistant", f"answer {n}"),
        ("user", "two"),
        ("assistant", f"answer {n + 1}"),
        ("user", "three"),
    ]


def test_retrieve_list_and_delete_through_the_sdk(
    new_client: Callable[..., openai.OpenAI],
) -> None:
    client = new_client()
    first = client.responses.create(model="claude", input="one")
    second = client.responses.create(
        model="claude",
        input=[{"role": "user", "content": "two"}, {"role": "user", "content": "and more"}],
        previous_response_id=first.id,
    )
    again = client.responses.retrieve(second.id)
    assert again.model_dump() == second.model_dump()

    # Every item the model read for it: the first turn's input and output, then its own.
    listed = client.responses.input_items.list(second.id, order="asc")
    items = listed.data
    assert [item.type for item in items] == ["message"] * 4
    texts = [item.content[0].text for item in items]  # type: ignore[union-attr]
    assert texts == ["one", ANSWER, "two", "and more"]
    assert items[1].id == first.output[0].id
    assert (listed.first_id, listed.last_id, listed.has_more) == (items[0].id, items[3].id, False)
    assert [i.id for i in client.responses.input_items.list(second.id).data] == [
        i.id for i in reversed(items)
    ]  # newest first unless asked otherwise, as OpenAI's
    page = client.responses.input_items.list(second.id, order="asc", limit=2, after=items[0].id)
    assert [i.id for i in page.data] == [items[1].id, items[2].id] and page.has_more
    assert [i.id for i in client.responses.input_items.list(second.id, limit=3)] == [
        i.id for i in reversed(items)
    ]  # the SDK's auto-pagination follows has_more and last_id

    deleted = client.delete(f"/responses/{second.id}", cast_to=httpx.Response)
    assert deleted.json() == {"id": second.id, "object": "response", "deleted": True}
    for read in (client.responses.retrieve, client.responses.input_items.list):
        with pytest.raises(openai.NotFoundError):
            read(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)
    client.responses.delete(first.id)  # the SDK's own call
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def _refused_everywhere(client: openai.OpenAI, response_id: str) -> None:
    for call in (
        client.responses.retrieve,
        client.responses.input_items.list,
        client.responses.delete,
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call(response_id)
        assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as continued:
        client.responses.create(model="claude", input="hi", previous_response_id=response_id)
    assert continued.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_response_is_its_teams_alone(
    gateway: tuple[str, Settings], new_client: Callable[..., openai.OpenAI]
) -> None:
    team = _team(gateway)
    owner, teammate, outsider = new_client(team), new_client(team), new_client(_team(gateway))
    response = owner.responses.create(model="claude", input="one")
    _refused_everywhere(outsider, response.id)
    _refused_everywhere(new_client(), response.id)  # a key in no team
    assert teammate.responses.retrieve(response.id).id == response.id
    chained = teammate.responses.create(
        model="claude", input="two", previous_response_id=response.id
    )
    # The teammate's continuation is the team's too; it starts from the owner's input.
    first_item = owner.responses.input_items.list(chained.id, order="asc").data[0]
    assert first_item.content[0].text == "one"  # type: ignore[union-attr]


def test_a_key_in_no_team_sees_only_its_own(new_client: Callable[..., openai.OpenAI]) -> None:
    owner = new_client()
    response = owner.responses.create(model="claude", input="one")
    _refused_everywhere(new_client(), response.id)
    assert owner.responses.retrieve(response.id).id == response.id


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_result_continues_the_call_it_answers(
    new_client: Callable[..., openai.OpenAI],
    anthropic_upstream: tuple[FakeAnthropic, str],
    stream: bool,
) -> None:
    """The agent loop: the model calls a tool, the client sends only the tool's output."""
    client = new_client()
    called = _create(
        client,
        stream,
        model="claude",
        input="what is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    answered = _create(
        client,
        stream,
        model="claude",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        previous_response_id=called.id,
    )
    assert answered.output_text == ANSWER
    messages = anthropic_upstream[0].bodies[-1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    (use,) = [b for b in messages[1]["content"] if b["type"] == "tool_use"]
    (result,) = messages[2]["content"]
    assert (use["id"], use["name"]) == (call.call_id, "get_weather")
    assert (result["type"], result["tool_use_id"]) == ("tool_result", call.call_id)


def test_store_false_keeps_nothing_and_may_still_continue(
    new_client: Callable[..., openai.OpenAI],
    anthropic_upstream: tuple[FakeAnthropic, str],
) -> None:
    client = new_client()
    kept = client.responses.create(model="claude", input="one")
    transient = client.responses.create(
        model="claude", input="two", previous_response_id=kept.id, store=False
    )
    assert transient.store is False and transient.previous_response_id == kept.id
    assert len(anthropic_upstream[0].bodies[-1]["messages"]) == 3
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(transient.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="claude", input="x", previous_response_id=transient.id)
    assert "not found" in caught.value.message


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "nope"}, "after"),
        ({"include": "message.input_image.image_url"}, "include"),
        ({"before": "x"}, "before"),
    ],
)
def test_bad_list_options_are_400s(
    new_client: Callable[..., openai.OpenAI], query: dict[str, Any], param: str
) -> None:
    client = new_client()
    response = client.responses.create(model="claude", input="one")
    with pytest.raises(openai.BadRequestError) as caught:
        client.get(
            f"/responses/{response.id}/input_items",
            cast_to=httpx.Response,
            options={"params": query},
        )
    assert caught.value.body["param"] == param  # type: ignore[index]


@pytest.mark.parametrize("param", ["include", "stream", "starting_after"])
def test_retrieve_options_we_do_not_honour_are_400s(
    new_client: Callable[..., openai.OpenAI], param: str
) -> None:
    client = new_client()
    response = client.responses.create(model="claude", input="one")
    with pytest.raises(openai.BadRequestError) as caught:
        client.get(
            f"/responses/{response.id}", cast_to=httpx.Response, options={"params": {param: "1"}}
        )
    assert caught.value.body["param"] == param  # type: ignore[index]
