"""Incremental detokenizing: whole characters only, stop strings cut exactly and never streamed
in part (acceptance 3), checked on the byte-level test tokenizer and through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.text.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = (
    "Héllo wörld, naïve café — ☃ 日本語のテキスト 🚀🌊 The quick brown fox jumps over the lazy dog."
)


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> Tokenizer:
    return Tokenizer(llama_dir)


def stream(detokenizer: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
    deltas = []
    for token in tokens:
        detokenizer.add_token(token)
        deltas.append(detokenizer.pop_delta())
        if detokenizer.stopped:
            break
    deltas.append(detokenizer.pop_delta(final=True))
    return deltas


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    tokens = tokenizer.encode(TEXT)
    # The byte-level vocabulary splits some characters over several tokens.
    assert any("\ufffd" in tokenizer.decode([t]) for t in tokens)
    deltas = stream(IncrementalDetokenizer(tokenizer, [], None), tokens)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_prompt_context_keeps_the_first_word_boundary(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode(" world and more")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, None)
    assert "".join(stream(detokenizer, output)) == " world and more"


@pytest.mark.parametrize(
    ("stops", "expected"),
    [
        (["lazy dog"], TEXT[: TEXT.index("lazy dog")]),
        # "fox jumps" appears, but "fox jumps!" never does: held back, then released.
        (["fox jumps!", "the lazy"], TEXT[: TEXT.index("the lazy")]),
        (["日本"], TEXT[: TEXT.index("日本")]),
        (["🌊 The", "é"], TEXT[: TEXT.index("é")]),
        (["not there"], TEXT),
    ],
)
def test_stop_strings_cut_exactly_and_never_leak(
    tokenizer: Tokenizer, stops: list[str], expected: str
) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], stops)
    deltas = stream(detokenizer, tokenizer.encode(TEXT))
    emitted = ""
    for delta in deltas:
        emitted += delta
        # Streamed text is only ever a prefix of the final text, which holds no stop string.
        assert expected.startswith(emitted), (emitted, expected)
    assert emitted == expected == detokenizer.text
    assert detokenizer.stopped == (expected != TEXT)


def test_held_back_tail_is_released_when_the_request_ends(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, [], ["dog!!"])
    deltas = stream(detokenizer, tokenizer.encode("a lazy dog"))
    assert not deltas[-2].endswith("dog")  # held back while it could still become "dog!!"
    assert "".join(deltas) == "a lazy dog"


def _stop_candidate(text: str) -> str:
    """A 3-character substring starting a little into the text, without replacement chars."""
    for start in range(6, len(text) - 3):
        candidate = text[start : start + 3]
        if "\ufffd" not in candidate and candidate.strip():
            return candidate
    raise AssertionError(f"no stop candidate in {text!r}")


async def test_engine_stop_string_matches_offline_and_streaming(llama_dir: Path) -> None:
    prompt = "The quick brown fox"
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    full = llm.generate(prompt, greedy)[0]
    stop = _stop_candidate(full.text)
    expected = full.text[: full.text.index(stop)]

    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
    cut = llm.generate(prompt, params)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == expected
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    assert llm.stats()["kv_blocks_used"] == 0

    async with AsyncEngine(llama_dir, num_kv_blocks=64) as engine:
        emitted, last = "", None
        async for delta in engine.add_request("s", prompt, params=params):
            emitted += delta.text
            assert expected.startswith(emitted)
            last = delta
        assert emitted == expected
        assert last is not None and last.finish_reason == "stop"
