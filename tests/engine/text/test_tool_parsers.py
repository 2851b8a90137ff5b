"""Tool-call and reasoning parsers: however the text is split, the pieces assemble to the same
content and calls, and no markup reaches the content."""

from __future__ import annotations

import json

import pytest

from sluicegate.engine.protocol import ToolCall
from sluicegate.engine.text.choice_output import ChoiceOutput
from sluicegate.engine.text.reasoning import ReasoningSplitter
from sluicegate.engine.text.tool_parsers import (
    ParsedOutput,
    ToolCallParser,
    detect_tool_parser,
    make_tool_parser,
)

HERMES = (
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": {"a": [1, 2]}}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
LLAMA = '{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"y": "a;b}"}}'


def run(parser: ToolCallParser, text: str, step: int) -> tuple[str, list[ToolCall]]:
    outputs = [parser.feed(text[i : i + step]) for i in range(0, len(text), step)]
    return assemble([*outputs, parser.finish()])


def assemble(outputs: list[ParsedOutput]) -> tuple[str, list[ToolCall]]:
    content = ""
    calls: list[ToolCall] = []
    for out in outputs:
        content += out.content
        for fragment in out.tool_calls:
            if fragment.id is not None:
                assert fragment.id.startswith("call_") and fragment.index == len(calls)
                calls.append(ToolCall(fragment.id, fragment.name or "", ""))
            calls[fragment.index].arguments += fragment.arguments
    return content, calls


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, 1000])
def test_hermes_calls_stream_in_any_split(step: int) -> None:
    content, calls = run(make_tool_parser("hermes"), HERMES, step)
    assert content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "n": {"a": [1, 2]}}),
        ("get_time", {}),
    ]
    assert calls[0].arguments == '{"city": "Paris", "n": {"a": [1, 2]}}'


def test_hermes_streams_the_name_before_the_arguments_are_complete() -> None:
    parser = make_tool_parser("hermes")
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert (first.tool_calls[0].name, first.tool_calls[0].arguments) == ("get_weather", "")
    assert "".join(f.arguments for f in first.tool_calls) == '{"ci'
    assert first.content == ""


def test_hermes_text_that_only_resembles_markup_is_content() -> None:
    content, calls = run(make_tool_parser("hermes"), "a <tool b <tool_cal", 1)
    assert (content, calls) == ("a <tool b <tool_cal", [])


def test_hermes_call_cut_short_keeps_no_partial_end_tag() -> None:
    parser = make_tool_parser("hermes")
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c'
    _, calls = assemble([parser.feed(text), parser.finish()])
    assert calls[0].arguments == '{"a": 1}'


def test_hermes_keys_in_another_order_still_give_one_call() -> None:
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    _, calls = run(make_tool_parser("hermes"), text, 4)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_llama3_json_calls(step: int) -> None:
    content, calls = run(make_tool_parser("llama3_json"), LLAMA, step)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"x": 1}),
        ("g", {"y": "a;b}"}),
    ]


def test_llama3_python_tag_and_plain_answers() -> None:
    tagged = '<|python_tag|>{"name": "f", "parameters": {}}'
    assert run(make_tool_parser("llama3_json"), tagged, 3)[1][0].name == "f"
    assert run(make_tool_parser("llama3_json"), "Hello there", 2) == ("Hello there", [])
    assert run(make_tool_parser("llama3_json"), "{not a call", 2) == ("{not a call", [])


def test_parser_detection_and_unknown_names() -> None:
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("... <|python_tag|> ...") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown tool parser"):
        make_tool_parser("nope")


@pytest.mark.parametrize("step", [1, 2, 7, 100])
def test_reasoning_is_split_from_the_answer(step: int) -> None:
    text = "<think>\nlet me see</think>\n\nThe answer."
    splitter = ReasoningSplitter(in_reasoning=False)
    parts = [splitter.feed(text[i : i + step]) for i in range(0, len(text), step)]
    parts.append(splitter.finish())
    assert "".join(r for r, _ in parts) == "let me see"
    assert "".join(a for _, a in parts) == "The answer."


def test_reasoning_opened_by_the_prompt_and_answers_without_thinking() -> None:
    opened = ReasoningSplitter(in_reasoning=True)
    parts = [opened.feed("abc</th"), opened.feed("ink>ok"), opened.finish()]
    assert parts == [("abc", ""), ("", "ok"), ("", "")]
    plain = ReasoningSplitter(in_reasoning=False)
    assert [plain.feed("plain"), plain.finish()] == [("", "plain"), ("", "")]


def test_parallel_tool_calls_false_keeps_only_the_first_call() -> None:
    output = ChoiceOutput(None, make_tool_parser("hermes"), parallel_tool_calls=False)
    parts = [output.feed(HERMES[:40]), output.feed(HERMES[40:]), output.finish()]
    fragments = [f for part in parts for f in part.tool_calls]
    assert {f.index for f in fragments} == {0}
    assert [f.name for f in fragments if f.id] == ["get_weather"]


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_hermes_end_tag_inside_a_string_argument_is_text(step: int) -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"s": "a</tool_call>\\"b"}}\n</tool_call>'
    content, calls = run(make_tool_parser("hermes"), text, step)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"s": 'a</tool_call>"b'})]
