"""Prompt lookup proposals and ``speculative_config`` parsing (plain Python)."""

from __future__ import annotations

import pytest

from sluicegate.engine.spec.config import SpeculativeConfig
from sluicegate.engine.spec.ngram import propose_ngram


def test_the_tokens_after_the_suffix_earlier_occurrence_are_proposed() -> None:
    tokens = [7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert propose_ngram(tokens, 3, 2, 4) == [4, 5, 6]
    assert propose_ngram(tokens, 10, 2, 4) == [4, 5, 6, 9, 1, 2, 3]


def test_the_longest_suffix_wins_and_the_latest_occurrence_of_it() -> None:
    # The 3-gram [1, 2, 3] occurs once, followed by 8; the 2-gram [2, 3] later, followed by 5.
    tokens = [1, 2, 3, 8, 0, 2, 3, 5, 1, 2, 3]
    assert propose_ngram(tokens, 1, 2, 3) == [8]
    assert propose_ngram(tokens, 1, 2, 2) == [5]
    tokens = [4, 4, 1, 9, 4, 4, 1, 7, 4, 4, 1]
    assert propose_ngram(tokens, 2, 3, 3) == [7, 4]


def test_nothing_is_proposed_without_an_earlier_occurrence_of_at_least_min_tokens() -> None:
    assert propose_ngram([1, 2, 3, 4, 5, 9, 8, 3], 3, 2, 4) == []
    assert propose_ngram([1, 2, 3, 4, 5, 9, 8, 3], 3, 1, 4) == [4, 5, 9]
    assert propose_ngram([3, 3], 3, 2, 4) == []
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []


def test_a_proposal_overlapping_the_suffix_itself_is_cut_at_the_end() -> None:
    assert propose_ngram([5, 5, 5, 5], 3, 1, 3) == [5]


def test_config_parses_as_vllm_spells_it() -> None:
    text = (
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
        '"prompt_lookup_min": 1}'
    )
    config = SpeculativeConfig.parse(text)
    assert (config.num_speculative_tokens, config.prompt_lookup_max) == (5, 3)
    assert config.prompt_lookup_min == 1
    assert SpeculativeConfig.parse({"disable_by_batch_size": 2}).disable_by_batch_size == 2
    assert SpeculativeConfig.parse(config) is config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"method": "eagle"}, "method 'eagle' is not supported"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"num_spec_tokens": 4}, "unknown speculative_config keys: num_spec_tokens"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_bad_configs_are_refused_naming_what_is_wrong(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)  # type: ignore[arg-type]
