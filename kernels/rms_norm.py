"""Fused RMSNorm kernels, bitwise twins of loopjax.layers.rms_norm (same casts, same order):

    rms_norm(x, weight, eps)                 = layers.rms_norm(x, weight, eps)
    add_rms_norm(x, residual, weight, eps)   = layers.add_rms_norm: rms_norm(x + residual)  (Huginn)
    rms_norm_add(x, residual, weight, eps)   = layers.rms_norm_add: residual + rms_norm(x)  (Ouro)

x, residual [N, H] and weight [H] share the activation dtype; out [N, H] in that dtype.
One program normalizes `block_rows` whole rows; the row is read once as a power-of-two
tile (masked past H) and summed with the warps XLA's own Triton fusion uses, which fixes
the f32 row sum's order (`default_num_warps`).
The body spells every op in f32 with explicit roundings to the dtype where the jaxpr rounds,
as XLA compiles the twin under layers.IDENTITY_COMPILER_OPTIONS (no excess precision; Triton
applies none of its own).
The `ref_` twins call the layers functions the models use.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from loopjax import layers

from ._common import compiler_params, load_tile, load_vec, next_pow2, resolve_interpret, store_tile

F32 = jnp.float32

__all__ = [
    "add_rms_norm",
    "check_rms_norm_inputs",
    "ref_add_rms_norm",
    "ref_rms_norm",
    "ref_rms_norm_add",
    "rms_norm",
    "rms_norm_add",
]


def check_rms_norm_inputs(x, weight, residual=None):
    """Shared validation: raises ValueError with a one-line message."""
    if x.ndim != 2:
        raise ValueError(f"x must be [N, H], got shape {x.shape}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}] (H), got shape {weight.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16) or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float dtype, got {x.dtype} and {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.dtype}{x.shape}), got {residual.dtype}{residual.shape}")


def ref_rms_norm(x, weight, eps: float):
    check_rms_norm_inputs(x, weight)
    return layers.rms_norm(x, weight, eps)


def ref_add_rms_norm(x, residual, weight, eps: float):
    check_rms_norm_inputs(x, weight, residual)
    return layers.add_rms_norm(x, residual, weight, eps)


def ref_rms_norm_add(x, residual, weight, eps: float):
    check_rms_norm_inputs(x, weight, residual)
    return layers.rms_norm_add(x, residual, weight, eps)


def _kernel(*refs, eps: float, block_rows: int, residual: str | None, round_each_op: bool, interpret: bool):
    # refs: x [N, H], (residual [N, H]), weight [H], out [N, H]
    x_ref, res_ref, w_ref, o_ref = refs if residual else (refs[0], None, *refs[1:])
    n, h = x_ref.shape
    dt = x_ref.dtype
    # NOTE: Triton needs a power-of-two tile; interpret mode reads the row as the ref does.
    width = h if interpret else next_pow2(h)
    r0 = pl.program_id(0) * block_rows
    xf = load_tile(x_ref, r0, block_rows, 0, width, n, h).astype(F32)  # [BN, W], 0 past the row
    if residual is not None:
        res = load_tile(res_ref, r0, block_rows, 0, width, n, h).astype(F32)
    if residual == "before":
        # NOTE: XLA with excess precision (its default) keeps this bf16 sum in f32 on CPU.
        xf = _rnd(xf + res, dt) if round_each_op else xf + res
    w = load_vec(w_ref, 0, width, h)[None, :].astype(F32)  # [1, W]
    # NOTE: XLA's algebraic simplifier turns mean's "/ h" into "* f32(1/h)" (seen in the H200's
    # optimized HLO, run 10); dividing differs from it in ~1e-5 of rows at non-power-of-two h.
    mean = jnp.sum(xf * xf, axis=-1, keepdims=True) * jnp.float32(1.0 / h)
    normed = xf * jax.lax.rsqrt(mean + eps)
    out = _rnd(w * _rnd(normed, dt), dt)  # normed rounded before the weight multiply
    if residual == "after":
        out = _rnd(res + out, dt)
    store_tile(o_ref, r0, 0, out.astype(dt), n, h)


def _rnd(x, dtype):
    """Round an f32 value to dtype and back (a no-op for f32)."""
    return x.astype(dtype).astype(F32)


def default_num_warps(h: int) -> int:
    """The warps XLA gives the model's norm: on the H200 it runs as a Triton fusion with 4 warps
    at H = 2048 and 8 at H = 5280 (optimized HLO, bench/RESULTS.md run 11). Triton's row sum
    runs in an order set by the warp layout, so with the same warps the kernel's f32 sum is
    XLA's, bit for bit (run 11: 0 of 10.8 M elements differ at 8 warps, 26-67 at 4)."""
    return 8 if next_pow2(h) > 4096 else 4


def _call(x, residual, weight, eps, mode, block_rows, num_warps, interpret, round_each_op=False):
    n, h = x.shape
    interpret = resolve_interpret(interpret)
    if num_warps is None:
        num_warps = default_num_warps(h)
    if block_rows is None:  # ~8K elements per program
        block_rows = max(1, min(next_pow2(n), 8192 // next_pow2(h)))
    kernel = functools.partial(
        _kernel,
        eps=eps,
        block_rows=block_rows,
        residual=mode,
        round_each_op=round_each_op,
        interpret=interpret,
    )
    args = (x, residual, weight) if mode else (x, weight)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(n, block_rows),),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="loopjax_rms_norm",
    )(*args)


def rms_norm(
    x,  # [N, H]
    weight,  # [H]
    eps: float,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
    interpret: bool | None = None,
):
    check_rms_norm_inputs(x, weight)
    return _call(x, None, weight, eps, None, block_rows, num_warps, interpret)


def add_rms_norm(
    x,  # [N, H]
    residual,  # [N, H]
    weight,  # [H]
    eps: float,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
    round_each_op: bool = True,
    interpret: bool | None = None,
):
    """round_each_op (default) rounds x + residual to the dtype, as the jaxpr says and as XLA
    does under layers.IDENTITY_COMPILER_OPTIONS (the models' compile options) on CPU and GPU;
    False keeps the sum in f32, as XLA's default excess precision does on CPU."""
    check_rms_norm_inputs(x, weight, residual)
    return _call(x, residual, weight, eps, "before", block_rows, num_warps, interpret, round_each_op)


def rms_norm_add(
    x,  # [N, H]
    residual,  # [N, H]
    weight,  # [H]
    eps: float,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
    interpret: bool | None = None,
):
    check_rms_norm_inputs(x, weight, residual)
    return _call(x, residual, weight, eps, "after", block_rows, num_warps, interpret)
