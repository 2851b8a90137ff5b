"""The worker speaks protocol v3 and still serves version-2 requests unchanged."""

from __future__ import annotations

from pathlib import Path

from engine import LLM, SamplingParams, protocol
from tests.engine.worker_harness import running_worker

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
