"""Speculative decoding end to end on the tiny models: greedy outputs equal those without
speculation, whatever share of the drafts is right, through prefix caching, chunked
prefill and preemption; stops and max_tokens are exact; the KV cache ends in the same state.

A random tiny model never copies its prompt, so n-gram drafts are almost always rejected.
Besides prompt lookup itself, the tests therefore also use an oracle that proposes the
reference continuation (every draft accepted: a draft model equal to the target) and one
that spoils some of those drafts (accepted up to a rejection somewhere in the middle)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.core.block_manager import blocks_for
from sluicegate.engine.protocol import Structured
from sluicegate.engine.serving import speculation
from sluicegate.engine.serving.request_options import RequestOptions

NEW_TOKENS = 40
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# Speculate in every step of these small runs, however many sequences run.
SPEC: dict[str, Any] = {
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": 64,
}
Proposer = Callable[[list[int], int, int, int], list[int]]


def prompts() -> list[list[int]]:
    """Prompts that repeat themselves (lookup finds drafts) and plain random ones, some
    behind a shared 40-token prefix (prefix-cache hits)."""
    generator = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=generator).tolist()

    shared = tokens(40)
    repeated = tokens(24)
    return [
        repeated * 3,
        shared + tokens(9),
        shared + tokens(17),
        tokens(5),
        tokens(33) + repeated[:12] + tokens(3) + repeated[:6],
        shared + tokens(1),
    ]


def oracle(references: dict[tuple[int, ...], list[int]], spoil: bool) -> Proposer:
    """Proposes the reference continuation of whichever prompt the tokens start with; with
    ``spoil``, one draft in most proposals is wrong (where depends on the position)."""

    def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        for prompt, reference in references.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = reference[done : done + k]
                if spoil and drafts and done % 4:
                    at = done % len(drafts)
                    drafts[at] = (drafts[at] + 1) % 256
                return drafts
        raise AssertionError("tokens of an unknown prompt")

    return propose


def run(
    model: Path, prompt_list: list[list[int]], params: SamplingParams = GREEDY, **options: Any
) -> tuple[list[Any], dict[str, Any], LLM]:
    llm = LLM(str(model), device="cpu", dtype="float32", **options)
    outputs = llm.generate(prompt_list, params)
    return outputs, llm.stats(), llm


@pytest.fixture(scope="module")
def reference(model_dirs: dict[str, Path]) -> Callable[[str], list[list[int]]]:
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            outputs, _, _ = run(model_dirs[kind], prompts(), num_kv_blocks=64)
            cache[kind] = [o.token_ids for o in outputs]
        return cache[kind]

    return get


@pytest.fixture
def use_proposer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Proposer], None]]:
    yield lambda proposer: monkeypatch.setattr(speculation, "propose_ngram", proposer)


SETTINGS = {
    "roomy": dict(num_kv_blocks=64),
    # 16-token chunks, the shared prefix from the cache, and 9 blocks for six requests of
    # up to 4-8 blocks each: some are preempted and recomputed, drafts and all.
    "busy": dict(num_kv_blocks=9, max_num_batched_tokens=16, enable_prefix_caching=True),
    # Steps overlap (as on CUDA) except where they speculate.
    "async": dict(num_kv_blocks=64, async_scheduling=True),
}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("drafts", ["ngram", "oracle", "spoiled"])
@pytest.mark.parametrize("setting", ["roomy", "busy", "async"])
def test_greedy_outputs_equal_those_without_speculation(
    model_dirs: dict[str, Path],
    reference: Callable[[str], list[list[int]]],
    use_proposer: Callable[[Proposer], None],
    kind: str,
    drafts: str,
    setting: str,
) -> None:
    want = reference(kind)
    if drafts != "ngram":
        use_proposer(
            oracle(dict(zip(map(tuple, prompts()), want, strict=True)), drafts == "spoiled")
        )
    outputs, stats, _ = run(
        model_dirs[kind], prompts(), speculative_config=SPEC, **SETTINGS[setting]
    )
    assert [o.token_ids for o in outputs] == want
    assert all(o.finish_reason == "length" for o in outputs)
    assert stats["spec_draft_tokens"] > 0
    if drafts == "oracle":
        assert stats["spec_acceptance_rate"] == 1.0
    elif drafts == "spoiled":
        assert 0.2 < stats["spec_acceptance_rate"] < 0.9
    if setting == "busy":
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0


def test_the_kv_cache_ends_as_without_speculation(
    model_dirs: dict[str, Path],
    reference: Callable[[str], list[list[int]]],
    use_proposer: Callable[[Proposer], None],
) -> None:
    """Same free blocks and the same prefix-cache contents (block hashes) after a workload
    whose drafts were partly rejected; and after every step each running sequence holds
    exactly the blocks its computed tokens fill, as without speculation."""
    want = reference("llama")
    use_proposer(oracle(dict(zip(map(tuple, prompts()), want, strict=True)), True))

    def final_state(llm: LLM) -> tuple[int, set[int]]:
        manager = llm.engine.scheduler.block_manager
        cached = {manager.blocks[b].block_hash for b in manager.cached_block_ids_lru()}
        return manager.num_free_blocks, cached  # type: ignore[return-value]

    _, _, plain = run(model_dirs["llama"], prompts(), num_kv_blocks=64)
    spec = LLM(
        str(model_dirs["llama"]),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        speculative_config=SPEC,
    )
    engine = spec.engine
    for index, ids in enumerate(prompts()):
        engine.add_request(f"r{index}", ids, GREEDY)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.token_ids)
        for seq in engine.scheduler.running:
            assert len(seq.block_table) == blocks_for(seq.num_computed_tokens, 16)
    assert [outputs[f"r{i}"] for i in range(len(want))] == want
    assert engine.stats()["spec_accepted_tokens"] < engine.stats()["spec_draft_tokens"]
    assert final_state(spec) == final_state(plain)


def test_stop_tokens_stop_strings_and_max_tokens_end_where_they_would(
    model_dirs: dict[str, Path],
    reference: Callable[[str], list[list[int]]],
    use_proposer: Callable[[Proposer], None],
) -> None:
    """Drafts run past each end: a stop token among accepted drafts, a stop string inside
    them, max_tokens mid-proposal. Outputs, texts and reasons equal the plain run's."""
    want = reference("llama")
    use_proposer(oracle(dict(zip(map(tuple, prompts()), want, strict=True)), False))
    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", num_kv_blocks=64)
    text = llm.tokenizer.hf.decode(want[0][10:30])
    cases = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[want[0][13]]),
        SamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=0,
            ignore_eos=True,
            stop=[text[len(text) // 2 : len(text) // 2 + 2]],
        ),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    ]
    spec = LLM(
        str(model_dirs["llama"]),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        speculative_config=SPEC,
    )
    for params in cases:
        plain = llm.generate(prompts(), params)
        ours = spec.generate(prompts(), params)
        assert [(o.token_ids, o.text, o.finish_reason) for o in ours] == [
            (o.token_ids, o.text, o.finish_reason) for o in plain
        ]
    assert {o.finish_reason for o in plain} == {"length"}
    assert spec.stats()["spec_accepted_tokens"] > 0 and spec.stats()["kv_blocks_used"] == 0


async def test_n_choices_speculate_each(
    model_dirs: dict[str, Path],
    reference: Callable[[str], list[list[int]]],
    use_proposer: Callable[[Proposer], None],
) -> None:
    want = reference("llama")
    use_proposer(oracle(dict(zip(map(tuple, prompts()), want, strict=True)), True))
    async with AsyncEngine(
        model_dirs["llama"], num_kv_blocks=64, speculative_config=SPEC
    ) as engine:
        choices: list[list[int]] = [[], [], []]
        async for delta in engine.add_request(
            "n", prompt_token_ids=prompts()[1], params=GREEDY, options=RequestOptions(n=3)
        ):
            choices[delta.index].extend(delta.token_ids)
        stats = engine.core.stats()  # type: ignore[union-attr]
    assert choices == [want[1]] * 3
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_random_sampling_speculates_and_grammar_or_penalised_requests_do_not(
    model_dirs: dict[str, Path], use_proposer: Callable[[Proposer], None]
) -> None:
    """Temperature sampling verifies drafts by rejection sampling (its distribution is
    checked in tests/engine/sample/test_speculative_verify.py); a request whose sampling
    the drafts' verification would not reproduce (penalties, logprobs, a seed) gets none."""
    proposed: list[int] = []

    def always(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        proposed.append(len(token_ids))
        return token_ids[-k:]

    use_proposer(always)
    spec = LLM(
        str(model_dirs["llama"]),
        device="cpu",
        dtype="float32",
        num_kv_blocks=64,
        speculative_config=SPEC,
    )
    for params in [
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.2),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, temperature=0, logprobs=2),
    ]:
        (out,) = spec.generate(prompts()[0], params)
        assert len(out.token_ids) == 12 or out.finish_reason == "stop"
    assert proposed == []
    outputs = spec.generate(
        prompts(), SamplingParams(max_tokens=24, temperature=0.9, top_k=50, ignore_eos=True)
    )
    assert [len(o.token_ids) for o in outputs] == [24] * len(outputs)
    assert proposed and spec.stats()["spec_draft_tokens"] > 0


@pytest.mark.parametrize(("limit", "speculates"), [(5, False), (6, True)])
def test_a_batch_larger_than_disable_by_batch_size_is_not_speculated(
    model_dirs: dict[str, Path],
    reference: Callable[[str], list[list[int]]],
    use_proposer: Callable[[Proposer], None],
    limit: int,
    speculates: bool,
) -> None:
    """Six requests of one length run side by side to the end: with a limit of 5 no step
    speculates, with 6 every decode does."""
    want = reference("llama")
    use_proposer(oracle(dict(zip(map(tuple, prompts()), want, strict=True)), False))
    config = {**SPEC, "disable_by_batch_size": limit}
    outputs, stats, _ = run(
        model_dirs["llama"], prompts(), num_kv_blocks=64, speculative_config=config
    )
    assert [o.token_ids for o in outputs] == want
    assert (stats["spec_draft_tokens"] > 0) is speculates


GRAMMARS = [
    Structured("regex", regex=r"[0-9]{3}-[a-z]{2}( [a-z]+){2,4}"),
    Structured("json_schema", json_schema='{"type": "object", "properties": {"n": '
               '{"type": "integer"}, "w": {"type": "string"}}, "required": ["n", "w"]}'),
    Structured("choice", choices=["alpha beta gamma", "alpha beta delta", "omega"]),
]  # fmt: skip


@pytest.mark.parametrize("drafts", ["oracle", "spoiled", "always"])
def test_the_grammar_checks_the_drafts(
    model_dirs: dict[str, Path], use_proposer: Callable[[Proposer], None], drafts: str
) -> None:
    """Grammar-constrained requests speculate: each verified row is masked by the grammar's
    state after the drafts before it, so greedy output is the tokens (and text) it is without
    speculation, whether the drafts follow the grammar (the reference's own continuation,
    accepted), stray from it midway, or ignore it (the prompt's last tokens)."""
    params = SamplingParams(max_tokens=40, temperature=0)
    plain = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", num_kv_blocks=64)
    prompt = prompts()[3]
    want = [plain.generate(prompt, params, RequestOptions(structured=g))[0] for g in GRAMMARS]
    proposed: list[int] = []

    def propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        proposed.append(len(token_ids))
        if drafts == "always":
            return token_ids[-k:]
        for reference in want:
            done = len(token_ids) - len(prompt)
            if token_ids[len(prompt) :] == reference.token_ids[:done]:
                tokens = reference.token_ids[done : done + k]
                if drafts == "spoiled" and tokens and done % 3:
                    tokens[done % len(tokens)] = (tokens[done % len(tokens)] + 1) % 256
                return tokens
        return []

    use_proposer(propose)
    spec = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", num_kv_blocks=64,
               speculative_config=SPEC)  # fmt: skip
    for grammar, reference in zip(GRAMMARS, want, strict=True):
        (out,) = spec.generate(prompt, params, RequestOptions(structured=grammar))
        assert (out.token_ids, out.text) == (reference.token_ids, reference.text)
    stats = spec.stats()
    assert proposed and stats["spec_draft_tokens"] > 0
    if drafts == "oracle":
        assert stats["spec_acceptance_rate"] == 1.0
