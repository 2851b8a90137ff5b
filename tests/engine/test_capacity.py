"""``sluicegate capacity``: the article's Llama 3.1 8B figures, and parameter counts that match
the real transformers models for every supported architecture."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sluicegate.engine.capacity import ModelShape, main, parse_size, plan_capacity
from sluicegate.gateway.cli import main as cli_main

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
}
ARTICLE_ARGS = ["--gpu-memory", "80GB", "--utilization", "0.9", "--avg-tokens", "2000"]
ARTICLE_ARGS += ["--reserve", "131072", "--reserve", "8192"]


@pytest.fixture
def llama_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    return tmp_path


def test_prints_the_article_figures_for_llama_31_8b(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["capacity", "--config", str(llama_dir), *ARTICLE_ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected = [
        "Parameters: 8,030,261,248 parameters",
        "Weights: 16.06 GB weights (bfloat16)",
        "KV cache per token: 131,072 bytes (128 KiB) per token (bfloat16)",
        "KV budget: 55.94 GB KV budget (80.00 GB x 0.9 - 16.06 GB weights)",
        "KV capacity: 426,784 tokens (26,674 blocks of 16)",
        "  static reservation: 3 sequences at 131,072 tokens each",
        "  static reservation: 52 sequences at 8,192 tokens each",
        "  paged (on demand): 213 sequences paged at 2,000 tokens on average",
        "Paged vs reserved 8,192: ratio 4.1x",
    ]
    for line in expected:
        assert line in lines


def test_json_output_for_llama_31_8b(llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config_file = llama_dir / "config.json"
    assert main(["--config", str(config_file), *ARTICLE_ARGS, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = {
        "param_count": 8_030_261_248,
        "weight_bytes": 16_060_522_496,
        "kv_bytes_per_token": 131_072,
        "kv_budget_bytes": 55_939_477_504,
        "kv_capacity_blocks": 26_674,
        "kv_capacity_tokens": 426_784,
        "max_seqs_reserved": {"131072": 3, "8192": 52},
        "max_seqs_paged": 213,
        "paged_vs_reserved_ratio": 4.1,
    }
    assert {key: result[key] for key in expected} == expected


def test_defaults_are_the_article_scenario(
    llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(llama_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["kv_capacity_tokens"] == 426_784
    assert result["max_seqs_reserved"] == {"131072": 3, "8192": 52}


def test_other_gpu_dtype_and_block_size() -> None:
    plan = plan_capacity(
        LLAMA_31_8B,
        gpu_memory_bytes=parse_size("141GB"),
        utilization=0.9,
        reserves=(8192,),
        block_size=32,
        kv_dtype="fp8",
    )
    assert plan.kv_bytes_per_token == 65_536
    assert plan.kv_budget_bytes == 126_900_000_000 - 16_060_522_496
    assert plan.kv_capacity_blocks == plan.kv_budget_bytes // (65_536 * 32)
    assert plan.max_seqs_reserved == {"8192": plan.kv_capacity_blocks // 256}


def test_sizes_parse_in_decimal_and_binary_units() -> None:
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("1.5 TB") == 1_500_000_000_000
    assert parse_size("4096") == 4096


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_31_8B, "model_type": "gpt2"}))
    assert main(["--config", str(tmp_path)]) == 2
    assert "no parameter formula for model type 'gpt2'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert main(["--config", str(tmp_path), "--gpu-memory", "16GB"]) == 2
    assert "leave no KV budget" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path), "--gpu-memory", "lots"])


def test_capacity_never_imports_torch(llama_dir: Path) -> None:
    code = (
        "import sys; from sluicegate.engine.capacity import main; "
        f"main(['--config', {str(llama_dir)!r}, '--json']); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 211,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
        ("mistral", {"head_dim": 24}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen2", {"tie_word_embeddings": False}),
        ("qwen3", {"head_dim": 32, "tie_word_embeddings": False}),
        ("qwen3", {"head_dim": 16, "tie_word_embeddings": True, "attention_bias": True}),
    ],
)
def test_parameter_count_matches_transformers(model_type: str, extra: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **TINY, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config)
    actual = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert ModelShape.from_config(config.to_dict()).parameter_count() == actual
