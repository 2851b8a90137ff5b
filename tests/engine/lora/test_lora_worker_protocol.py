"""The wire side of LoRA on one worker (in process, real Redis): ``Request.lora`` served with
the adapter, ``LoadLora``/``UnloadLora`` on the control stream answered with ``ControlReply``
(a failed load is ``ok=False`` with the reason, and the worker serves on), the heartbeat's
adapter fields; the engine core in a process of its own takes the same commands; a worker
with LoRA off answers ``invalid_request``, never the base model's tokens."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.worker import build_parser, engine_kwargs
from tests.engine.lora.adapters import make_adapter, peft_greedy
from tests.engine.worker.worker_harness import WorkerHarness, running_worker

PROMPT = [7, 19, 44, 3, 250, 31, 8, 77, 120]
TOKENS = 8


@pytest.fixture(scope="module")
def adapter_dirs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("worker-adapters")
    return {
        "a": make_adapter(llama_dir, root / "a", seed=11),
        "b": make_adapter(llama_dir, root / "b", seed=12, rank=4, targets=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def expected(llama_dir: Path, adapter_dirs: dict[str, Path]) -> dict[str | None, list[int]]:
    folders: dict[str | None, Path | None] = {None: None, **adapter_dirs}
    return {name: peft_greedy(llama_dir, f, [PROMPT], TOKENS)[0] for name, f in folders.items()}


async def command(worker: WorkerHarness, message: protocol.LoadLora | protocol.UnloadLora):
    await worker.redis.xadd(
        redis_names.control_stream(worker.model, worker.worker.options.worker_id),
        {redis_names.MESSAGE_FIELD: protocol.encode(message)},
    )
    async with asyncio.timeout(30):
        while True:
            reply = await worker.redis.xread({message.reply_to: "0-0"}, block=200)
            for _, entries in reply or []:
                answer = protocol.decode(entries[0][1][redis_names.MESSAGE_FIELD])
                assert isinstance(answer, protocol.ControlReply)
                return answer


async def generate(worker: WorkerHarness, lora: protocol.LoraAdapter | None) -> list[object]:
    request_id = f"lora-{uuid.uuid4().hex[:8]}"
    sampling = protocol.Sampling(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    await worker.send(
        protocol.Request(request_id, worker.model, sampling, prompt_token_ids=PROMPT, lora=lora)
    )
    return await worker.replies(request_id)


def tokens(replies: list[object]) -> list[int]:
    assert not [r for r in replies if isinstance(r, protocol.Error)], replies
    return [t for r in replies if isinstance(r, protocol.Delta) for t in r.token_ids]


@pytest.mark.parametrize("core_process", [False, True])
async def test_adapters_load_unload_and_serve_over_the_wire(
    llama_dir: Path,
    adapter_dirs: dict[str, Path],
    expected: dict[str | None, list[int]],
    core_process: bool,
) -> None:
    argv = ["--model", "m", "--max-loras", "2", "--max-lora-rank", "8"]
    argv += ["--lora-modules", f"a={adapter_dirs['a']}"]
    options = engine_kwargs(build_parser().parse_args(argv))
    async with running_worker(llama_dir, core_process=core_process, **options) as worker:
        beat = worker.worker.heartbeat()
        assert (beat.max_loras, beat.max_lora_rank, beat.loras) == (2, 8, ["a"])
        a = protocol.LoraAdapter("a", str(adapter_dirs["a"]))
        b = protocol.LoraAdapter("b", str(adapter_dirs["b"]))
        reply_to = f"sg:test:ctl-reply:{uuid.uuid4().hex[:8]}"
        answer = await command(worker, protocol.LoadLora(b, reply_to + "1"))
        assert answer.ok and answer.worker_id == "w1", answer
        assert worker.worker.heartbeat().loras == ["a", "b"]
        missing = protocol.LoraAdapter("c", "/nonexistent/adapter")
        answer = await command(worker, protocol.LoadLora(missing, reply_to + "2"))
        assert not answer.ok and "not found" in answer.message
        results = await asyncio.gather(
            generate(worker, a), generate(worker, b), generate(worker, None)
        )
        assert [tokens(r) for r in results] == [expected["a"], expected["b"], expected[None]]
        answer = await command(worker, protocol.UnloadLora("a", reply_to + "3"))
        assert answer.ok
        assert worker.worker.heartbeat().loras == ["b"]
        # Unloaded, it loads again from the request's own path.
        assert tokens(await generate(worker, a)) == expected["a"]
        assert worker.worker.heartbeat().loras == ["b", "a"]
        await worker.redis.delete(*(reply_to + str(i) for i in (1, 2, 3)))


async def test_a_worker_with_lora_off_answers_invalid_request(
    llama_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    async with running_worker(llama_dir) as worker:
        assert worker.worker.heartbeat().max_loras == 0
        replies = await generate(worker, protocol.LoraAdapter("a", str(adapter_dirs["a"])))
        errors = [r for r in replies if isinstance(r, protocol.Error)]
        assert len(errors) == 1 and errors[0].code == "invalid_request", replies
        assert not [r for r in replies if isinstance(r, protocol.Delta) and r.token_ids]
        reply_to = f"sg:test:ctl-reply:{uuid.uuid4().hex[:8]}"
        a = protocol.LoraAdapter("a", str(adapter_dirs["a"]))
        answer = await command(worker, protocol.LoadLora(a, reply_to))
        assert not answer.ok and "LoRA is off" in answer.message
        await worker.redis.delete(reply_to)
