"""Count-only requests over the wire: the prompt's tokens as a generation would render them
(chat template, tools), answered without scheduling or generating anything."""

from __future__ import annotations

from pathlib import Path

from sluicegate.engine import protocol

from .worker_harness import running_worker

TOOL = protocol.Tool(
    "get_weather",
    "A forecast",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
MESSAGES = [
    protocol.ChatMessage(role="system", content="You are a weather service."),
    protocol.ChatMessage(role="user", content="Weather in Paris?"),
]


def _request(request_id: str, *, count_only: bool, tools: bool) -> protocol.Request:
    return protocol.Request(
        request_id,
        "m",
        protocol.Sampling(max_tokens=2, temperature=0),
        messages=MESSAGES,
        tools=[TOOL] if tools else None,
        count_only=count_only,
    )


async def test_count_only_is_the_generations_prompt_and_runs_nothing(
    model_dirs: dict[str, Path],
) -> None:
    async with running_worker(model_dirs["qwen2"]) as worker:
        counts = {}
        for tools in (False, True):
            rid = f"count-{tools}"
            await worker.send(_request(rid, count_only=True, tools=tools))
            (reply,) = await worker.replies(rid)
            assert isinstance(reply, protocol.Delta)
            assert (reply.seq, reply.finish_reason, reply.token_ids, reply.text) == (
                0,
                "stop",
                [],
                "",
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 0
            counts[tools] = reply.usage.prompt_tokens
        assert worker.engine.core is not None
        stats = worker.engine.core.stats()
        # Nothing reached the scheduler: no prompt looked up in the prefix cache, no token made.
        assert stats["prefix_cache_queries"] == 0 and stats["num_generated_tokens"] == 0
        assert 0 < counts[False] < counts[True], "the tools are rendered into the prompt"

        await worker.send(_request("generated", count_only=False, tools=True))
        replies = await worker.replies("generated")
        usage = replies[-1].usage
        assert usage is not None and usage.completion_tokens > 0
        assert usage.prompt_tokens == counts[True]


async def test_a_count_only_request_without_a_prompt_is_an_invalid_request(
    llama_dir: Path,
) -> None:
    async with running_worker(llama_dir) as worker:
        await worker.send(protocol.Request("empty", "m", count_only=True))
        (reply,) = await worker.replies("empty")
    assert isinstance(reply, protocol.Error) and reply.code == "invalid_request"
