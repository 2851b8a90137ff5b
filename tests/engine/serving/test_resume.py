"""A resumed request (an earlier attempt's outputs handed back) continues exactly as the
uninterrupted request: the same tokens for greedy and seeded sampling, text that joins the
delivered part with no gap or repeat, and max_tokens counting the earlier outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine import AsyncEngine, SamplingParams
from sluicegate.engine.serving.async_engine import RequestDelta

PROMPT = "Héllo wörld, naïve café"


async def _run(engine: AsyncEngine, rid: str, params: SamplingParams, **kw) -> list[RequestDelta]:
    return [d async for d in engine.add_request(rid, prompt=PROMPT, params=params, **kw)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=40, temperature=0.8, seed=11, frequency_penalty=1.0, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded", "seeded-penalised"],
)
async def test_resumed_request_continues_the_uninterrupted_one(
    llama_dir: Path, params: SamplingParams
) -> None:
    async with AsyncEngine(llama_dir, num_kv_blocks=128) as engine:
        whole = await _run(engine, "whole", params)
        tokens = [t for d in whole for t in d.token_ids]
        assert len(tokens) == 40
        for cut in range(1, 40, 3):
            # The client saw the text of every delta up to the one holding token ``cut``.
            seen_tokens, shown = 0, ""
            for delta in whole:
                if seen_tokens >= cut:
                    break
                seen_tokens += len(delta.token_ids)
                shown += delta.text
            rest = await _run(
                engine, f"resume-{cut}", params, resume_token_ids=tokens[:seen_tokens]
            )
            assert [t for d in rest for t in d.token_ids] == tokens[seen_tokens:]
            assert shown + "".join(d.text for d in rest) == "".join(d.text for d in whole)
            last = rest[-1]
            assert last.finish_reason == "length"
            assert last.usage is not None
            assert last.usage.completion_tokens == 40
            assert last.usage.prompt_tokens == whole[-1].usage.prompt_tokens


async def test_resume_rejects_token_ids_outside_the_vocabulary(llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=4, temperature=0)
    async with AsyncEngine(llama_dir, num_kv_blocks=128) as engine:
        with pytest.raises(ValueError, match="resume token ids"):
            await _run(engine, "bad", params, resume_token_ids=[10**6])
