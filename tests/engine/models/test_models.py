"""Native models against transformers' forward logits, and the loader's contract."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.models import UnsupportedModelError, load_model
from sluicegate.engine.models.config import ModelConfig
from sluicegate.engine.models.loader import resolve_dtype
from sluicegate.engine.runner.attention import BACKEND_ENV, resolve_backend_name
from sluicegate.engine.runner.model_runner import ModelRunner
from sluicegate.engine.sample.params import SamplingParams
from sluicegate.kernels import cpu_attention, cpu_pair_linear

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("mistral")
    torch.manual_seed(5)
    config = MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=1,
        initializer_range=0.3,
        sliding_window=None,
    )
    MistralForCausalLM(config).eval().save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_dir / name, folder / name)
    return folder


def native_logits(
    folder: Path, tokens: list[int], prompt_len: int, chunk: int = 16, dtype: str = "auto"
) -> torch.Tensor:
    """Logits from position ``prompt_len - 1`` on, computed through the paged cache: the
    prompt prefilled in chunks of ``chunk`` tokens (attending to the cached chunks before),
    then one decode step per further token, each fed the true next token."""
    model = load_model(folder, CPU, dtype)
    runner = ModelRunner(
        model,
        CPU,
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=chunk,
        max_model_len=1024,
        num_kv_blocks=64,
    )
    scheduler = Scheduler(
        SchedulerConfig(num_kv_blocks=64, max_model_len=1024, max_num_batched_tokens=chunk)
    )
    scheduler.add(Sequence("a", tokens[:prompt_len], SamplingParams(max_tokens=len(tokens))))
    rows = []
    position = prompt_len
    while True:
        output = scheduler.schedule()
        logits = runner.run(output)
        if not output.scheduled[0].samples:
            assert logits.shape[0] == 0
            scheduler.postprocess(output, [None])
            continue
        rows.append(logits)
        if position == len(tokens):
            return torch.cat(rows)
        scheduler.postprocess(output, [tokens[position]])
        position += 1


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_logits_match_transformers(
    kind: str, model_dirs: dict[str, Path], mistral_dir: Path
) -> None:
    folder = mistral_dir if kind == "mistral" else model_dirs[kind]
    tokens = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    prompt_len = 40
    ours = native_logits(folder, tokens, prompt_len)
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = reference(torch.tensor([tokens])).logits[0, prompt_len - 1 :]
    assert ours.shape == expected.shape
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)


def test_llama3_rope_scaling_matches_transformers(llama_dir: Path) -> None:
    reference = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ours = load_model(llama_dir, CPU)
    assert ours.config.rope_scaling is not None
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    torch.testing.assert_close(
        ours.model.rotary._inv_freq_cpu, reference.model.rotary_emb.inv_freq.float()
    )


def test_tied_embeddings_share_one_tensor(model_dirs: dict[str, Path]) -> None:
    tied = load_model(model_dirs["qwen2"], CPU)
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = load_model(model_dirs["llama"], CPU)
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_loads_and_stays_close(llama_dir: Path, dtype: torch.dtype) -> None:
    model = load_model(llama_dir, CPU, dtype=str(dtype).removeprefix("torch."))
    assert all(p.dtype == dtype for p in model.parameters())
    tokens = list(range(5, 45))
    full = native_logits(llama_dir, tokens, 40, chunk=64)
    runner = ModelRunner(
        model, CPU, block_size=16, max_num_seqs=1, max_num_batched_tokens=64,
        max_model_len=1024, num_kv_blocks=8,
    )  # fmt: skip
    assert runner.kv_cache.dtype == dtype
    scheduler = Scheduler(SchedulerConfig(num_kv_blocks=8, max_model_len=1024))
    scheduler.add(Sequence("h", tokens, SamplingParams()))
    half = runner.run(scheduler.schedule())
    assert half.dtype == torch.float32
    assert (half - full).abs().max() < 0.1 * full.abs().max()


def test_auto_dtype_follows_the_checkpoint(llama_dir: Path) -> None:
    from sluicegate.kernels import cpu_build

    config = ModelConfig.from_folder(llama_dir)
    assert resolve_dtype("auto", config, CPU) == torch.float32
    config.dtype = torch.float16
    # Without the CPU kernels torch's own float16 matmuls would serve it: float32 instead.
    expected = torch.float16 if cpu_build.extension() is not None else torch.float32
    assert resolve_dtype("auto", config, CPU) == expected
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.float16
    config.dtype = torch.bfloat16
    assert resolve_dtype("auto", config, CPU) == torch.bfloat16
    assert resolve_dtype("float16", config, CPU) == torch.float16


def _copy_with_config(source: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_unsupported_architecture_names_the_supported_ones(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with_config(
        llama_dir, tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2"
    )
    with pytest.raises(UnsupportedModelError) as error:
        load_model(folder, CPU, model_impl="native")
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    for supported in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ):
        assert supported in message


def test_checkpoint_missing_a_tensor_is_an_error(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    shutil.copytree(model_dirs["qwen3"], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_norm.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match="k_norm"):
        load_model(folder, CPU)


def test_unknown_rope_scaling_is_an_error(llama_dir: Path, tmp_path: Path) -> None:
    folder = _copy_with_config(
        llama_dir, tmp_path / "yarn", rope_parameters={"rope_type": "yarn", "factor": 2.0}
    )
    with pytest.raises(ValueError, match="yarn"):
        load_model(folder, CPU)


def test_attention_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    # The compiled decode kernel where it builds, else the torch reference.
    assert resolve_backend_name(None, CPU) == ("cpu" if cpu_attention.available() else "torch")
    assert resolve_backend_name(None, torch.device("cuda")) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert resolve_backend_name(None, CPU) == "triton"
    assert resolve_backend_name("torch", CPU) == "torch"  # an explicit option wins
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend_name("flash", CPU)


@pytest.mark.parametrize("kind", ["onednn", "packed"])
def test_cpu_linears_compute_the_same_product(llama_dir: Path, kind: str) -> None:
    from sluicegate.engine.models.cpu.linears import resolve_cpu_linears, swap_cpu_linears
    from sluicegate.kernels import cpu_linear

    if kind == "packed" and not cpu_linear.available():
        pytest.skip("the packed linears need the CPU kernels built with AVX2 and FMA")
    model = load_model(llama_dir, CPU)
    assert resolve_cpu_linears(kind, model) == kind
    layer = model.model.layers[0]
    x = torch.randn(3, 5, layer.self_attn.qkv_proj.in_features)
    with torch.inference_mode():
        expected_qkv = layer.self_attn.qkv_proj(x)
        gate, up = layer.mlp.gate_up_proj(x).chunk(2, dim=-1)
        expected_mlp = layer.mlp.down_proj(torch.nn.functional.silu(gate) * up)
        assert swap_cpu_linears(model, kind) == 2 * 4 + 1  # qkv, o, gate_up, down + lm_head
        swapped = layer.self_attn.qkv_proj
        assert type(swapped).__name__ == {"onednn": "OneDNNLinear", "packed": "PackedLinear"}[kind]
        torch.testing.assert_close(swapped(x), expected_qkv, atol=1e-5, rtol=1e-5)
        # Packed, the MLP's SiLU x mul happens inside its gate_up product.
        assert layer.mlp.gate_up_applies_activation == (kind == "packed")
        torch.testing.assert_close(layer.mlp(x), expected_mlp, atol=1e-5, rtol=1e-5)


def test_cpu_linears_choice(llama_dir: Path) -> None:
    from sluicegate.engine.models.cpu.linears import resolve_cpu_linears
    from sluicegate.engine.models.cpu.onednn import packs
    from sluicegate.kernels import cpu_linear

    model = load_model(llama_dir, CPU)
    # With both kernels, auto races them on this machine (test_cpu_linear_race below).
    auto = resolve_cpu_linears("auto", model)
    assert auto in ({"packed", "onednn"} if cpu_linear.available() else {"onednn"})
    assert resolve_cpu_linears("onednn", model) == "onednn"
    assert resolve_cpu_linears("torch", model) == "torch"
    # A 16-bit model's auto races the packed product against oneDNN with the weight packed
    # where this CPU's oneDNN packs that dtype, else against torch's own 16-bit linear.
    # Where oneDNN wins a bfloat16 model's race and the CPU has bfloat16 dot products, auto
    # races those against oneDNN too.
    half = load_model(llama_dir, CPU, dtype="bfloat16")
    other = "onednn" if packs(torch.bfloat16) else "torch"
    expected = {"packed", other} if cpu_linear.available() else {other}
    if cpu_pair_linear.available():
        expected.add("pairs")
        assert resolve_cpu_linears("pairs", half) == "pairs"
    assert resolve_cpu_linears("auto", half) in expected
    assert resolve_cpu_linears("onednn", half) == other
    # Other dtypes keep aten's.
    assert resolve_cpu_linears("auto", load_model(llama_dir, CPU).double()) == "torch"
    with pytest.raises(ValueError, match="unknown cpu_linears"):
        resolve_cpu_linears("mkl", model)
    with pytest.raises(ValueError, match="needs a bfloat16 model"):
        resolve_cpu_linears("pairs", model)


def _bf16_products(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first layer's q/k/v product and MLP, and the LM head, on ``x``."""
    layer = model.model.layers[0]
    return layer.self_attn.qkv_proj(x), layer.mlp(x), model.lm_head(x)


def test_pair_linears_of_a_bfloat16_model(llama_dir: Path) -> None:
    # Every linear on the bfloat16 dot products: q/k/v and the LM head as PairLinear, the
    # output projection and the MLP as the two-thread tail's halves. The reference is torch's
    # own bfloat16 modules: one bfloat16 rounding apart (each side rounds its float32 sums).
    from sluicegate.engine.models.cpu.linears import swap_cpu_linears
    from sluicegate.engine.models.cpu.pair_linear import PairLinear

    if not cpu_pair_linear.available():
        pytest.skip("the bfloat16 dot-product linear needs AVX512_BF16")
    model = load_model(llama_dir, CPU, dtype="bfloat16")
    layer = model.model.layers[0]
    x = torch.randn(7, layer.self_attn.qkv_proj.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = _bf16_products(model, x)
        assert swap_cpu_linears(model, "pairs") == 2 * 4 + 1
        assert isinstance(layer.self_attn.qkv_proj, PairLinear)
        assert isinstance(model.lm_head, PairLinear)
        if torch.get_num_threads() > 1:
            assert layer.split_tail is not None and layer.split_tail.o_halves[0].dim() == 4
        got = _bf16_products(model, x)
    for out, want in zip(got, expected, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, atol=1e-2, rtol=1.6e-2)


def test_onednn_linears_of_a_bfloat16_model_match_torchs_own(llama_dir: Path) -> None:
    # The same oneDNN product as torch's own bfloat16 linear, the weight packed once
    # instead of per call: the same sums in the same order, so equal bit for bit here.
    from sluicegate.engine.models.cpu.linears import swap_cpu_linears
    from sluicegate.engine.models.cpu.onednn import packs

    if not packs(torch.bfloat16):
        pytest.skip("oneDNN packs no bfloat16 weight on this CPU (it needs AVX-512)")
    model = load_model(llama_dir, CPU, dtype="bfloat16")
    layer = model.model.layers[0]
    x = torch.randn(7, layer.self_attn.qkv_proj.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = _bf16_products(model, x)
        assert swap_cpu_linears(model, "onednn") == 2 * 4 + 1
        assert type(layer.self_attn.qkv_proj).__name__ == "OneDNNLinear"
        got = _bf16_products(model, x)
    for out, want in zip(got, expected, strict=True):
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_packed_linears_of_a_16_bit_model(llama_dir: Path, dtype: str) -> None:
    # The packed product keeps a 16-bit model's weights in its dtype and computes in
    # float32: the reference is the layer's own linears run in float32 on the same weights.
    from sluicegate.engine.models.cpu.linears import swap_cpu_linears
    from sluicegate.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("the packed linears need the CPU kernels built with AVX2 and FMA")
    model = load_model(llama_dir, CPU, dtype=dtype)
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    x = torch.randn(3, 5, qkv.in_features).to(qkv.weight.dtype)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x.float(), qkv.weight.float()).to(x.dtype)
        assert swap_cpu_linears(model, "packed") == 2 * 4 + 1
        out = layer.self_attn.qkv_proj(x)
        assert out.dtype == x.dtype
        tolerance = {"bfloat16": 1.6e-2, "float16": 2e-3}[dtype]
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=tolerance)
        assert layer.mlp(x).dtype == x.dtype


def test_cpu_linear_race(llama_dir: Path) -> None:
    from sluicegate.engine.models.cpu.linear_race import RACE_ROWS, packed_wins, race
    from sluicegate.kernels import cpu_linear

    # Each size counts alike: a kernel faster at most sizes by a little loses to one
    # faster at the others by a lot.
    assert packed_wins({4: 0.8, 32: 0.9, 512: 1.05})
    assert not packed_wins({4: 0.8, 32: 1.7, 512: 1.9})
    assert not packed_wins({4: 1.0, 32: 1.0, 512: 1.0})
    if not cpu_linear.available():
        pytest.skip("the packed linears need the CPU kernels built with AVX2 and FMA")
    ratios = race(load_model(llama_dir, CPU))
    assert list(ratios) == list(RACE_ROWS)
    assert all(0 < ratio < float("inf") for ratio in ratios.values())


def test_sliding_window_caps_the_context(mistral_dir: Path, tmp_path: Path) -> None:
    from sluicegate.engine import LLM

    folder = _copy_with_config(mistral_dir, tmp_path / "windowed", sliding_window=64)
    llm = LLM(str(folder), num_kv_blocks=16)
    assert llm.engine.scheduler.config.max_model_len == 64
    from sluicegate.engine.core.scheduler import RequestRejected

    with pytest.raises(RequestRejected, match="64"):
        llm.generate([5] * 60, SamplingParams(max_tokens=10))
