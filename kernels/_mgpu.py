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


# ------------------------------------------ programs of one kernel synchronizing through counters
# (kernels/persistent_mlp.py: a counters Ref, not Pallas semaphores; each waiting program has its
# own counter, a signaller adds 1 to each waiter's, a waiter takes its count back off)

def proxy_fence():
    """fence.proxy.async.global: generic-proxy stores by other programs (a phase's outputs), acquired
    through a counter, become visible to this program's TMA (async-proxy) loads."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm

    @plmgpu.inline_mgpu()
    def fence(ctx):
        del ctx
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.global;", "",
                        has_side_effects=True)

    fence()


def signal_counters(counters, count: int):
    """Add 1 to each of counters[0:count] (a slice of the counters ref) after the warpgroup's
    earlier stores: a barrier, one release fence at GPU scope, then relaxed adds from one
    thread (a release add per counter fences every time: bench/RESULTS.md run 25)."""
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plmgpu.inline_mgpu(arg_types=(plmgpu.RefType(),))
    def signal(ctx, ref):
        del ctx
        mgpu_utils.warpgroup_barrier()
        mgpu_utils.inline_ptx("fence.acq_rel.gpu;", has_side_effects=True)
        base = mgpu_utils.memref_ptr(ref)
        for i in range(count):
            ptr = mgpu_utils.getelementptr(base, [i], ir.IntegerType.get_signless(32))
            mgpu_utils.SemaphoreRef(ptr).signal(1, relaxed=True, memory_scope="gpu")

    signal(counters)


def wait_counter(counter, value: int):
    """Wait until counter (a one-element slice of the counters ref) holds `value`, then take
    it off (acquire at GPU scope): the counter is zero again for the next call."""
    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plmgpu.inline_mgpu(arg_types=(plmgpu.RefType(),))
    def wait(ctx, ref):
        del ctx
        mgpu_utils.SemaphoreRef(mgpu_utils.memref_ptr(ref)).wait(value, decrement=True, memory_scope="gpu")

    wait(counter)
