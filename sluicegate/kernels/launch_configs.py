"""Launch configurations of the paged-attention kernel per GPU family (compute capability).

Each entry gives, for decode and for prefill tiles: the key tile (``tile_n`` positions, at
least one cache block), the query-row tile of prefill (``block_m``; decode always takes the
smallest tensor-core tile, 16 rows), ``num_warps`` and ``num_stages`` (Triton's software
pipelining depth for the K/V loads).

How the entries were chosen: NOT measured. No entry has been timed on its GPU; they are
reasoned from the kernel's per-stage shared-memory footprint and each family's limits:

- one pipeline stage holds a K tile and a V tile, ``2 * tile_n * head_dim_pad * bytes``:
  at head dim 128 in bf16, 32 KiB for ``tile_n`` 64 and 64 KiB for 128; prefill adds the
  Q tile, ``block_m * head_dim_pad * bytes`` (16 KiB at 64 rows, 32 KiB at 128);
- sm_90 (H100/H200) has 227 KiB of shared memory per block and the highest HBM bandwidth:
  decode is bandwidth-bound, so longer key tiles (128) with 3 stages keep more bytes in
  flight (3 x 64 KiB fits); prefill takes 128 query rows over 8 warps (the wgmma-sized tile)
  with 64-key tiles and 3 stages (32 + 3 x 32 KiB);
- sm_80 (A100, 163 KiB): the same decode tiles with 2 stages; prefill 64 rows, 4 warps;
- sm_86/sm_89 (consumer Ampere/Ada, 99 KiB): 64-key tiles, 2 stages;
- anything else (and the CPU interpreter): the kernel's original defaults, which every test
  runs.

Head dims above 128 halve ``tile_n`` and ``block_m`` (the tiles and the fp32 accumulator
double), as the defaults always did. Measured replacements belong here, with the bench line
that measured them (``bench/kernels.py`` on the GPU in question).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    tile_n: int
    block_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class FamilyConfig:
    decode: TileConfig
    prefill: TileConfig


DEFAULT = FamilyConfig(
    decode=TileConfig(tile_n=64, block_m=16, num_warps=4, num_stages=2),
    prefill=TileConfig(tile_n=64, block_m=64, num_warps=4, num_stages=2),
)

# (major, minor) compute capability -> configuration; a major alone matches any minor.
FAMILIES: dict[tuple[int, int | None], FamilyConfig] = {
    (9, 0): FamilyConfig(  # H100, H200 (reasoned, not measured)
        decode=TileConfig(tile_n=128, block_m=16, num_warps=4, num_stages=3),
        prefill=TileConfig(tile_n=64, block_m=128, num_warps=8, num_stages=3),
    ),
    (8, 0): FamilyConfig(  # A100 (reasoned, not measured)
        decode=TileConfig(tile_n=128, block_m=16, num_warps=4, num_stages=2),
        prefill=TileConfig(tile_n=64, block_m=64, num_warps=4, num_stages=2),
    ),
    (8, None): DEFAULT,  # sm_86 / sm_89: the defaults fit their 99 KiB
}


def family_config(capability: tuple[int, int] | None) -> FamilyConfig:
    """The table's entry for a compute capability; None (CPU, interpreter) gets DEFAULT."""
    if capability is None:
        return DEFAULT
    major, minor = capability
    return FAMILIES.get((major, minor)) or FAMILIES.get((major, None)) or DEFAULT


def tile_config(config: FamilyConfig, *, is_decode: bool, head_dim_pad: int) -> TileConfig:
    tiles = config.decode if is_decode else config.prefill
    if head_dim_pad <= 128:
        return tiles
    return TileConfig(
        tile_n=max(16, tiles.tile_n // 2),
        block_m=tiles.block_m if is_decode else max(16, tiles.block_m // 2),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
