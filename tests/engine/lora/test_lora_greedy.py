"""Acceptance 1 on the tiny random models: a batch mixing two peft adapters (non-zero B) and
the base model gives, row by row, transformers + peft's greedy tokens, with chunked prefill,
prefix caching and preemption in play; adapters beyond the device slots swap in and out,
speculative decoding verifies drafts with each row's adapter, and no prefix-cache block is
ever shared across adapters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluicegate.engine.options import EngineOptions
from sluicegate.engine.serving.core import EngineCore
from tests.engine.lora.adapters import make_adapter, peft_greedy
from tests.engine.lora.engine_runs import run_mixed

NEW_TOKENS = 16
KINDS = ["llama", "qwen2", "qwen3"]


def prompts() -> list[list[int]]:
    """Behind one 40-token prefix (cache hits within an adapter), tails of several lengths."""
    generator = torch.Generator().manual_seed(21)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=generator).tolist()

    prefix = tokens(40)
    return [prefix + tokens(n) for n in (1, 9, 23, 50)] + [tokens(3), tokens(70)]


@pytest.fixture(scope="module")
def adapters(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, dict[str, Path]]:
    """Per model: "a" on every projection (rank 8), "b" on q, v and down (rank 4, rsLoRA),
    "c" on o, gate and up (rank 16)."""
    root = tmp_path_factory.mktemp("lora-adapters")
    made: dict[str, dict[str, Path]] = {}
    for kind in KINDS:
        base = model_dirs[kind]
        made[kind] = {
            "a": make_adapter(base, root / kind / "a", seed=1),
            "b": make_adapter(
                base,
                root / kind / "b",
                seed=2,
                rank=4,
                targets=["q_proj", "v_proj", "down_proj"],
                rslora=True,
            ),
            "c": make_adapter(
                base,
                root / kind / "c",
                seed=3,
                rank=16,
                alpha=8,
                targets=["o_proj", "gate_proj", "up_proj"],
            ),
        }
    return made


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path], adapters: dict[str, dict[str, Path]]):
    cache: dict[tuple[str, str | None], list[list[int]]] = {}

    def get(kind: str, name: str | None) -> list[list[int]]:
        if (kind, name) not in cache:
            folder = adapters[kind][name] if name else None
            cache[kind, name] = peft_greedy(model_dirs[kind], folder, prompts(), NEW_TOKENS)
        return cache[kind, name]

    return get


@pytest.mark.parametrize("kind", KINDS)
def test_a_mixed_batch_gives_each_rows_adapter_tokens(
    kind: str, model_dirs: dict[str, Path], adapters, references
) -> None:
    core = EngineCore(
        model_dirs[kind],
        EngineOptions(
            dtype="float32",
            num_kv_blocks=24,
            max_num_batched_tokens=48,
            enable_prefix_caching=True,
            max_loras=2,
            max_lora_rank=16,
        ),
    )
    names: list[str | None] = [None, "a", "b"]
    requests = [
        (prompt, name, adapters[kind][name] if name else None)
        for prompt in prompts()
        for name in names
    ]
    outputs = run_mixed(core, requests, NEW_TOKENS)
    for (prompt, name, _), tokens in zip(requests, outputs, strict=True):
        assert tokens == references(kind, name)[prompts().index(prompt)], (kind, name)
    stats = core.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert stats["loras"] == ["a", "b"]


def test_more_adapters_than_slots_and_host_memory_swap_by_lru(
    model_dirs: dict[str, Path], adapters, references
) -> None:
    """One device slot and room for two in host memory, three adapters and the base model in
    one queue: the scheduler runs one adapter at a time beside base rows, each step's
    adapter swaps into the slot, and the adapter left out of host memory loads again."""
    core = EngineCore(
        model_dirs["llama"],
        EngineOptions(
            dtype="float32", num_kv_blocks=64, max_loras=1, max_cpu_loras=2, max_lora_rank=16
        ),
    )
    folders = adapters["llama"]
    names: list[str | None] = ["a", None, "b", "c", "a", "c"]
    requests = [(prompts()[i % 6], n, folders[n] if n else None) for i, n in enumerate(names)]
    outputs = run_mixed(core, requests, NEW_TOKENS)
    for (prompt, name, _), tokens in zip(requests, outputs, strict=True):
        assert tokens == references("llama", name)[prompts().index(prompt)], name
    stats = core.stats()
    assert stats["lora_swaps"] >= 2
    assert stats["lora_loads"] >= 4  # "a" left host memory for "c", then came back
    assert len(stats["loras"]) == 2


def test_speculative_drafts_are_verified_by_the_rows_adapter(
    model_dirs: dict[str, Path], adapters, references
) -> None:
    core = EngineCore(
        model_dirs["qwen3"],
        EngineOptions(
            dtype="float32",
            num_kv_blocks=128,
            max_loras=2,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_max": 2,
                "prompt_lookup_min": 1,
                "disable_by_batch_size": 64,
            },
        ),
    )
    folders = adapters["qwen3"]
    requests = [(p, n, folders[n] if n else None) for p in prompts() for n in ("a", None, "b")]
    outputs = run_mixed(core, requests, NEW_TOKENS)
    for (prompt, name, _), tokens in zip(requests, outputs, strict=True):
        assert tokens == references("qwen3", name)[prompts().index(prompt)], name
    stats = core.stats()
    assert stats["spec_draft_tokens"] > 0
    assert stats["spec_accepted_tokens"] > 0


def test_no_prefix_block_is_shared_across_adapters_or_reloaded_weights(
    model_dirs: dict[str, Path], adapters
) -> None:
    core = EngineCore(
        model_dirs["llama"], EngineOptions(dtype="float32", num_kv_blocks=64, max_loras=2)
    )
    folders = adapters["llama"]
    prompt = prompts()[3]  # 90 tokens: 5 full blocks

    def cached_after(name: str | None, folder: Path | None) -> int:
        before = core.stats()["prefix_cache_hits"]
        run_mixed(core, [(prompt, name, folder)], 2)
        return core.stats()["prefix_cache_hits"] - before

    assert cached_after("a", folders["a"]) == 0
    assert cached_after("a", folders["a"]) == 80  # the same adapter reuses its blocks
    assert cached_after(None, None) == 0
    assert cached_after("b", folders["b"]) == 0
    assert cached_after(None, None) == 80
    # New weights under the name "a": its old blocks are never reused.
    core.loras.load("a", str(folders["c"]))
    assert cached_after("a", folders["a"]) == 0
    assert cached_after("a", folders["a"]) == 80


def test_on_the_packed_cpu_product_the_gated_mlp_keeps_its_fused_silu(
    model_dirs: dict[str, Path], adapters, references
) -> None:
    """The packed product runs every linear: gate_up with its SiLU fused in steps without
    adapters, unfused (the deltas added to gate and up) in steps with them."""
    from sluicegate.engine.models.layers import GatedMLP

    core = EngineCore(
        model_dirs["llama"],
        EngineOptions(dtype="float32", num_kv_blocks=64, max_loras=2, cpu_linears="packed"),
    )
    mlps = [m for m in core.model.modules() if isinstance(m, GatedMLP)]
    assert mlps and all(m.gate_up_applies_activation for m in mlps)
    folders = adapters["llama"]
    requests = [(p, n, folders[n] if n else None) for p in prompts()[:4] for n in ("a", None, "c")]
    outputs = run_mixed(core, requests, NEW_TOKENS)
    for (prompt, name, _), tokens in zip(requests, outputs, strict=True):
        assert tokens == references("llama", name)[prompts().index(prompt)], name
    base_only = [(prompt, None, None) for prompt in prompts()]
    assert run_mixed(core, base_only, NEW_TOKENS) == references("llama", None)
