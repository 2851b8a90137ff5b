"""Adapters the engine cannot serve are refused by name, and the engine serves on: a missing
folder or file, a rank above ``--max-lora-rank``, another base model's adapter, DoRA, an
adapter on the embeddings or the LM head; LoRA asked of an engine with LoRA off, or of the
transformers backend."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sluicegate.engine.models import UnsupportedModelError
from sluicegate.engine.options import EngineOptions
from sluicegate.engine.serving.core import EngineCore
from tests.engine.lora.adapters import make_adapter, peft_greedy
from tests.engine.lora.engine_runs import run_mixed


@pytest.fixture(scope="module")
def llama_core(model_dirs: dict[str, Path]) -> EngineCore:
    return EngineCore(
        model_dirs["llama"],
        EngineOptions(dtype="float32", num_kv_blocks=64, max_loras=2, max_lora_rank=8),
    )


@pytest.fixture(scope="module")
def good_adapter(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(model_dirs["llama"], tmp_path_factory.mktemp("good") / "a", seed=4)


def edited_copy(adapter: Path, folder: Path, **config: object) -> Path:
    shutil.copytree(adapter, folder)
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return folder


def refused(core: EngineCore, name: str, folder: Path) -> str:
    with pytest.raises(ValueError) as caught:
        core.loras.load(name, str(folder))
    return str(caught.value)


def test_unservable_adapters_are_refused_by_name(
    llama_core: EngineCore,
    good_adapter: Path,
    model_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    base = model_dirs["llama"]
    assert "not found" in refused(llama_core, "gone", tmp_path / "nowhere")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(good_adapter / "adapter_config.json", no_weights)
    assert "adapter_model.safetensors not found" in refused(llama_core, "w", no_weights)
    high = make_adapter(base, tmp_path / "high", seed=5, rank=16)
    assert "rank 16 is above this worker's --max-lora-rank 8" in refused(llama_core, "r", high)
    other_base = make_adapter(model_dirs["qwen3"], tmp_path / "qwen3", seed=6)
    assert "another base model?" in refused(llama_core, "q", other_base)
    dora = edited_copy(good_adapter, tmp_path / "dora", use_dora=True)
    assert "DoRA" in refused(llama_core, "d", dora)
    embeddings = make_adapter(base, tmp_path / "embed", seed=7, targets=["embed_tokens"])
    assert "embeddings" in refused(llama_core, "e", embeddings)
    head = edited_copy(good_adapter, tmp_path / "head", target_modules=["q_proj", "lm_head"])
    assert "LM head" in refused(llama_core, "h", head)
    saved = edited_copy(good_adapter, tmp_path / "saved", modules_to_save=["lm_head"])
    assert "modules_to_save" in refused(llama_core, "s", saved)
    assert llama_core.stats()["loras"] == []


def test_the_engine_serves_on_after_a_refusal(
    llama_core: EngineCore, good_adapter: Path, model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    prompt = list(range(5, 30))
    with pytest.raises(ValueError, match="not found"):
        run_mixed(llama_core, [(prompt, "missing", tmp_path / "missing")], 4)
    assert not llama_core.has_unfinished()
    expected = peft_greedy(model_dirs["llama"], good_adapter, [prompt], 6)
    assert run_mixed(llama_core, [(prompt, "good", good_adapter)], 6) == expected
    llama_core.loras.unload("good")
    assert "good" not in llama_core.stats()["loras"]
    with pytest.raises(ValueError, match="is not loaded"):
        llama_core.loras.unload("good")


def test_lora_off_refuses_requests_with_an_adapter(
    model_dirs: dict[str, Path], good_adapter: Path
) -> None:
    core = EngineCore(model_dirs["llama"], EngineOptions(dtype="float32", num_kv_blocks=32))
    with pytest.raises(ValueError, match="LoRA is off"):
        run_mixed(core, [([5, 6, 7], "good", good_adapter)], 2)
    assert "loras" not in core.stats()


def test_the_transformers_backend_refuses_lora_at_start_up(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(UnsupportedModelError, match="native models only"):
        EngineCore(
            model_dirs["llama"],
            EngineOptions(
                dtype="float32", num_kv_blocks=32, model_impl="transformers", max_loras=1
            ),
        )


def test_start_up_adapters_need_lora_on(model_dirs: dict[str, Path], good_adapter: Path) -> None:
    with pytest.raises(ValueError, match="--max-loras"):
        EngineCore(
            model_dirs["llama"],
            EngineOptions(dtype="float32", num_kv_blocks=32, lora_modules={"a": str(good_adapter)}),
        )
