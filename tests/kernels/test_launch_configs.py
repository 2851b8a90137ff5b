"""The per-GPU-family launch table: lookups, and that every entry makes valid tiles."""

from __future__ import annotations

import pytest
import torch

from sluicegate.kernels.launch_configs import DEFAULT, FAMILIES, family_config, tile_config
from sluicegate.kernels.triton_paged_attention import plan_tiles


def test_lookup_by_capability() -> None:
    assert family_config((9, 0)) is FAMILIES[9, 0]
    assert family_config((8, 0)) is FAMILIES[8, 0]
    assert family_config((8, 9)) is DEFAULT  # Ada: the sm_8x entry
    assert family_config((12, 0)) is DEFAULT
    assert family_config(None) is DEFAULT


def test_default_keeps_the_kernels_original_tiles() -> None:
    decode = plan_tiles(is_decode=True, group=4, head_dim=128, block_size=16,
                        dtype=torch.bfloat16, interpreting=False)  # fmt: skip
    prefill = plan_tiles(is_decode=False, group=4, head_dim=256, block_size=16,
                         dtype=torch.bfloat16, interpreting=False)  # fmt: skip
    assert (decode["BLOCK_M"], decode["TILE_N"]) == (16, 64)
    assert (prefill["BLOCK_M"], prefill["TILE_N"]) == (32, 32)


@pytest.mark.parametrize("capability", [None, *FAMILIES])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("is_decode", [True, False])
def test_every_entry_gives_power_of_two_tiles(capability, head_dim, is_decode) -> None:
    family = family_config(None if capability is None else (capability[0], capability[1] or 6))
    pad = 1 << (head_dim - 1).bit_length()
    config = tile_config(family, is_decode=is_decode, head_dim_pad=pad)
    for group in (1, 4, 7, 8):
        tiles = plan_tiles(is_decode=is_decode, group=group, head_dim=head_dim, block_size=16,
                           dtype=torch.bfloat16, interpreting=False, config=config)  # fmt: skip
        for name in ("BLOCK_M", "TILE_N", "HEAD_DIM_PAD"):
            value = tiles[name]
            assert isinstance(value, int) and value & (value - 1) == 0, (name, value)
        assert tiles["BLOCK_Q"] >= 1
        assert tiles["TILE_N"] >= 16
