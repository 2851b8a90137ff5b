"""The Responses API drops none of a client's fields: each is honoured (and reaches the
backend) or is a 400 in OpenAI's shape whose ``param`` is the field's JSON path."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from sluicegate.gateway.canonical import ImagePart, ToolResult
from sluicegate.gateway.schemas.responses import ResponsesRequest
from sluicegate.gateway.translate.responses_in import canonical

from .servers import Upstream

PIXEL = "data:image/png;base64,iVBORw0KGgo="
CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}


@pytest.fixture(scope="module")
def client(gateway: str, make_key: Callable[..., str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=make_key(), max_retries=0)


def _refused(client: openai.OpenAI, **body: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="echo", **body)
    error: dict[str, Any] = caught.value.body  # type: ignore[assignment]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("name", ["summary", "generate_summary"])
def test_a_reasoning_summary_is_refused(client: openai.OpenAI, name: str) -> None:
    error = _refused(client, input="hi", reasoning={"effort": "low", name: "auto"})
    assert error["param"] == f"reasoning.{name}"


def test_encrypted_reasoning_is_refused(client: openai.OpenAI) -> None:
    reasoning = {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA..."}
    error = _refused(client, input=[{"role": "user", "content": "hi"}, reasoning, CALL])
    assert error["param"] == "input[1].encrypted_content"


def test_a_deferred_tool_is_refused(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    error = _refused(client, input="hi", tools=[tool, {**tool, "defer_loading": True}])
    assert error["param"] == "tools[1].defer_loading"
    loaded = client.responses.create(
        model="echo",
        input="hi",
        tools=[{**tool, "defer_loading": False}],  # type: ignore[list-item]
    )
    assert loaded.status == "completed"


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "x"}]}], "input[1]"),
        ([{"type": "reasoning", "summary": []}, {"role": "user", "content": "more"}], "input[1]"),
    ],
    ids=["last", "before-a-user-turn"],
)
def test_reasoning_with_no_assistant_output_after_it_is_refused(
    client: openai.OpenAI, items: list[dict[str, Any]], param: str
) -> None:
    error = _refused(client, input=[{"role": "user", "content": "hi"}, *items])
    assert error["param"] == param


def test_a_tool_output_image_by_file_id_is_refused(client: openai.OpenAI) -> None:
    output = [{"type": "input_text", "text": "see"}, {"type": "input_image", "file_id": "f-1"}]
    items = [CALL, {"type": "function_call_output", "call_id": "c1", "output": output}]
    error = _refused(client, input=[{"role": "user", "content": "hi"}, *items])
    assert error["param"] == "input[2].output[1]"


def test_image_detail_original_reaches_the_backend(
    client: openai.OpenAI, upstream: tuple[Upstream, str]
) -> None:
    image = {"type": "input_image", "image_url": PIXEL, "detail": "original"}
    client.responses.create(
        model="echo",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "what?"}, image]}],
    )
    (message,) = upstream[0].last_body("echo")["messages"]
    assert message["content"][1]["image_url"] == {"url": PIXEL, "detail": "original"}


def test_reasoning_goes_with_the_assistant_output_right_after_it() -> None:
    def turns(items: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
        body = ResponsesRequest(model="m", input=[{"role": "user", "content": "hi"}, *items])
        return [(m.role, m.reasoning) for m in canonical(body).messages or ()]

    think = {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "t"}],
    }
    second = {**CALL, "call_id": "c2"}
    # A reasoning item between two calls starts a turn of its own, so its thinking stays
    # before the call it led to.
    assert turns([think, CALL, {**think, "content": []}, second]) == [
        ("user", None),
        ("assistant", "t"),
        ("assistant", None),
    ]
    assert turns([CALL, second]) == [("user", None), ("assistant", None)]
    output = [{"type": "input_image", "image_url": PIXEL, "detail": "low"}]
    body = ResponsesRequest(
        model="m",
        input=[CALL, {"type": "function_call_output", "call_id": "c1", "output": output}],
    )
    tool = canonical(body).messages[-1].parts[0]  # type: ignore[index]
    assert isinstance(tool, ToolResult) and tool.content == [ImagePart(PIXEL, "low")]


@pytest.mark.parametrize(
    "options", [None, {"include_obfuscation": True}, {"include_obfuscation": False}]
)
def test_stream_obfuscation_pads_each_delta_unless_turned_off(
    gateway: str, make_key: Callable[..., str], options: dict[str, bool] | None
) -> None:
    body: dict[str, Any] = {"model": "echo", "input": "say some words", "stream": True}
    if options is not None:
        body["stream_options"] = options
    headers = {"authorization": f"Bearer {make_key()}"}
    with httpx.stream("POST", f"{gateway}/v1/responses", json=body, headers=headers) as response:
        assert response.status_code == 200
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    deltas = [e for e in events if e["type"].endswith(".delta")]
    assert deltas, events
    for event in deltas:
        if options == {"include_obfuscation": False}:
            assert "obfuscation" not in event
        else:
            padded = len(event["delta"].encode()) + len(event["obfuscation"])
            assert padded % 32 == 0 and event["obfuscation"]
