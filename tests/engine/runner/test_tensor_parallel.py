"""Tensor parallelism over two gloo ranks on the CPU: the shard plan (uneven, replicated and
refused head layouts), greedy tokens equal to one rank's (and transformers') on the native
architectures, through
prefix caching, chunked prefill and preemption; and a worker whose rank dies fails its
request clearly and exits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import torch

from sluicegate.engine import LLM, SamplingParams, protocol, redis_names
from sluicegate.engine.models.config import ModelConfig
from sluicegate.engine.parallel.shard import ShardPlan, split_evenly
from sluicegate.engine.worker import build_parser, engine_kwargs
from tests.engine.models.greedy import transformers_greedy

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SETTINGS: dict[str, dict[str, Any]] = {
    "roomy": dict(num_kv_blocks=64),
    "busy": dict(num_kv_blocks=9, max_num_batched_tokens=16, enable_prefix_caching=True),
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=generator).tolist()

    shared = tokens(40)
    return [shared + tokens(9), tokens(5), shared + tokens(17), tokens(30), shared + tokens(1)]


def config(heads: int, kv_heads: int, intermediate: int = 64, vocab: int = 11) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=vocab, hidden_size=64,
        intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=8, rms_norm_eps=1e-6,
        max_position_embeddings=64, rope_theta=1e4, rope_scaling=None,
        tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
        hidden_act="silu", dtype=torch.float32,
    )  # fmt: skip


def test_split_evenly_covers_the_range_in_runs_differing_by_at_most_one() -> None:
    runs = [split_evenly(11, 3, i) for i in range(3)]
    assert runs == [range(0, 4), range(4, 8), range(8, 11)]


def test_smollm2s_three_kv_heads_split_unevenly_with_their_query_heads() -> None:
    plans = [ShardPlan.for_rank(config(9, 3), rank, 2) for rank in range(2)]
    assert [(p.kv_heads, p.q_heads) for p in plans] == [
        (range(0, 2), range(0, 6)),
        (range(2, 3), range(6, 9)),
    ]
    assert [p.vocab for p in plans] == [range(0, 6), range(6, 11)]


def test_fewer_kv_heads_than_ranks_are_replicated_and_bad_layouts_refused() -> None:
    plans = [ShardPlan.for_rank(config(8, 2), rank, 4) for rank in range(4)]
    assert [(p.kv_heads, p.q_heads) for p in plans] == [
        (range(0, 1), range(0, 2)),
        (range(0, 1), range(2, 4)),
        (range(1, 2), range(4, 6)),
        (range(1, 2), range(6, 8)),
    ]
    with pytest.raises(ValueError, match="cannot split 9 attention heads over 3 KV heads"):
        ShardPlan.for_rank(config(9, 3), 0, 4)


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """One rank's greedy tokens, checked here to be transformers' own."""
    from transformers import AutoModelForCausalLM

    tokens = {}
    for kind, folder in model_dirs.items():
        one = LLM(str(folder), dtype="float32", num_kv_blocks=64).generate(prompts(), GREEDY)
        tokens[kind] = [o.token_ids for o in one]
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert tokens[kind] == transformers_greedy(hf, prompts(), GREEDY.max_tokens)
    return tokens


@pytest.mark.parametrize("setting", ["roomy", "busy"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_two_ranks_give_one_ranks_greedy_tokens(
    model_dirs: dict[str, Path], reference: dict[str, list[list[int]]], kind: str, setting: str
) -> None:
    llm = LLM(str(model_dirs[kind]), dtype="float32", tensor_parallel_size=2,
              **SETTINGS[setting])  # fmt: skip
    try:
        outputs = llm.generate(prompts(), GREEDY)
        stats = llm.stats()
    finally:
        llm.close()
    assert [o.token_ids for o in outputs] == reference[kind]
    if setting == "busy":
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0


def test_the_flag_reaches_the_engine_options() -> None:
    args = build_parser().parse_args(["--model", "m", "--tensor-parallel-size", "2"])
    assert engine_kwargs(args)["tensor_parallel_size"] == 2


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rpartition(")")[2].split()[1])
        if parent == pid and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture
def tp_worker(llama_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    model = f"tp-{uuid.uuid4().hex[:8]}"
    log = (tmp_path / "worker.log").open("wb")
    argv = [
        sys.executable, "-m", "sluicegate.engine.worker", "--model", str(llama_dir),
        "--served-model-name", model, "--tensor-parallel-size", "2", "--num-kv-blocks", "64",
        "--dtype", "float32", "--metrics-port", "0",
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process, model
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        log.close()
        print((tmp_path / "worker.log").read_text()[-4000:])


async def test_a_dead_rank_fails_the_request_clearly_and_the_worker_exits(
    tp_worker: tuple[subprocess.Popen[bytes], str], llama_dir: Path
) -> None:
    process, model = tp_worker
    redis = aioredis.from_url("redis://127.0.0.1:6379/0")
    want = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64).generate(prompts()[1], GREEDY)

    async def ask() -> list[Any]:
        request_id = f"tp-{uuid.uuid4().hex[:8]}"
        sampling = protocol.Sampling(max_tokens=20, temperature=0, ignore_eos=True)
        request = protocol.Request(request_id, model, sampling, prompt_token_ids=prompts()[1])
        await redis.xadd(
            redis_names.request_stream(model), {redis_names.MESSAGE_FIELD: protocol.encode(request)}
        )
        stream, last, messages = redis_names.reply_stream(request_id), "0-0", []
        async with asyncio.timeout(120):
            while True:
                for _, entries in await redis.xread({stream: last}, block=200) or []:
                    for entry_id, fields in entries:
                        last = entry_id
                        message = protocol.decode(fields[redis_names.MESSAGE_FIELD])
                        batch = (
                            message.messages if isinstance(message, protocol.Batch) else [message]
                        )
                        messages.extend(batch)
                if any(isinstance(m, protocol.Error) or getattr(m, "finish_reason", None)
                       for m in messages):  # fmt: skip
                    return messages

    try:
        async with asyncio.timeout(180):
            while not await redis.zscore(redis_names.MODEL_REGISTRY, model):
                assert process.poll() is None, "the worker exited while starting"
                await asyncio.sleep(0.2)
        served = await ask()
        assert [t for m in served for t in m.token_ids] == want[0].token_ids
        (worker_id,) = await redis.smembers(redis_names.worker_registry(model))
        beat = protocol.decode(
            await redis.get(redis_names.heartbeat_key(model, worker_id.decode()))
        )
        assert isinstance(beat, protocol.Heartbeat)
        assert (beat.tensor_parallel_size, beat.weight_dtype, beat.kv_cache_dtype) == (
            2, "float32", "float32"
        )  # fmt: skip
        (rank,) = _children(process.pid)
        os.kill(rank, signal.SIGKILL)
        failed = await ask()
        errors = [m for m in failed if isinstance(m, protocol.Error)]
        assert errors and "tensor-parallel rank 1 exited" in errors[0].message
        exit_code = await asyncio.to_thread(process.wait, 60)
        assert exit_code != 0
    finally:
        await redis.aclose()
