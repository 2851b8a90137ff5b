"""Prices and costs in exact integer micro-units."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from sluicegate.gateway.usage.pricing import Price, from_micros, prices_from_config, to_micros


def test_amounts_convert_to_micro_units_exactly() -> None:
    assert [to_micros(v) for v in (0, 2.0, "0.5", 12.345678, 0.0000005, "1e-6")] == [
        0,
        2_000_000,
        500_000,
        12_345_678,
        1,
        1,
    ]
    assert from_micros(1_500_000) == 1.5
    for bad in (-1, "abc", float("nan"), float("inf")):
        with pytest.raises(ValueError):
            to_micros(bad)


def test_cost_rounds_once_and_the_worst_case_bounds_every_outcome() -> None:
    price = Price(
        input_micros=2_000_000,
        cached_input_micros=500_000,
        output_micros=10_000_000,
        currency="USD",
    )
    assert price.cost_micros(1_000_000, 0) == 2_000_000
    assert price.cost_micros(2, 5) == 54
    assert price.cost_micros(1000, 100, cached_tokens=400) == 1200 + 200 + 1000
    # Half a micro-unit rounds up, less rounds down; cached tokens never exceed the prompt.
    odd = Price(1, 1, 1, "USD")
    assert odd.cost_micros(500_000, 0) == 1 and odd.cost_micros(499_999, 0) == 0
    assert price.cost_micros(10, 0, cached_tokens=50) == price.cost_micros(10, 0, cached_tokens=10)
    for prompt, completion, cached in itertools.product((0, 7, 999), (0, 3, 1024), (0, 5)):
        assert price.cost_micros(prompt, completion, cached) <= price.worst_case_micros(
            prompt, completion
        )


def test_prices_from_the_routing_yaml(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n"
        "  - name: big\n"
        "    aliases: [large]\n"
        "    price: {input: 2.0, cached_input: 0.5, output: 10.0, currency: usd}\n"
        "    deployments: []\n"
        "  - name: free\n"
        "    deployments: []\n"
    )
    prices = prices_from_config(str(path), "USD")
    assert prices["big"] == prices["large"] == Price(2_000_000, 500_000, 10_000_000, "USD")
    assert "free" not in prices

    for spec, message in (
        ("{input: 1, output: 1, currency: EUR}", "differs from the gateway's USD"),
        ("{input: 1}", "needs input and output"),
        ("{input: 1, output: 1, per: token}", "unknown price fields"),
        ("{input: -1, output: 1}", "finite number >= 0"),
    ):
        path.write_text(f"models:\n  - name: m\n    price: {spec}\n")
        with pytest.raises(ValueError, match=message):
            prices_from_config(str(path), "USD")
