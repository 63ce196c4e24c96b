"""The qkv product with Ouro's RoPE in its epilogue: the weight-streaming matmul
(kernels/streaming_matmul.py) writing the attention's q, k and v itself, so that no kernel
runs between the product and the attention.

    streaming_matmul_rope_qkv(x [M, K], w_qkv [K, (Hq + 2*Hkv) * D], cos, sin [M, D/2] f32,
                              num_heads=Hq, num_kv_heads=Hkv) -> q [M, Hq, D], k, v [M, Hkv, D]
      = layers.linear_rope_rotate_half_qkv: the product rounded to x's dtype (layers.linear),
        layers.rope_rotate_half of its q and k heads, its v heads as they are.

Layout. Rotate-half pairs column c of a head with column c + D/2, and Triton cannot slice a
register tile, so a program owns two weight column tiles of block_n columns (block_n
divides D/2), [h*D + c0, +block_n) and [h*D + D/2 + c0, +block_n), streamed through the
plain kernel's K loop into two fp32 accumulators (as the SiLU epilogue's gate and up).
Program j takes head h = j // (D/2 / block_n) and the tile c0 of its halves: (Hq + 2*Hkv) *
D/2 / block_n programs, one K split each. A q or k head's halves are rotated with
cos/sin[:, c0:c0+block_n] in kernels/rope.py's f32 spelling of layers.rope_rotate_half
(every rounding of the dtype's ops; bitwise the XLA twin's in interpret mode, given the
same product); a v head's are stored as they are. Each program stores into the array its
head belongs to (q [M, Hq*D], k and v [M, Hkv*D], reshaped here, a bitcast): one [M, W]
output sliced afterwards would cost XLA a copy kernel per slice.

block_n: by default TUNED_ROPE_BLOCK_N's (measured), else the product's (TUNED, else
default_config), capped at the largest power of two dividing D/2; a keyword argument like
the other block sizes. Ouro-1.4B (D = 128): at 1-16 rows 64 (48 programs streaming two
[128, 64] tiles each, where the plain product runs 192 of [128, 32]), at 17-32 rows 32. split_k: 1
unless asked for (the epilogue needs the whole K sum in one program).
Not fused, and still correct: split_k > 1 (the plain kernel's partials summed in XLA, then
layers' RoPE), and a D/2 that no power of two >= 16 (Triton's dot tile) divides. No RMSNorm
prologue: Ouro's qkv product takes the norm_add_norm kernel's output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from loopjax import layers

from ._common import load_tile, one_lowering_per_config, pow2_floor, resolve_interpret, store_tile
from .rope import _rotated_halves, check_rope_inputs
from .streaming_config import (
    Config,
    _check_config,
    _fit_stages,
    block_rows,
    check_matmul_inputs,
    pick_config,
)
from .streaming_matmul import _accumulate, _overrides, streaming_matmul

__all__ = [
    "check_matmul_rope_inputs",
    "ref_streaming_matmul_rope_qkv",
    "rope_block_n",
    "streaming_matmul_rope_qkv",
]

MIN_BLOCK_N = 16  # Triton dot tiles


def check_matmul_rope_inputs(x, w_qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """Shared validation: the product's, then the RoPE's on the product's [M, N]; raises
    ValueError with a one-line message; returns (M, K, D)."""
    m, k, n = check_matmul_inputs(x, w_qkv)
    _, d = check_rope_inputs(jax.ShapeDtypeStruct((m, n), x.dtype), cos, sin, num_heads, num_kv_heads)
    return m, k, d


def ref_streaming_matmul_rope_qkv(x, w_qkv, cos, sin, *, num_heads: int, num_kv_heads: int):
    check_matmul_rope_inputs(x, w_qkv, cos, sin, num_heads, num_kv_heads)
    return layers.linear_rope_rotate_half_qkv(x, w_qkv, cos, sin, num_heads, num_kv_heads)


# (K, N, block_m) -> the fused kernel's block_n measured fastest on the H200 (bench/RESULTS.md
# run 14, `python -m loopjax.bench.matmul_rope`, product + RoPE alone): Ouro-1.4B's wqkv at 1
# row 17.1 us with 64 vs 23.6 with 32 (8 rows: 22.9 vs 22.7), at 32 rows 16.6 us with 32 vs
# 22.3 with 64. Elsewhere rope_block_n of the product's block_n.
TUNED_ROPE_BLOCK_N = {(2048, 6144, 16): 64, (2048, 6144, 32): 32}


def rope_block_n(block_n: int, d: int) -> int | None:
    """The epilogue's tile width for a product tile of block_n: at most block_n and the
    largest power of two dividing D/2; None when that is below MIN_BLOCK_N (not fused)."""
    half = d // 2
    width = min(pow2_floor(block_n), half & -half)
    return width if width >= MIN_BLOCK_N else None


def _kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, (Hq + 2*Hkv) * D], columns [q | k | v], head-major inside each
    cos_ref,  # [M, D/2] f32
    sin_ref,  # [M, D/2] f32
    q_ref,  # [M, Hq * D]
    k_ref,  # [M, Hkv * D]
    v_ref,  # [M, Hkv * D]
    *,
    block_m: int,
    cfg: Config,
    num_heads: int,
    num_kv_heads: int,
    interpret: bool,
):
    m = x_ref.shape[0]
    d = q_ref.shape[1] // num_heads
    half, bn = d // 2, cfg.block_n
    j = pl.program_id(0)
    head, c0 = j // (half // bn), pl.multiple_of(j % (half // bn) * bn, bn)
    col = pl.multiple_of(head * d + c0, bn)
    accs = _accumulate(x_ref, w_ref, None, (col, col + half), None, block_m=block_m, cfg=cfg,
                       norm_eps=None, interpret=interpret)
    dt = q_ref.dtype
    # NOTE: the product is rounded to the dtype before the RoPE, as layers.linear rounds it
    x1, x2 = (a.astype(dt).astype(jnp.float32) for a in accs)
    cos, sin = (load_tile(a, 0, block_m, c0, bn, m, bn) for a in (cos_ref, sin_ref))
    rotated = _rotated_halves(x1, x2, cos, sin, dt)

    def store(o_ref, h, halves):  # head h of o_ref: columns h*D + c0 and h*D + D/2 + c0
        for off, val in zip((0, half), halves, strict=True):
            store_tile(o_ref, 0, h * d + off + c0, val.astype(dt), m, bn)

    hk = num_heads + num_kv_heads
    pl.when(head < num_heads)(lambda: store(q_ref, head, rotated))
    pl.when((head >= num_heads) & (head < hk))(lambda: store(k_ref, head - num_heads, rotated))
    pl.when(head >= hk)(lambda: store(v_ref, head - hk, (x1, x2)))


@one_lowering_per_config("cfg", "num_heads", "num_kv_heads", "interpret")
def _kernel_call(x, w_qkv, cos, sin, *, cfg: Config, num_heads: int, num_kv_heads: int,
                 interpret: bool):
    """The fused kernel for inputs the entry checked and a configuration it settled
    (split_k == 1, block_n dividing D/2) -> (q, k, v)."""
    m = x.shape[0]
    heads = (num_heads, num_kv_heads, num_kv_heads)
    d = w_qkv.shape[1] // sum(heads)
    kernel = functools.partial(_kernel, block_m=block_rows(m), cfg=cfg, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, interpret=interpret)
    outs = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((m, h * d), x.dtype) for h in heads],
        grid=(sum(heads) * (d // 2 // cfg.block_n), 1),  # NOTE: axis 1 is _accumulate's K split
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="loopjax_streaming_matmul_rope",
    )(x, w_qkv, cos, sin)
    return tuple(o.reshape(m, h, d) for o, h in zip(outs, heads, strict=True))


def streaming_matmul_rope_qkv(
    x,  # [M, K], M in 1..128
    w_qkv,  # [K, (Hq + 2*Hkv) * D], x's dtype
    cos,  # [M, D/2] f32 (layers.rope_angles)
    sin,  # [M, D/2] f32
    *,
    num_heads: int,
    num_kv_heads: int,
    interpret: bool | None = None,
    **blocks,  # streaming_matmul's block-size keywords (block_n divides D/2; split_k 1 unless given)
):
    """layers.linear_rope_rotate_half_qkv -> (q [M, Hq, D], k [M, Hkv, D], v [M, Hkv, D])."""
    m, k, d = check_matmul_rope_inputs(x, w_qkv, cos, sin, num_heads, num_kv_heads)
    overrides = _overrides(**blocks)
    block_n = overrides["block_n"]
    split = {"split_k": 1 if overrides["split_k"] is None else overrides["split_k"]}  # NOTE: 1 unless asked
    cfg = pick_config(m, k, w_qkv.shape[1], x.dtype, **{**overrides, **split})
    _check_config(cfg, k)
    if block_n is not None and (d // 2) % block_n:
        raise ValueError(f"block_n must divide D/2 = {d // 2} (a program's tile of a head's half), "
                         f"got {block_n}")
    tuned = TUNED_ROPE_BLOCK_N.get((k, w_qkv.shape[1], block_rows(m)))
    width = block_n or (tuned if tuned and (d // 2) % tuned == 0 else rope_block_n(cfg.block_n, d))
    if cfg.split_k > 1 or width is None:  # NOTE: not fused (see the module docstring)
        qkv = streaming_matmul(x, w_qkv, interpret=interpret, **overrides)
        return layers.rope_rotate_half_qkv(qkv, cos, sin, num_heads, num_kv_heads)
    cfg = _fit_stages(cfg._replace(block_n=width), block_rows(m), 2, x.dtype.itemsize)
    return _kernel_call(x, w_qkv, cos, sin, cfg=cfg, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        interpret=resolve_interpret(interpret))
