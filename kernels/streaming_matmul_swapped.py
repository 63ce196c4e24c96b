"""Weight-streaming matmul on Mosaic GPU for 1-64 rows: each program streams its weight tiles
through a ring of TMA copies into wgmma, with the operands swapped by default (`swap_ab`: the
weight tile is wgmma's 64-row A, x the B operand of M rows padded to 8/16/32/64), and can return
the split-K fp32 partials for a norms kernel to sum (`swapped_partials`, the default for Ouro's
wo and w_down at 8-64 rows: matmul_ops.MOSAIC_ROWS, bench/RESULTS.md run 18).
Contract: the same product and `ref_` twin (`layers.linear`) as `streaming_matmul`:
x [M, K] @ w [K, N] with fp32 accumulation, rounded once to x's dtype.

Layout: per program a ring of `num_stages` slots, each a [block_k, block_n] weight tile and
the x tile beside it (rows past M are zero-filled by TMA and never stored); x's whole K range
is loaded once when it fits X_ONCE_BYTES. Swapped, the result is stored through a transposed
view of the output. `swap_ab=False` takes x as wgmma's A in 64-row tiles (any M up to 64).
The kernel began as the Programmatic Dependent Launch experiment (its weights' first copies
issued before the previous kernel ended): the early launch does nothing under XLA on jax
0.11.2 (runs 17, 29 and 30) and was removed; the weights are still fetched before x.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from ._common import SMEM_BUDGET, one_lowering_per_config, resolve_interpret
from ._mgpu import B_ROWS, b_rows, stream_tiles, tile_transforms
from .streaming_config import Config, check_matmul_inputs

__all__ = ["default_config", "partials_problem", "streaming_matmul_swapped", "swapped_partials"]

ROWS = 64  # wgmma's row block: M <= 64 rows per call
X_ONCE_BYTES = 32 * 1024  # x's K range up to this size is loaded whole, before the first tile


def default_config(m: int, k: int, n: int) -> Config:
    """64-wide tiles (32 where 64 does not divide: Huginn's 5280); the smallest split of the K
    tiles that gives >= 128 programs (else the largest up to 16); as many stages as fit two
    programs per SM (a grid of up to two waves all resident at once)."""
    block_k = 64 if k % 64 == 0 else 32
    block_n = 64 if n % 64 == 0 else 32
    tiles = k // block_k
    split_k = next((d for d in range(1, 17) if tiles % d == 0 and (n // block_n) * d >= 128), 1)
    if (n // block_n) * split_k < 128:
        split_k = max(d for d in range(1, 17) if tiles % d == 0)
    stage_bytes = 2 * (block_k * block_n + ROWS * block_k)
    stages = max(2, min(tiles // split_k, SMEM_BUDGET // 2 // stage_bytes))
    return Config(block_n, block_k, split_k, 4, stages)


def partials_problem(x, w) -> str | None:
    """Why the swapped product's partials (the default configuration) cannot take these
    inputs (a one-line reason), or None. Assumes x [M, K] and w [K, N] of x's dtype."""
    (m, k), n = x.shape, w.shape[1]
    cfg = default_config(m, k, n)
    if x.dtype == jnp.float32 or m not in B_ROWS:
        return f"the swapped partials take bfloat16/float16 and M in {B_ROWS}, got {x.dtype} M={m}"
    if cfg.block_n != ROWS or k % (cfg.block_k * cfg.split_k):
        return f"the swapped partials take K and N multiples of {ROWS}, got K={k}, N={n}"
    return None


def swapped_partials(x, w, *, interpret: bool | None = None):
    """The split-K fp32 partials [split_k, M, N] of x [M, K] @ w [K, N] (their sum is the
    product), swapped operands, default configuration; M in 8, 16, 32, 64 (`partials_problem`)."""
    return streaming_matmul_swapped(x, w, partials=True, interpret=interpret)


def streaming_matmul_swapped(x, w, *, swap_ab: bool = True, partials: bool = False,
                             block_n: int | None = None, block_k: int | None = None,
                             split_k: int | None = None, num_stages: int | None = None,
                             interpret: bool | None = None):
    """x [M, K] @ w [K, N] -> [M, N] in x's dtype (M <= 64, bf16/fp16), fp32 accumulation.
    swap_ab: each program takes out^T = w_tile^T @ x^T (the weight tile is wgmma's 64-row A,
    x the B operand of M rows padded to 8/16/32/64): x tiles of 8 rows instead of 64 at 1 row;
    needs block_n 64. partials: the split-K fp32 partials [split_k, M, N] instead of their
    sum (for a norms kernel that sums them, kernels/rms_norm.py); M must then be its own row
    padding (8, 16, 32 or 64 with swap_ab), so that no slice copies them."""
    m, k, n = check_matmul_inputs(x, w)
    interpret = resolve_interpret(interpret)
    if x.dtype == jnp.float32:
        raise ValueError("streaming_matmul_swapped takes bfloat16/float16 (wgmma would round fp32 to tf32)")
    if m > ROWS:
        raise ValueError(f"streaming_matmul_swapped takes at most {ROWS} rows, got {m}")
    cfg = default_config(m, k, n)._replace(**{key: v for key, v in dict(
        block_n=block_n, block_k=block_k, split_k=split_k, num_stages=num_stages).items()
        if v is not None})
    if k % (cfg.block_k * cfg.split_k) or n % cfg.block_n:
        raise ValueError(f"Mosaic GPU tiles must divide the product: K={k} into block_k="
                         f"{cfg.block_k} x split_k={cfg.split_k}, N={n} into block_n={cfg.block_n}")
    if swap_ab and cfg.block_n != ROWS:
        raise ValueError(f"swap_ab takes block_n {ROWS} (wgmma's A rows), got {cfg.block_n}")
    if partials and m != _x_rows(m, swap_ab):
        raise ValueError(f"partials take M = the row padding ({_x_rows(m, swap_ab)}), got M={m}")
    out = _kernel_call(x, w, cfg=cfg, swap_ab=swap_ab, interpret=interpret)
    if partials:
        return out if cfg.split_k > 1 else out.astype(jnp.float32)[None]
    return (out if cfg.split_k == 1 else jnp.sum(out, axis=0).astype(x.dtype))[:m]


def _x_rows(m: int, swap_ab: bool) -> int:
    """x's tile rows: M padded to 8/16/32/64 swapped (wgmma's B), else wgmma's 64 A rows."""
    return b_rows(m) if swap_ab else ROWS


@one_lowering_per_config("cfg", "swap_ab", "interpret")
def _kernel_call(x, w, *, cfg: Config, swap_ab: bool, interpret: bool):
    (m, k), n = x.shape, w.shape[1]
    bn, bk, splits, stages = cfg.block_n, cfg.block_k, cfg.split_k, cfg.num_stages
    steps, dtype = k // (bk * splits), x.dtype
    stages = min(max(2, stages), steps)  # NOTE: one slot would deadlock (refilled after the next wgmma)
    transforms = tile_transforms(min(bn, bk), dtype)
    rows = _x_rows(m, swap_ab)
    acc_shape = (bn, rows) if swap_ab else (ROWS, bn)
    # x's whole K range in one go when it is small (a few rows): one barrier wait, not one per tile
    x_once = rows * steps * bk * jnp.dtype(dtype).itemsize <= X_ONCE_BYTES

    def body(x_gmem, w_gmem, o_gmem, x_smem, w_smem, x_ready, w_ready):
        # x [M, K]; w [K, N]; o [rows, N] or [S, rows, N] f32; rings [stages, ...] (x's: [steps,
        # ...] when loaded once)
        j, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")
        k0 = s * steps * bk

        def fetch_w(t, slot):
            plmgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(k0 + t * bk, bk), pl.ds(j * bn, bn)],
                                     w_smem.at[slot], w_ready.at[slot])

        def fetch_x(t, slot):
            plmgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(0, rows), pl.ds(k0 + t * bk, bk)],
                                     x_smem.at[t if x_once else slot],
                                     x_ready.at[0 if x_once else slot])

        for t in range(stages):  # the weights first: they depend on nothing
            fetch_w(t, t)
        for t in range(steps if x_once else stages):
            fetch_x(t, t)

        def scope(acc_ref):  # acc_shape f32
            def fetch(t, slot):
                fetch_w(t, slot)
                if not x_once:
                    fetch_x(t, slot)

            def multiply(t, slot):
                xt = x_smem.at[t] if x_once else x_smem.at[slot]
                if swap_ab:
                    plmgpu.wgmma(acc_ref, w_smem.at[slot].T, xt.T)
                else:
                    plmgpu.wgmma(acc_ref, xt, w_smem.at[slot])

            if x_once:
                plmgpu.barrier_wait(x_ready.at[0])
            stream_tiles(steps, stages, (w_ready,) if x_once else (w_ready, x_ready), fetch,
                         multiply, groups=1)
            plmgpu.wgmma_wait(0)
            cols = pl.ds(j * bn, bn)
            out = acc_ref[...].astype(o_gmem.dtype)
            o_tile = o_gmem.at[:, cols] if splits == 1 else o_gmem.at[s, :, cols]  # [rows, bn]
            if swap_ab:  # NOTE: acc is out^T: 2x2-transposed registers store through a transposed view
                o_tile.T[...] = plmgpu.layout_cast(out, plmgpu.Layout.WGMMA_TRANSPOSED)
            else:
                o_tile[...] = out

        pl.run_scoped(scope, plmgpu.ACC(acc_shape, jnp.float32))

    out_shape = (rows, n)
    out_type = (jax.ShapeDtypeStruct(out_shape, dtype) if splits == 1
                else jax.ShapeDtypeStruct((splits, *out_shape), jnp.float32))
    scratch = [plmgpu.SMEM((steps if x_once else stages, rows, bk), dtype, transforms=transforms),
               plmgpu.SMEM((stages, bk, bn), dtype, transforms=transforms),
               plmgpu.Barrier(num_arrivals=steps, num_barriers=1) if x_once
               else plmgpu.Barrier(num_arrivals=1, num_barriers=stages),
               plmgpu.Barrier(num_arrivals=1, num_barriers=stages)]
    out = plmgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(n // bn, splits),
                        grid_names=("n", "s"), kernel_name="loopjax_streaming_matmul_swapped",
                        interpret=plmgpu.InterpretGPUParams() if interpret else None)(x, w)
    return out  # [rows, N] in the dtype, or [split_k, rows, N] f32 partials
