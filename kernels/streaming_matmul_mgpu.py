"""Weight-streaming matmul on Mosaic GPU (`pallas.mosaic_gpu`, the maintained Hopper backend):
the same product and `ref_` twin (`layers.linear`) as `streaming_matmul`, a second backend beside it.
Per program, an `emit_pipeline` of TMA
copies (num_stages tiles in flight) feeding wgmma with an fp32 accumulator. wgmma rows come
in 64s, so the row block is 64 (128 past 64 rows): TMA zero-fills the rows past M, and the
[block_m, N] result is sliced to M rows. No masks: K must divide into block_k * split_k
tiles and N into block_n columns (`mgpu_config` picks sizes that do for the real shapes).
Checked at the call, then one jitted function with the configuration static (one lowering
per configuration and shape in a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from ._common import is_pow2, one_lowering_per_config, resolve_interpret
from ._mgpu import tile_transforms
from .streaming_config import NUM_SMS, Config, check_matmul_inputs

__all__ = ["mgpu_config", "streaming_matmul_mgpu"]


def mgpu_config(m: int, k: int, n: int) -> Config:
    """64 (else 32) wide tiles that divide K and N; the largest split of the K tiles that
    divides them, gives <= ~2 programs per SM and keeps the partials <= half the weight."""
    block_k = 64 if k % 64 == 0 else 32
    block_n = 64 if n % 64 == 0 else 32
    tiles, bm = k // block_k, (64 if m <= 64 else 128)
    cap = max(1, min(16, round(2 * NUM_SMS / (n // block_n)), k // (4 * bm)))
    split_k = max(d for d in range(1, cap + 1) if tiles % d == 0)
    return Config(block_n, block_k, split_k, 4, 4)


def streaming_matmul_mgpu(
    x,  # [M, K] bf16/fp16, M in 1..128
    w,  # [K, N], x's dtype
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_stages: int | None = None,
    interpret: bool | None = None,
):
    """x @ w with fp32 accumulation rounded once to x's dtype -> [M, N] (= layers.linear),
    on Mosaic GPU (interpret: its CPU interpreter)."""
    m, k, n = check_matmul_inputs(x, w)
    interpret = resolve_interpret(interpret)
    if x.dtype == jnp.float32:
        raise ValueError("streaming_matmul_mgpu takes bfloat16/float16 (wgmma would round fp32 to tf32)")
    cfg = mgpu_config(m, k, n)._replace(**{key: v for key, v in dict(
        block_n=block_n, block_k=block_k, split_k=split_k, num_stages=num_stages).items() if v is not None})
    bn, bk, splits = cfg.block_n, cfg.block_k, cfg.split_k
    if k % (bk * splits) or n % bn or not (is_pow2(bn) and is_pow2(bk) and min(bn, bk) >= 16):
        raise ValueError(f"Mosaic GPU tiles must divide the product: K={k} into block_k={bk} x "
                         f"split_k={splits}, N={n} into block_n={bn} (powers of two >= 16)")
    return _kernel_call(x, w, cfg=cfg, interpret=interpret)


@one_lowering_per_config("cfg", "interpret")
def _kernel_call(x, w, *, cfg: Config, interpret: bool):
    """The kernel and its split-K reduction, for inputs and a configuration
    `streaming_matmul_mgpu` checked."""
    (m, k), n = x.shape, w.shape[1]
    bn, bk, splits = cfg.block_n, cfg.block_k, cfg.split_k
    bm, steps, dtype = (64 if m <= 64 else 128), k // (bk * splits), x.dtype
    transforms = tile_transforms(min(bn, bk), dtype)

    def body(x_gmem, w_gmem, o_gmem):  # x [M, K]; w [K, N]; o [block_m, N] or [S, block_m, N] f32
        j, s = jax.lax.axis_index("n"), jax.lax.axis_index("s")

        def step(_, x_smem, w_smem, acc):  # x_smem [block_m, bk]; w_smem [bk, bn]
            plmgpu.wgmma(acc, x_smem, w_smem)
            plmgpu.wgmma_wait(0)
            return acc

        def scope(acc_ref):  # [block_m, bn] f32
            k_slice = pl.ds(s * steps * bk, steps * bk)
            plmgpu.emit_pipeline(
                step, grid=(steps,), max_concurrent_steps=cfg.num_stages, init_carry=acc_ref,
                in_specs=[plmgpu.BlockSpec((bm, bk), lambda t: (0, t), transforms=transforms),
                          plmgpu.BlockSpec((bk, bn), lambda t: (t, 0), transforms=transforms)],
            )(x_gmem.at[:, k_slice], w_gmem.at[k_slice, pl.ds(j * bn, bn)])
            if splits == 1:
                o_gmem[:, pl.ds(j * bn, bn)] = acc_ref[...].astype(o_gmem.dtype)
            else:
                o_gmem[s, :, pl.ds(j * bn, bn)] = acc_ref[...]

        pl.run_scoped(scope, plmgpu.ACC((bm, bn), jnp.float32))

    out_type = (jax.ShapeDtypeStruct((bm, n), dtype) if splits == 1
                else jax.ShapeDtypeStruct((splits, bm, n), jnp.float32))
    out = plmgpu.kernel(body, out_type=out_type, grid=(n // bn, splits), grid_names=("n", "s"),
                    interpret=plmgpu.InterpretGPUParams() if interpret else None)(x, w)
    return (out if splits == 1 else jnp.sum(out, axis=0).astype(dtype))[:m]
