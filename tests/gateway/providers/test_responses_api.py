"""OpenAI's Responses API in, with the official ``openai`` SDK, through hosted adapters: text,
a function tool streamed and not, function_call_output follow-ups, usage, and the 400s for
what no backend honours (stored responses: test_stored_responses.py)."""

from __future__ import annotations

import json

import openai
import pytest

from .fake_common import TOOL_ARGUMENTS

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def client(hosted_gateway: tuple[str, str]) -> openai.OpenAI:
    url, key = hosted_gateway
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.mark.parametrize("model", ["anthropic-plain", "gemini-plain", "bedrock-plain"])
def test_text_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, instructions="be brief", input="say some words", max_output_tokens=3
    )
    assert response.output_text == "w0 w1 w2 "
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    events = list(
        client.responses.create(
            model=model, input="say some words", max_output_tokens=50, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "w0 w1 w2 w3 w4 "
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and final.usage is not None


@pytest.mark.parametrize("model", ["anthropic-plain", "gemini-plain", "bedrock-plain"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_tool_and_output_item(client: openai.OpenAI, model: str, stream: bool) -> None:
    kwargs = {
        "model": model,
        "input": "hello",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    if stream:
        with client.responses.stream(**kwargs) as events:  # type: ignore[arg-type]
            arguments = "".join(
                e.delta for e in events if e.type == "response.function_call_arguments.delta"
            )
            response = events.get_final_response()
        assert json.loads(arguments) == TOOL_ARGUMENTS
    else:
        response = client.responses.create(**kwargs)  # type: ignore[arg-type]
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == TOOL_ARGUMENTS
    follow = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "hello"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert follow.output_text.startswith("w0") and follow.status == "completed"


def test_fields_no_backend_honours_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as background:
        client.responses.create(model="anthropic-plain", input="hi", background=True)
    assert background.value.body["param"] == "background"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as hosted_tool:
        client.responses.create(
            model="anthropic-plain",
            input="hi",
            tools=[{"type": "web_search"}],  # type: ignore[list-item]
        )
    assert "tools[0]" in str(hosted_tool.value.body)


def test_an_unknown_previous_response_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(
            model="anthropic-plain", input="hi", previous_response_id="resp_earlier"
        )
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_json_schema_format_reaches_the_backend(
    client: openai.OpenAI, fakes: dict[str, tuple[object, str]]
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    client.responses.create(
        model="gemini-plain",
        input="hi",
        text={"format": {"type": "json_schema", "name": "thing", "schema": schema}},
    )
    config = fakes["gemini"][0].bodies[-1]["generationConfig"]  # type: ignore[attr-defined]
    assert config["responseMimeType"] == "application/json"
    assert config["responseJsonSchema"] == schema
