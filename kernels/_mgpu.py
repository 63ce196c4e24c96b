"""Helpers shared by the Mosaic GPU kernels of this folder (`pallas.mosaic_gpu`): the shared-
memory tile layout wgmma reads, and the ring of TMA-fed tiles a weight-streaming product runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from ._common import next_pow2

B_ROWS = (8, 16, 32, 64)  # wgmma B widths a swapped product (x as B) pads x's rows to


def b_rows(m: int) -> int:
    """x's M rows padded to a wgmma B width (B_ROWS; M <= 64) in a swapped product."""
    return max(B_ROWS[0], next_pow2(m))


def tile_transforms(cols: int, dtype):
    """Tiling + swizzle of a shared-memory tile whose rows are `cols` elements of dtype (the
    widest swizzle those bytes allow). NOTE: wgmma wants one swizzle for both operands."""
    swizzle = plmgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
    return (plmgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plmgpu.SwizzleTransform(swizzle))


def stream_tiles(num_tiles: int, num_slots: int, barriers, fetch, multiply, groups: int):
    """The ring of a product whose first num_slots tiles are in flight: for each tile t, wait
    for its slot's copies (each barrier in `barriers` at the slot), multiply(t, slot) (issuing
    `groups` wgmma groups), wait until tile t - 1's groups are done, then refill t - 1's slot
    with tile t - 1 + num_slots (fetch(tile, slot)). NOTE: a slot is refilled after the next
    tile's product is issued (one product in flight), so num_slots >= 2 unless one tile."""
    def step(t, _):
        slot = jax.lax.rem(t, num_slots)
        for barrier in barriers:
            plmgpu.barrier_wait(barrier.at[slot])
        multiply(t, slot)
        plmgpu.wgmma_wait(groups)

        @pl.when((t >= 1) & (t - 1 + num_slots < num_tiles))
        def _():
            fetch(t - 1 + num_slots, jax.lax.rem(t - 1, num_slots))

    jax.lax.fori_loop(0, num_tiles, step, None)
