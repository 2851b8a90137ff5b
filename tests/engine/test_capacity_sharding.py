"""``sluicegate capacity`` with quantized weights, an fp8 KV cache and tensor parallelism:
the documented rows (Llama 3.1 8B with fp8 weights and KV on one H100, Llama 3.1 70B on four
H100s at TP 4), each against its arithmetic written out here, and the split's rules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sluicegate.engine.capacity import main, plan_capacity
from sluicegate.engine.capacity_sharding import kv_heads_per_rank, weight_bytes
from sluicegate.engine.model_shape import ModelShape
from tests.engine.test_capacity import LLAMA_31_8B, TINY

LLAMA_31_70B: dict[str, Any] = {
    **LLAMA_31_8B,
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "intermediate_size": 28672,
}
H100 = 80 * 10**9
BUDGET = 72 * 10**9  # 80 GB x 0.9


def _llama_parts(hidden: int, layers: int, heads: int, inter: int) -> tuple[int, int, int, int]:
    """(projection weights, their output rows, vocab matrices, norms) of a Llama 3.1 with 8
    KV heads of 128, written out independently of ModelShape."""
    q, kv = heads * 128, 8 * 128
    linear = layers * (hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inter)
    rows = layers * (q + 2 * kv + hidden + 2 * inter + hidden)
    vocab = 2 * 128256 * hidden
    norms = layers * 2 * hidden + hidden
    return linear, rows, vocab, norms


def test_llama_31_8b_fp8_weights_and_fp8_kv_on_one_h100() -> None:
    plan = plan_capacity(LLAMA_31_8B, gpu_memory_bytes=H100, dtype="fp8", kv_dtype="fp8")
    linear, rows, vocab, norms = _llama_parts(4096, 32, 32, 14336)
    assert linear + vocab + norms == 8_030_261_248
    # fp8 projections with a bf16 scale per output row; embeddings, LM head, norms bf16.
    weights = linear * 1 + rows * 2 + vocab * 2 + norms * 2
    assert plan.weight_bytes == plan.rank_weight_bytes == weights == 9_083_953_152
    assert plan.kv_bytes_per_token == 2 * 32 * 8 * 128 * 1 == 65_536
    assert plan.kv_budget_bytes == BUDGET - weights
    assert plan.kv_capacity_blocks == (BUDGET - weights) // (65_536 * 16) == 60_001
    assert plan.kv_capacity_tokens == 960_016
    assert plan.max_seqs_reserved == {"131072": 7, "8192": 117}
    assert plan.max_seqs_paged == 60_001 // 125 == 480


def test_llama_31_70b_on_four_h100s_at_tp_4() -> None:
    plan = plan_capacity(LLAMA_31_70B, gpu_memory_bytes=H100, tensor_parallel_size=4)
    linear, _, vocab, norms = _llama_parts(8192, 80, 64, 28672)
    assert plan.param_count == linear + vocab + norms == 70_553_706_496
    assert plan.weight_bytes == 2 * plan.param_count
    # Projections and vocab matrices split four ways; the norms on every rank.
    rank_weights = (linear + vocab) * 2 // 4 + norms * 2
    assert plan.rank_weight_bytes == rank_weights == 35_278_831_616
    assert plan.kv_heads_per_rank == 2
    assert plan.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2 == 81_920
    assert plan.kv_capacity_blocks == (BUDGET - rank_weights) // (81_920 * 16) == 28_016
    assert plan.kv_capacity_tokens == 448_256
    assert plan.max_seqs_reserved == {"131072": 3, "8192": 54}
    assert plan.max_seqs_paged == 224


def test_llama_31_70b_fp8_at_tp_4() -> None:
    plan = plan_capacity(
        LLAMA_31_70B, gpu_memory_bytes=H100, dtype="fp8", kv_dtype="fp8", tensor_parallel_size=4
    )
    linear, rows, vocab, norms = _llama_parts(8192, 80, 64, 28672)
    rank_weights = (linear + rows * 2 + vocab * 2) // 4 + norms * 2
    assert plan.rank_weight_bytes == rank_weights
    assert plan.kv_bytes_per_token == 2 * 80 * 2 * 128 == 40_960
    assert rank_weights == 18_169_430_016
    assert plan.kv_capacity_tokens == (BUDGET - rank_weights) // (40_960 * 16) * 16 == 1_314_208
    assert plan.max_seqs_reserved == {"131072": 10, "8192": 160}
    assert plan.max_seqs_paged == 1_314_208 // 16 // 125 == 657


def test_int4_weights_carry_a_scale_per_group_of_128() -> None:
    shape = ModelShape.from_config(LLAMA_31_8B)
    linear, _, vocab, norms = _llama_parts(4096, 32, 32, 14336)
    expected = linear // 2 + linear // 128 * 2 + (vocab + norms) * 2
    assert weight_bytes(shape, shape.parameter_count(), "int4").total == expected


def test_kv_heads_shard_then_replicate() -> None:
    shape = ModelShape.from_config(LLAMA_31_8B)  # 32 heads, 8 KV heads
    assert [kv_heads_per_rank(shape, n) for n in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    with pytest.raises(ValueError, match="32 attention heads do not split over 3 ranks"):
        kv_heads_per_rank(shape, 3)
    six_kv = ModelShape.from_config(
        {**LLAMA_31_8B, "num_attention_heads": 48, "num_key_value_heads": 6}
    )
    with pytest.raises(ValueError, match="6 KV heads do not split over 4 ranks"):
        kv_heads_per_rank(six_kv, 4)
    with pytest.raises(ValueError, match="16 ranks do not replicate 6 KV heads"):
        kv_heads_per_rank(six_kv, 16)
    # Replicated heads: 16 ranks each hold one of 8, so a token takes 1/8 of its KV a rank.
    plan = plan_capacity(LLAMA_31_8B, gpu_memory_bytes=H100, tensor_parallel_size=16)
    assert plan.kv_bytes_per_token == 131_072 // 8


def test_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_70B))
    args = ["--config", str(tmp_path), "--tensor-parallel-size", "4", "--weight-dtype", "bf16"]
    assert main([*args, "--kv-cache-dtype", "fp8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tensor_parallel_size"] == 4 and result["kv_heads_per_rank"] == 2
    assert result["rank_weight_bytes"] == 35_278_831_616 and result["kv_bytes_per_token"] == 40_960
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "Tensor parallel: 4 ranks, each 35.28 GB of weights and 2 of 8 KV heads (every figure "
        "below is one rank's; the deployment holds as many tokens)" in lines
    )
    assert "KV capacity: 448,256 tokens (28,016 blocks of 16)" in lines
    assert main([*args[:2], "--tensor-parallel-size", "3"]) == 2
    assert "do not split over 3 ranks" in capsys.readouterr().err


def test_quantized_weights_need_the_projection_sizes(tmp_path: Path) -> None:
    shape = ModelShape.from_config({**LLAMA_31_8B, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="int4 needs the projections' sizes"):
        weight_bytes(shape, 10**9, "int4")
    assert weight_bytes(shape, 10**9, "bf16", 4).per_rank == 5 * 10**8


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_projection_weights_match_transformers(model_type: str) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **TINY, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    projections = [p for name, p in model.named_parameters() if name.endswith("proj.weight")]
    shape = ModelShape.from_config(config.to_dict())
    assert shape.linear_weights() == (
        sum(p.numel() for p in projections),
        sum(p.shape[0] for p in projections),
    )
