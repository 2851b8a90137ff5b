"""Issue 14: the transformers backend serves architectures we have no native code for.

Greedy tokens must equal transformers' own ``generate`` (eager attention) on the same float32
weights, for Phi-3 (fused qkv and gate_up projections), GPT-NeoX (partial rotary, parallel
residual), Gemma-2 (alternating sliding-window layers, attention and final logit
soft-capping, query_pre_attn_scalar scaling) and OLMo-2 (q/k norms over whole projections,
norms after each block), and Mixtral (mixture of experts whose per-expert checkpoint
tensors transformers fuses on load), with chunked prefill and preemption in play,
and for a chat turn; on Llama/Qwen it must give the native implementation's tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.capacity import main as capacity_main
from sluicegate.engine.models import UnsupportedModelError, load_model
from sluicegate.engine.models.transformers_backend import TransformersCausalLM
from sluicegate.engine.models.windowed_attention import windowed_paged_attention
from sluicegate.kernels import reference

NEW_TOKENS = 32
MAX_TOKEN_ID = 256
PROMPT_LENGTHS = [1, 3, 7, 16, 17, 31, 64, 100, 150, 255]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
GEMMA2_WINDOW = 24
# The shape of conftest's tiny models (a conftest is not importable under importlib mode).
_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def _phi3() -> torch.nn.Module:
    return transformers.Phi3ForCausalLM(
        transformers.Phi3Config(**_COMMON, tie_word_embeddings=False)
    )


def _gpt_neox() -> torch.nn.Module:
    common = {k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}
    config = transformers.GPTNeoXConfig(
        **common, rotary_pct=0.25, use_parallel_residual=True, tie_word_embeddings=False
    )
    return transformers.GPTNeoXForCausalLM(config)


def _gemma2() -> torch.nn.Module:
    # A smaller initializer and random norm scales: with the shared 0.3 the scaled embedding
    # swamps the residual stream and greedy decoding repeats one token whatever the context,
    # which would let a wrong window or soft-cap pass unnoticed.
    config = transformers.Gemma2Config(
        **{**_COMMON, "initializer_range": 0.1},
        head_dim=16,
        sliding_window=GEMMA2_WINDOW,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=24,
    )
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 3.0)
    return model


def _olmo2() -> torch.nn.Module:
    return transformers.Olmo2ForCausalLM(
        transformers.Olmo2Config(**_COMMON, tie_word_embeddings=False)
    )


def _mixtral() -> torch.nn.Module:
    # Stored per expert, fused in the transformers class: loads through from_pretrained.
    config = transformers.MixtralConfig(**_COMMON, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


BUILDERS: dict[str, Callable[[], torch.nn.Module]] = {
    "phi3": _phi3,
    "gpt_neox": _gpt_neox,
    "gemma2": _gemma2,
    "olmo2": _olmo2,
    "mixtral": _mixtral,
}
ARCHITECTURES = list(BUILDERS)


@pytest.fixture(scope="module")
def hf_dirs(
    tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]
) -> dict[str, Path]:
    """Each architecture saved with the trained tokenizer (and chat template) of conftest's
    tiny models."""
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
    root = tmp_path_factory.mktemp("transformers-backend")
    folders = {}
    for kind, build in BUILDERS.items():
        torch.manual_seed(1234)
        model = build().float().eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):
                    param.normal_(0, 0.3)
        model.save_pretrained(root / kind)
        tokenizer.save_pretrained(root / kind)
        folders[kind] = root / kind
    return folders


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, MAX_TOKEN_ID, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]


def transformers_greedy(model_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy ``generate`` with its eager attention (the implementation
    that honours every soft-cap and window), one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompt_ids:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def expected(hf_dirs: dict[str, Path]) -> Callable[[str], list[list[int]]]:
    cache: dict[str, list[list[int]]] = {}

    def get(kind: str) -> list[list[int]]:
        if kind not in cache:
            cache[kind] = transformers_greedy(hf_dirs[kind], prompts())
        return cache[kind]

    return get


def generated(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_ids, GREEDY)
    assert all(o.finish_reason == "length" for o in outputs)
    return [o.token_ids for o in outputs]


SETTINGS = {
    "default": {"num_kv_blocks": 512},
    "chunked_prefill": {"num_kv_blocks": 512, "max_num_batched_tokens": 40},
    # The longest request alone needs 18 blocks; all ten together need ~50.
    "preemption": {"num_kv_blocks": 24, "enable_prefix_caching": False},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_greedy_matches_transformers_generate(
    kind: str, setting: str, hf_dirs: dict[str, Path], expected: Callable[[str], list[list[int]]]
) -> None:
    llm = LLM(str(hf_dirs[kind]), dtype="float32", **SETTINGS[setting])
    assert isinstance(llm.engine.model, TransformersCausalLM)  # auto chose transformers
    assert generated(llm, prompts()) == expected(kind)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0
    if setting == "preemption":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("kind", ["gemma2", "gpt_neox"])
def test_prefix_caching(kind: str, hf_dirs: dict[str, Path]) -> None:
    """A second round of requests behind a shared 100-token prefix finds every full prompt
    block cached (the first round is scheduled in one step, before any block is cached);
    tokens stay transformers'."""
    generator = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, MAX_TOKEN_ID, (100,), generator=generator).tolist()
    shared = [
        prefix + torch.randint(3, MAX_TOKEN_ID, (1 + 9 * i,), generator=generator).tolist()
        for i in range(6)
    ]
    expected = transformers_greedy(hf_dirs[kind], shared)
    llm = LLM(str(hf_dirs[kind]), num_kv_blocks=256, dtype="float32")
    assert generated(llm, shared) == expected
    first_round = llm.stats()["prefix_cache_hits"]
    assert generated(llm, shared) == expected
    assert llm.stats()["prefix_cache_hits"] - first_round >= 6 * 96


def test_triton_kernels_under_the_transformers_backend(hf_dirs: dict[str, Path]) -> None:
    """The CUDA path's kernels (interpreted on the CPU here), prefill chunks and decodes."""
    short = [p[:40] for p in prompts()[:4]]
    few = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm = LLM(
        str(hf_dirs["phi3"]),
        num_kv_blocks=64,
        dtype="float32",
        attention_backend="triton",
        max_num_batched_tokens=24,
    )
    assert [o.token_ids for o in llm.generate(short, few)] == [
        tokens[:6] for tokens in transformers_greedy(hf_dirs["phi3"], short)
    ]


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_chat_turn_matches_transformers(kind: str, hf_dirs: dict[str, Path]) -> None:
    messages = [
        {"role": "system", "content": "Paged attention stores keys and values in blocks."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    tokenizer = AutoTokenizer.from_pretrained(hf_dirs[kind])
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer.encode(text, add_special_tokens=False)
    llm = LLM(str(hf_dirs[kind]), num_kv_blocks=64, dtype="float32")
    (output,) = llm.chat(messages, GREEDY)
    assert output.prompt_token_ids == prompt
    assert output.token_ids == transformers_greedy(hf_dirs[kind], [prompt])[0]


def test_gemma2_prompts_exceed_its_window(hf_dirs: dict[str, Path]) -> None:
    """The Gemma-2 comparisons above only prove the window if contexts outrun it."""
    config = json.loads((hf_dirs["gemma2"] / "config.json").read_text())
    assert "sliding_attention" in config["layer_types"]
    assert config["sliding_window"] == GEMMA2_WINDOW < max(PROMPT_LENGTHS)
    assert config["attn_logit_softcapping"] and config["final_logit_softcapping"]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_transformers_impl_matches_native(kind: str, model_dirs: dict[str, Path]) -> None:
    native = LLM(str(model_dirs[kind]), num_kv_blocks=512, dtype="float32")
    ported = LLM(
        str(model_dirs[kind]), num_kv_blocks=512, dtype="float32", model_impl="transformers"
    )
    assert not isinstance(native.engine.model, TransformersCausalLM)
    assert isinstance(ported.engine.model, TransformersCausalLM)
    assert generated(ported, prompts()) == generated(native, prompts())


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_capacity_and_kv_sizing_read_the_shape_generically(
    kind: str, hf_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = load_model(hf_dirs[kind], torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dirs[kind])
    assert capacity_main(["--config", str(hf_dirs[kind]), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    config = model.config
    assert plan["num_layers"] == config.num_hidden_layers == hf_model.config.num_hidden_layers
    assert plan["num_kv_heads"] == config.num_key_value_heads
    assert plan["head_dim"] == config.head_dim
    assert plan["kv_bytes_per_token"] == 2 * config.num_hidden_layers * (
        config.num_key_value_heads * config.head_dim * 2  # bfloat16, the planner's default
    )
    # Parameters come from the checkpoint's headers (no formula for these families).
    assert plan["param_count"] == sum(p.numel() for p in hf_model.parameters())
    assert plan["sliding_windows"] == {"gemma2": [GEMMA2_WINDOW, None]}.get(kind, [None, None])


def test_windowed_attention_without_window_or_cap_is_the_reference() -> None:
    torch.manual_seed(0)
    block_size, blocks, kv_heads, heads, head_dim = 4, 12, 2, 4, 8
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim)
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 15], dtype=torch.int32)
    cu = torch.tensor([0, 1, 7], dtype=torch.int32)  # one decode, one 6-token chunk
    q = torch.randn(7, heads, head_dim)
    args = (q, k_cache, v_cache, tables, seq_lens, cu, 0.3)
    torch.testing.assert_close(windowed_paged_attention(*args), reference.paged_attention(*args))
    # A window as long as the context changes nothing; a shorter one does.
    torch.testing.assert_close(
        windowed_paged_attention(*args, sliding_window=15), reference.paged_attention(*args)
    )
    assert not torch.allclose(
        windowed_paged_attention(*args, sliding_window=3), reference.paged_attention(*args)
    )


def test_model_impl_on_the_command_lines() -> None:
    from sluicegate.engine.worker import build_parser, engine_kwargs
    from sluicegate.gateway.up import build_parser as up_parser

    args = build_parser().parse_args(["--model", "m", "--model-impl", "transformers"])
    assert engine_kwargs(args)["model_impl"] == "transformers"
    assert "model_impl" not in engine_kwargs(build_parser().parse_args(["--model", "m"]))
    assert up_parser().parse_args(["--model-impl", "native"]).model_impl == "native"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "m", "--model-impl", "vllm"])


def test_model_impl_choice_and_errors(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    cpu = torch.device("cpu")
    with pytest.raises(UnsupportedModelError, match="supported: LlamaForCausalLM"):
        load_model(hf_dirs["phi3"], cpu, model_impl="native")
    with pytest.raises(ValueError, match="unknown model_impl"):
        load_model(hf_dirs["phi3"], cpu, model_impl="vllm")

    def config_only(name: str, config: transformers.PretrainedConfig) -> Path:
        config.save_pretrained(tmp_path / name)
        return tmp_path / name

    mamba = config_only("mamba", transformers.MambaConfig(num_hidden_layers=2, hidden_size=32))
    with pytest.raises(UnsupportedModelError, match="state-space state does not fit"):
        load_model(mamba, cpu)
    bloom = config_only("bloom", transformers.BloomConfig(n_layer=2, hidden_size=32, n_head=4))
    with pytest.raises(UnsupportedModelError, match="cannot take a custom attention"):
        load_model(bloom, cpu)
    hybrid = config_only(
        "qwen3_next",
        transformers.Qwen3NextConfig(
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
        ),
    )
    with pytest.raises(UnsupportedModelError, match="linear_attention layers"):
        load_model(hybrid, cpu)
    bart = config_only("bart", transformers.BartConfig(encoder_layers=1, decoder_layers=1))
    with pytest.raises(UnsupportedModelError, match="encoder-decoder"):
        load_model(bart, cpu)
    # Mllama's causal-LM class is a text decoder whose cross-attention layers are listed in
    # its text_config, not at the top of the config AutoConfig returns.
    mllama = config_only(
        "mllama",
        transformers.MllamaConfig(
            text_config={"num_hidden_layers": 2, "cross_attention_layers": [1]},
            vision_config={"num_hidden_layers": 1, "num_global_layers": 1},
        ),
    )
    with pytest.raises(UnsupportedModelError, match="uses cross-attention"):
        load_model(mllama, cpu)
    gpt2 = config_only("gpt2", transformers.GPT2Config(n_layer=2, add_cross_attention=True))
    with pytest.raises(UnsupportedModelError, match="uses cross-attention"):
        load_model(gpt2, cpu)


def test_attention_patterns_our_paged_attention_lacks_are_refused(tmp_path: Path) -> None:
    """Layer types other than full and sliding attention are refused naming the pattern, at
    the top of the config and in a multimodal config's text config: served on our paged
    attention, Llama-4's chunked layers would attend to the whole context once a prompt
    passes the chunk size, silently giving wrong output."""
    cpu = torch.device("cpu")

    def refusal(name: str, config: transformers.PretrainedConfig) -> str:
        config.save_pretrained(tmp_path / name)
        with pytest.raises(UnsupportedModelError) as refused:
            load_model(tmp_path / name, cpu)
        message = str(refused.value)
        assert "state-space" not in message, message
        return message

    # Llama-4's causal-LM class is built from the multimodal config, whose text config lists
    # its chunked-attention layers (every fourth layer is full attention).
    llama4 = transformers.Llama4Config(
        text_config={"num_hidden_layers": 4, "attention_chunk_size": 8192},
        vision_config={"num_hidden_layers": 1},
    )
    assert "chunked_attention" in llama4.get_text_config().layer_types
    assert getattr(llama4, "layer_types", None) is None
    message = refusal("llama4", llama4)
    assert "chunked_attention layers" in message
    assert "chunked attention" in message and "8192 tokens" in message
    # The same layers at the top of a text-only config.
    message = refusal("llama4_text", transformers.Llama4TextConfig(num_hidden_layers=4))
    assert "chunked_attention layers" in message and "only full and sliding-window" in message
    # Indexer-picked sparse attention in a text config (Dots3Note).
    dots = transformers.Dots3NoteConfig(
        text_config={
            "num_hidden_layers": 2,
            "layer_types": ["indexed_attention", "sliding_attention"],
        }
    )
    assert getattr(dots, "layer_types", None) is None
    message = refusal("dots3_note", dots)
    assert "indexed_attention layers" in message and "indexed/sparse attention" in message
    # Recurrent layers in a text config keep the recurrent message.
    qwen35 = tmp_path / "qwen3_5"
    transformers.Qwen3_5Config(
        text_config={
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
        }
    ).save_pretrained(qwen35)
    with pytest.raises(UnsupportedModelError, match="linear_attention layers: their recurrent"):
        load_model(qwen35, cpu)


def test_sliding_and_full_attention_in_a_text_config_pass_the_checks() -> None:
    """Gemma-3's multimodal config lists sliding and full layers in its text config: both are
    what our paged attention implements, so the layer-type checks let it through."""
    from transformers import AutoModelForCausalLM

    from sluicegate.engine.models.transformers_backend import check_supported

    gemma3 = transformers.Gemma3Config(
        text_config={
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
        }
    )
    check_supported(gemma3, AutoModelForCausalLM._model_mapping[type(gemma3)])
    gemma2 = transformers.Gemma2Config(num_hidden_layers=2)
    assert set(gemma2.layer_types) == {"sliding_attention", "full_attention"}
    check_supported(gemma2, AutoModelForCausalLM._model_mapping[type(gemma2)])
