"""The engine core in a process of its own (``AsyncEngine(core_process=True)``, the worker's
``--core-process``): over the wire it answers exactly as the in-process core does — tools, n > 1,
seeded sampling, logprobs, structured output and its errors — and a core that dies fails
the requests in flight at once and stops the worker with a non-zero exit, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import redis

from sluicegate.engine import LLM, SamplingParams, protocol, redis_names
from sluicegate.engine.serving.async_engine import AsyncEngine, EngineStopped
from tests.engine.worker.worker_harness import REDIS_URL, WorkerHarness, running_worker

TOOL = protocol.Tool(
    name="pick",
    parameters={
        "type": "object",
        "properties": {"color": {"enum": ["red", "blue"]}, "n": {"enum": [1, 2, 3]}},
        "required": ["color", "n"],
        "additionalProperties": False,
    },
)
CHAT = [protocol.ChatMessage(role="user", content="pick one")]
REQUESTS = [
    protocol.Request(
        "tools",
        "m",
        protocol.Sampling(max_tokens=60, temperature=1.0, seed=9, logprobs=2),
        messages=CHAT,
        n=2,
        tools=[TOOL],
        tool_choice="function",
        tool_choice_name="pick",
    ),
    protocol.Request(
        "json",
        "m",
        protocol.Sampling(max_tokens=40, temperature=0),
        messages=CHAT,
        structured=protocol.Structured(kind="json_schema", json_schema='{"type": "object"}'),
    ),
    protocol.Request(
        "bad-grammar",
        "m",
        prompt="x",
        structured=protocol.Structured(kind="grammar", grammar="root ::= "),
    ),
    protocol.Request("too-long", "m", prompt_token_ids=[5] * 5000),
    protocol.Request("count", "m", messages=CHAT, tools=[TOOL], count_only=True),
]


def _comparable(replies: list[object]) -> list[tuple[object, ...]]:
    out: list[tuple[object, ...]] = []
    for r in replies:
        if isinstance(r, protocol.Delta):
            # Tool-call ids are random: only whether a fragment carries one is compared.
            calls = [msgspec.structs.replace(c, id=c.id and "call") for c in r.tool_calls]
            # Logprobs to 3 places: which requests share a step moves the last float bits.
            logprobs = [
                (e.token, round(e.logprob, 3), [t.token for t in e.top]) for e in r.logprobs
            ]
            usage = (r.usage.prompt_tokens, r.usage.completion_tokens) if r.usage else None
            out.append((r.index, r.token_ids, r.text, calls, logprobs, r.finish_reason, usage))
        elif isinstance(r, protocol.Error):
            out.append((r.code, re.sub(r"\[\d\d:\d\d:\d\d\] ", "", r.message)))  # xgrammar's clock
    return sorted(out, key=repr)


async def _serve_all(worker: WorkerHarness) -> dict[str, list[tuple[object, ...]]]:
    # Reply streams are named by request id: ids of their own keep the runs apart.
    run = uuid.uuid4().hex[:8]
    requests = [msgspec.structs.replace(r, request_id=f"{run}-{r.request_id}") for r in REQUESTS]
    for request in requests:
        await worker.send(request)
    replies = {r.request_id: await worker.replies(r.request_id) for r in requests}
    await worker.redis.delete(*(redis_names.reply_stream(rid) for rid in replies))
    return {rid.split("-", 1)[1]: _comparable(got) for rid, got in replies.items()}


async def test_a_core_process_answers_as_the_in_process_core(model_dirs: dict[str, Path]) -> None:
    async with running_worker(model_dirs["qwen2"], core_process=False) as worker:
        want = await _serve_all(worker)
    async with running_worker(model_dirs["qwen2"], core_process=True) as worker:
        got = await _serve_all(worker)
    assert got == want
    assert {i for i, *_ in want["tools"]} == {0, 1}
    assert want["bad-grammar"][0][0] == "invalid_request"
    assert want["too-long"][0][0] == "context_length_exceeded"
    ((*_, (prompt_tokens, completion_tokens)),) = want["count"]
    assert prompt_tokens > 0 and completion_tokens == 0


async def test_a_dead_core_fails_requests_in_flight(llama_dir: Path) -> None:
    engine = AsyncEngine(llama_dir, num_kv_blocks=128, core_process=True)
    await engine.start()
    params = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    stream = engine.add_request("long", prompt_token_ids=[5, 6, 7], params=params)
    await stream.__anext__()
    assert engine._client is not None
    os.kill(engine._client.process.pid, signal.SIGKILL)
    with pytest.raises(EngineStopped, match="exit code -9"):
        async with asyncio.timeout(10):
            async for _ in stream:
                pass
    assert engine.failed.is_set()
    assert not engine.can_accept()
    with pytest.raises(EngineStopped):
        engine.add_request("late", "hi")
    await engine.shutdown()


def _core_pid(worker_pid: int) -> int:
    """The worker's spawned core (its other child is multiprocessing's resource tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    cores = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return int(cores[0])


@contextlib.contextmanager
def _worker_process(
    model_dir: Path, log_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], list[str], str]]:
    """``python -m sluicegate.engine.worker --core-process`` on the real Redis, ready, serving long
    requests, the first of which has streamed its first delta; yields the process, the ids of
    the requests sent and the worker's heartbeat key."""
    model = f"test-core-{uuid.uuid4().hex[:10]}"
    rid = f"{model}-long"
    rids = [f"{rid}-{i}" for i in range(48)]
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    client = redis.Redis.from_url(REDIS_URL)
    with log_path.open("w") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "sluicegate.engine.worker", "--model", str(model_dir),
             "--served-model-name", model, "--redis-url", REDIS_URL,
             "--metrics-port", str(port), "--metrics-host", "127.0.0.1",
             "--num-kv-blocks", "128", "--device", "cpu", "--dtype", "float32", "--core-process"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        _wait_ready(port, worker, log_path)
        sampling = protocol.Sampling(max_tokens=1000, temperature=0, ignore_eos=True)
        # Forty-eight long requests, a KV cache that holds two whole at a time: the core is
        # still stepping seconds later, when the test has seen a heartbeat (one a second)
        # and kills it. Twelve were all over within that second on a fast machine (the core
        # runs ahead of the deltas it sent). Their prompts
        # differ: identical greedy requests would share their cached blocks.
        for index, request_id in enumerate(rids):
            request = protocol.Request(request_id, model, sampling, prompt_token_ids=[5, 6 + index])
            client.xadd(
                redis_names.request_stream(model),
                {redis_names.MESSAGE_FIELD: protocol.encode(request)},
            )
        _read(client, rids[0], until=lambda m: isinstance(m, protocol.Delta))
        yield worker, rids, redis_names.heartbeat_key(model, f"{socket.gethostname()}-{worker.pid}")
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        client.delete(*client.scan_iter(f"*{model}*"), *(redis_names.reply_stream(r) for r in rids))
        client.close()


def test_the_worker_exits_non_zero_when_its_core_dies(llama_dir: Path, tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    with _worker_process(llama_dir, log_path) as (worker, rids, heartbeat_key):
        client = redis.Redis.from_url(REDIS_URL)
        # The core's scheduler stats reach the heartbeat across the process boundary.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            beat = protocol.decode(client.get(heartbeat_key) or b"")
            assert isinstance(beat, protocol.Heartbeat)
            if beat.num_running >= 1:
                break
            time.sleep(0.1)
        assert beat.num_running >= 1 and beat.kv_blocks_used > 0 and 0 < beat.kv_usage <= 1
        os.kill(_core_pid(worker.pid), signal.SIGKILL)
        assert worker.wait(30) == 1, log_path.read_text()
        # Each request the worker had taken and not finished was failed as lost. Those it had
        # not pulled yet (it pulls only what the engine has room for; a loaded machine pulls
        # later) have no replies: they wait in the stream for another worker.
        replies = {rid: _replies(client, rid) for rid in rids}
        client.close()
        lost = {rid: messages[-1] for rid, messages in replies.items() if _unfinished(messages)}
        assert lost, "no request was in flight when the core died"
        for rid, last in lost.items():
            assert isinstance(last, protocol.Error), (rid, last)
            assert last.code == "worker_lost", (rid, last)
            assert "exit code -9" in last.message, (rid, last)


def test_a_core_never_outlives_its_worker(llama_dir: Path, tmp_path: Path) -> None:
    with _worker_process(llama_dir, tmp_path / "worker.log") as (worker, _, _):
        core = _core_pid(worker.pid)
        worker.kill()  # mid-generation: the core is stepping
        worker.wait()
        deadline = time.monotonic() + 15
        while _alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(core), "the engine core kept running without its worker"


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its new parent to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _replies(client: redis.Redis, request_id: str) -> list[object]:
    """Every reply of the request so far, in order (a batch's messages one by one)."""
    messages: list[object] = []
    for _, fields in client.xrange(redis_names.reply_stream(request_id)):
        message = protocol.decode(fields[redis_names.MESSAGE_FIELD])
        messages.extend(message.messages if isinstance(message, protocol.Batch) else [message])
    return messages


def _unfinished(messages: list[object]) -> bool:
    """Replies of a request that was taken and not answered in full (one choice each here)."""
    return bool(messages) and not any(
        isinstance(m, protocol.Delta) and m.finish_reason is not None for m in messages
    )


def _read(client: redis.Redis, request_id: str, until: Callable[[object], bool]) -> list[object]:
    """Every reply of the request so far, up to the first that ``until`` accepts (60 s)."""
    messages: list[object] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        messages = _replies(client, request_id)
        if any(until(m) for m in messages):
            return messages
        time.sleep(0.05)
    raise AssertionError(f"no such reply in 60 s: {messages[-3:]}")


def _core_pid(worker_pid: int) -> int:
    """The worker's spawned core (its other child is multiprocessing's resource tracker)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    cores = [c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return int(cores[0])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(port: int, worker: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert worker.poll() is None, f"worker exited early:\n{log.read_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health/ready", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"worker not ready:\n{log.read_text()}")


def test_llm_with_a_core_process_generates_as_in_process(llama_dir: Path) -> None:
    prompts: list[str | list[int]] = ["hello there", [5, 17, 42, 9], "a much longer prompt " * 6]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.8, seed=5, stop=["e"]),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    ]
    chat = [{"role": "user", "content": "hi"}]
    local = LLM(str(llama_dir), num_kv_blocks=128)
    want = local.generate(prompts, params), local.chat(chat, params[2])
    remote = LLM(str(llama_dir), num_kv_blocks=128, core_process=True)
    try:
        got = remote.generate(prompts, params), remote.chat(chat, params[2])
        with pytest.raises(ValueError, match="exceeds"):
            remote.generate([[5] * 5000, "fine"], params[2])
        assert remote.stats()["num_running"] == 0 and remote.stats()["kv_blocks_used"] == 0
        again = remote.generate(prompts[:1], params[0])
    finally:
        remote.close()
    for a, b in zip([*want[0], *want[1]], [*got[0], *got[1]], strict=True):
        assert (a.prompt_token_ids, a.token_ids, a.text, a.finish_reason) == (
            b.prompt_token_ids,
            b.token_ids,
            b.text,
            b.finish_reason,
        )
        assert [x.token_id for x in a.logprobs or []] == [x.token_id for x in b.logprobs or []]
    assert again[0].token_ids == want[0][0].token_ids
