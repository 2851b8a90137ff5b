"""``--speculative-config`` on the worker: parsed as vLLM spells it, served token-exact, and
the acceptance rate in the heartbeat and the metrics."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from sluicegate.engine import LLM, SamplingParams, protocol
from sluicegate.engine.worker import build_parser, engine_kwargs
from tests.engine.worker.worker_harness import running_worker

# Repeats itself, so prompt lookup finds drafts; the tiny random model rejects most.
PROMPT = [5, 17, 42, 9, 100, 33] * 4
FLAG = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, '
    '"prompt_lookup_min": 1}'
)


def test_the_flag_reaches_the_engine_options_checked() -> None:
    args = build_parser().parse_args(["--model", "m", "--speculative-config", FLAG])
    config = engine_kwargs(args)["speculative_config"]
    assert (config["method"], config["num_speculative_tokens"]) == ("ngram", 3)
    assert (config["prompt_lookup_max"], config["prompt_lookup_min"]) == (3, 1)
    assert "speculative_config" not in engine_kwargs(build_parser().parse_args(["--model", "m"]))
    for bad in ['{"method": "medusa"}', '{"num_speculative_tokens": 4', '{"k": 4}']:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--model", "m", "--speculative-config", bad])


async def test_a_speculating_worker_serves_the_same_tokens_and_reports_acceptance(
    llama_dir: Path,
) -> None:
    want = LLM(str(llama_dir), num_kv_blocks=64).generate(
        PROMPT, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    )[0]
    sampling = protocol.Sampling(max_tokens=48, temperature=0, ignore_eos=True)
    args = build_parser().parse_args(["--model", "m", "--speculative-config", FLAG])
    async with running_worker(llama_dir, **engine_kwargs(args)) as worker:
        request_id = f"spec-{uuid.uuid4().hex[:8]}"  # reply streams outlive the worker
        await worker.send(protocol.Request(request_id, "m", sampling, prompt_token_ids=PROMPT))
        replies = await worker.replies(request_id)
        stats = worker.engine.stats()
        beat = worker.worker.heartbeat()
        exposition = worker.worker.metrics.exposition().decode()
    assert [t for r in replies for t in r.token_ids] == want.token_ids
    assert stats["spec_draft_tokens"] > 0
    assert beat.spec_acceptance_rate == stats["spec_acceptance_rate"]
    assert protocol.decode(protocol.encode(beat)) == beat
    drafted = f'sluicegate:spec_decode_num_draft_tokens_total{{model_name="{worker.model}"}}'
    assert f"{drafted} {float(stats['spec_draft_tokens'])}" in exposition
    assert "sluicegate:spec_decode_acceptance_rate" in exposition
