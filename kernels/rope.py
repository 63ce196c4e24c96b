"""Fused RoPE over the fused QKV projection, bitwise twins of the XLA path the models use.

    rope_rotate_half_qk(qkv, cos, sin, num_heads=, num_kv_heads=) -> (q, k)      (Ouro)
        qkv [N, (Hq + 2*Hkv) * D], columns [q | k | v], head-major inside each;
        = layers.rope_rotate_half_qk (q = layers.rope_rotate_half(q heads, cos, sin), k likewise).
    rope_interleaved_qk(qkv, qk_bias, cos, sin) -> (q, k)                          (Huginn)
        qkv [N, 3 * Hq * D] as above with Hkv = Hq; qk_bias [2, Hq, D];
        = layers.rope_interleaved_qk (q = rope_interleaved(q heads + qk_bias[0]), k with [1]).

cos, sin [N, D/2] fp32 (layers.rope_angles); q [N, Hq, D], k [N, Hkv, D] in qkv's dtype.
v stays a slice of qkv. The body spells every op in f32 with explicit roundings to the
dtype where the jaxpr rounds (XLA under layers.IDENTITY_COMPILER_OPTIONS; Triton adds no
excess precision).
One program per (row block, q-or-k head); q and k heads are contiguous in qkv, so head j
starts at column j * D for both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from loopjax import layers

from ._common import compiler_params, load_tile, next_pow2, resolve_interpret, store_tile

__all__ = [
    "check_rope_inputs",
    "ref_rope_interleaved_qk",
    "ref_rope_rotate_half_qk",
    "rope_interleaved_qk",
    "rope_rotate_half_qk",
]

F32 = jnp.float32


def check_rope_inputs(qkv, cos, sin, num_heads: int, num_kv_heads: int, qk_bias=None):
    """Shared validation: raises ValueError with a one-line message; returns (N, D)."""
    if qkv.ndim != 2:
        raise ValueError(f"qkv must be [N, (Hq + 2*Hkv) * D], got shape {qkv.shape}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    n, width = qkv.shape
    d, rem = divmod(width, num_heads + 2 * num_kv_heads)
    if rem or d % 2:
        raise ValueError(f"qkv width {width} is not (Hq + 2*Hkv) * D with an even D")
    if qkv.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"qkv must be float32, bfloat16 or float16, got {qkv.dtype}")
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape != (n, d // 2) or a.dtype != F32:
            raise ValueError(f"{name} must be float32 [{n}, {d // 2}] (N, D/2), got {a.dtype}{a.shape}")
    if qk_bias is not None and qk_bias.shape != (2, num_heads, d):
        raise ValueError(f"qk_bias must be [2, {num_heads}, {d}], got {qk_bias.shape}")
    return n, d


def ref_rope_rotate_half_qk(qkv, cos, sin, *, num_heads: int, num_kv_heads: int):
    check_rope_inputs(qkv, cos, sin, num_heads, num_kv_heads)
    return layers.rope_rotate_half_qk(qkv, cos, sin, num_heads, num_kv_heads)


def ref_rope_interleaved_qk(qkv, qk_bias, cos, sin):
    h = qk_bias.shape[1] if qk_bias.ndim == 3 else -1
    check_rope_inputs(qkv, cos, sin, h, h, qk_bias)
    return layers.rope_interleaved_qk(qkv, qk_bias, cos, sin)


def _rnd(x, dtype):
    """Round an f32 value to dtype and back (a no-op for f32)."""
    return x.astype(dtype).astype(F32)


def _rotated_halves(x1, x2, cos, sin, dt):
    """f32 halves (x1*c + (-x2)*s, x2*c + x1*s) of a head's halves x1, x2 (f32 values of dt)
    and f32 cos, sin of one shape, c and s rounded to dt and every op rounded, as
    layers.rope_rotate_half computes in dt (also the qkv product's RoPE epilogue,
    kernels/streaming_matmul_rope.py)."""
    c, s = _rnd(cos, dt), _rnd(sin, dt)
    return _rnd(_rnd(x1 * c, dt) + _rnd(-x2 * s, dt), dt), _rnd(_rnd(x2 * c, dt) + _rnd(x1 * s, dt), dt)


def _rotate_half(x_ref, cos_ref, sin_ref, r0, col, bn, half, w2):
    """Rows r0.. of the head at column `col`: _rotated_halves [BN, W2]."""
    n, dt = x_ref.shape[0], x_ref.dtype
    x1 = load_tile(x_ref, r0, bn, col, w2, n, half).astype(F32)
    x2 = load_tile(x_ref, r0, bn, col + half, w2, n, half).astype(F32)
    cos, sin = (load_tile(a, r0, bn, 0, w2, n, half) for a in (cos_ref, sin_ref))
    return _rotated_halves(x1, x2, cos, sin, dt)


def _interleaved(x_ref, bias_ref, cos_ref, sin_ref, r0, j, col, bn, d, w, round_each_op):
    """Rows r0.. of head j at column `col`: [BN, W] f32 pairs of layers.rope_interleaved
    applied to x + bias. round_each_op rounds that bf16 sum as the jaxpr says (XLA under
    layers.IDENTITY_COMPILER_OPTIONS); False keeps it in f32, as XLA's default excess
    precision does on CPU (it feeds an f32 cast)."""
    n, dt = x_ref.shape[0], x_ref.dtype
    x = load_tile(x_ref, r0, bn, col, w, n, d).astype(F32)
    b = load_tile(bias_ref, j, 1, 0, w, bias_ref.shape[0], d).astype(F32)  # [1, W]
    x = (_rnd(x + b, dt) if round_each_op else x + b).reshape(bn, w // 2, 2)
    x0, x1 = (a.reshape(bn, w // 2) for a in jnp.split(x, 2, axis=-1))
    c = load_tile(cos_ref, r0, bn, 0, w // 2, n, d // 2)
    s = load_tile(sin_ref, r0, bn, 0, w // 2, n, d // 2)
    return jnp.stack([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1).reshape(bn, w)


def _kernel(
    *refs, num_heads: int, d: int, block_rows: int, interleaved: bool, round_each_op: bool, interpret: bool
):
    # refs: qkv [N, (Hq+2Hkv)*D], (qk_bias [2*Hq, D]), cos [N, D/2], sin [N, D/2],
    #       q_out [N, Hq*D], k_out [N, Hkv*D]
    if interleaved:
        x_ref, bias_ref, cos_ref, sin_ref, q_ref, k_ref = refs
    else:
        (x_ref, cos_ref, sin_ref, q_ref, k_ref), bias_ref = refs, None
    n = x_ref.shape[0]
    r0, j = pl.program_id(0) * block_rows, pl.program_id(1)
    col = j * d
    if interleaved:
        w = d if interpret else next_pow2(d)
        outs = [
            (
                0,
                _interleaved(x_ref, bias_ref, cos_ref, sin_ref, r0, j, col, block_rows, d, w, round_each_op),
                d,
            )
        ]
    else:
        half = d // 2
        w2 = half if interpret else next_pow2(half)
        out1, out2 = _rotate_half(x_ref, cos_ref, sin_ref, r0, col, block_rows, half, w2)
        outs = [(0, out1, half), (half, out2, half)]

    def store(o_ref, head):
        for off, val, valid in outs:
            store_tile(o_ref, r0, head * d + off, val.astype(o_ref.dtype), n, valid)

    pl.when(j < num_heads)(lambda: store(q_ref, j))
    pl.when(j >= num_heads)(lambda: store(k_ref, j - num_heads))


def _call(
    qkv, qk_bias, cos, sin, num_heads, num_kv_heads, d, block_rows, num_warps, interpret, round_each_op=False
):
    n = qkv.shape[0]
    interpret = resolve_interpret(interpret)
    if block_rows is None:
        block_rows = max(1, min(next_pow2(n), 2048 // next_pow2(d)))
    kernel = functools.partial(
        _kernel,
        num_heads=num_heads,
        d=d,
        block_rows=block_rows,
        interleaved=qk_bias is not None,
        round_each_op=round_each_op,
        interpret=interpret,
    )
    args = (qkv, cos, sin) if qk_bias is None else (qkv, qk_bias.reshape(2 * num_heads, d), cos, sin)
    q, k = pl.pallas_call(
        kernel,
        out_shape=[
            jax.ShapeDtypeStruct((n, num_heads * d), qkv.dtype),
            jax.ShapeDtypeStruct((n, num_kv_heads * d), qkv.dtype),
        ],
        grid=(pl.cdiv(n, block_rows), num_heads + num_kv_heads),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="loopjax_rope_qk",
    )(*args)
    return q.reshape(n, num_heads, d), k.reshape(n, num_kv_heads, d)


def rope_rotate_half_qk(
    qkv,  # [N, (Hq + 2*Hkv) * D]
    cos,  # [N, D/2] f32
    sin,  # [N, D/2] f32
    *,
    num_heads: int,
    num_kv_heads: int,
    block_rows: int | None = None,
    num_warps: int = 4,
    interpret: bool | None = None,
):
    _, d = check_rope_inputs(qkv, cos, sin, num_heads, num_kv_heads)
    return _call(qkv, None, cos, sin, num_heads, num_kv_heads, d, block_rows, num_warps, interpret)


def rope_interleaved_qk(
    qkv,  # [N, 3 * Hq * D]
    qk_bias,  # [2, Hq, D]
    cos,  # [N, D/2] f32
    sin,  # [N, D/2] f32
    *,
    block_rows: int | None = None,
    num_warps: int = 4,
    round_each_op: bool = True,
    interpret: bool | None = None,
):
    """round_each_op: see _interleaved (default: rounded, as the models compile)."""
    h = qk_bias.shape[1] if qk_bias.ndim == 3 else -1
    _, d = check_rope_inputs(qkv, cos, sin, h, h, qk_bias)
    if qk_bias.dtype != qkv.dtype:
        qk_bias = qk_bias.astype(qkv.dtype)  # NOTE: as the model does before the add
    return _call(qkv, qk_bias, cos, sin, h, h, d, block_rows, num_warps, interpret, round_each_op)
