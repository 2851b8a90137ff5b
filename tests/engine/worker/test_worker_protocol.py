"""The worker speaks protocol v3 and still serves version-2 requests unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema

from sluicegate.engine import LLM, SamplingParams, protocol
from sluicegate.engine.worker import build_parser, engine_kwargs
from tests.engine.worker.worker_harness import running_worker

PROMPT = [5, 17, 42, 9, 100, 33]


async def test_a_version_2_request_is_served_as_before(llama_dir: Path) -> None:
    want = LLM(str(llama_dir), num_kv_blocks=64).generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )[0]
    sampling = protocol.Sampling(max_tokens=8, temperature=0, ignore_eos=True)
    async with running_worker(llama_dir) as worker:
        await worker.send(protocol.Request("v2", "m", sampling, prompt_token_ids=PROMPT, v=2))
        replies = await worker.replies("v2")
    assert all(isinstance(r, protocol.Delta) for r in replies)
    assert [t for r in replies for t in r.token_ids] == want.token_ids
    assert "".join(r.text for r in replies) == want.text
    assert replies[-1].finish_reason == "length"
    assert all(r.index == 0 and not r.tool_calls and not r.logprobs for r in replies)


async def test_logit_bias_forces_a_token(llama_dir: Path) -> None:
    sampling = protocol.Sampling(max_tokens=4, temperature=0, ignore_eos=True, logit_bias={77: 100})
    async with running_worker(llama_dir) as worker:
        await worker.send(protocol.Request("bias", "m", sampling, prompt_token_ids=PROMPT))
        replies = await worker.replies("bias")
    assert [t for r in replies for t in r.token_ids] == [77] * 4


async def test_an_out_of_vocabulary_logit_bias_is_an_invalid_request(llama_dir: Path) -> None:
    sampling = protocol.Sampling(max_tokens=4, logit_bias={10**6: 1.0})
    async with running_worker(llama_dir) as worker:
        await worker.send(protocol.Request("bad", "m", sampling, prompt_token_ids=PROMPT))
        replies = await worker.replies("bad")
    assert isinstance(replies[-1], protocol.Error)
    assert replies[-1].code == "invalid_request" and "logit_bias" in replies[-1].message


TOOL = protocol.Tool(
    name="pick",
    parameters={
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"enum": [1, 2, 3]}},
        "required": ["color", "n"],
        "additionalProperties": False,
    },
)


async def test_tool_calls_n_choices_and_logprobs_over_the_wire(
    model_dirs: dict[str, Path],
) -> None:
    request = protocol.Request(
        "tools",
        "m",
        protocol.Sampling(max_tokens=140, temperature=1.0, seed=9, logprobs=2),
        messages=[protocol.ChatMessage(role="user", content="pick one")],
        n=2,
        tools=[TOOL],
        tool_choice="function",
        tool_choice_name="pick",
    )
    async with running_worker(model_dirs["qwen2"]) as worker:
        await worker.send(request)
        replies = await worker.replies("tools")
    assert all(isinstance(r, protocol.Delta) for r in replies)
    assert [r.seq for r in replies] == list(range(len(replies)))
    for index in (0, 1):
        deltas = [r for r in replies if r.index == index]
        assert all(r.text == "" for r in deltas), "no markup in the content"
        fragments = [f for r in deltas for f in r.tool_calls]
        assert fragments[0].id and fragments[0].id.startswith("call_")
        assert fragments[0].name == "pick"
        arguments = json.loads("".join(f.arguments for f in fragments))
        jsonschema.validate(arguments, TOOL.parameters or {})
        assert deltas[-1].finish_reason == "tool_calls"
        entries = [e for r in deltas for e in r.logprobs]
        assert len(entries) == sum(len(r.token_ids) for r in deltas)
        assert all(len(e.top) == 2 and e.logprob <= 0 for e in entries)
    usage = replies[-1].usage
    assert usage is not None
    assert usage.completion_tokens == sum(len(r.token_ids) for r in replies)
    assert usage.prompt_tokens == replies[0].usage.prompt_tokens  # type: ignore[union-attr]


async def test_structured_output_and_its_errors_over_the_wire(
    model_dirs: dict[str, Path],
) -> None:
    schema = json.dumps(TOOL.parameters)
    good = protocol.Request(
        "json",
        "m",
        protocol.Sampling(max_tokens=60, temperature=0),
        messages=[protocol.ChatMessage(role="user", content="json please")],
        structured=protocol.Structured(kind="json_schema", json_schema=schema, strict=True),
    )
    bad = protocol.Request(
        "bad-grammar",
        "m",
        prompt="x",
        structured=protocol.Structured(kind="grammar", grammar="root ::= "),
    )
    unknown = protocol.Request(
        "bad-tool", "m", prompt="x", tools=[TOOL], tool_choice="function", tool_choice_name="nope"
    )
    async with running_worker(model_dirs["qwen2"]) as worker:
        for request in (good, bad, unknown):
            await worker.send(request)
        replies = await worker.replies("json")
        bad_reply = await worker.replies("bad-grammar")
        unknown_reply = await worker.replies("bad-tool")
    jsonschema.validate(json.loads("".join(r.text for r in replies)), TOOL.parameters or {})
    assert replies[-1].finish_reason == "stop"
    for reply, field in ((bad_reply, "guided_grammar"), (unknown_reply, "tool_choice")):
        assert isinstance(reply[-1], protocol.Error)
        assert reply[-1].code == "invalid_request" and field in reply[-1].message


def test_tool_parser_flag_reaches_the_engine_options() -> None:
    args = build_parser().parse_args(["--model", "m", "--tool-parser", "llama3_json"])
    assert engine_kwargs(args)["tool_parser"] == "llama3_json"
    assert "tool_parser" not in engine_kwargs(build_parser().parse_args(["--model", "m"]))


def test_cpu_linears_flag_reaches_the_engine_options() -> None:
    args = build_parser().parse_args(["--model", "m", "--cpu-linears", "onednn"])
    assert engine_kwargs(args)["cpu_linears"] == "onednn"
    assert "cpu_linears" not in engine_kwargs(build_parser().parse_args(["--model", "m"]))
