"""Fused RMSNorm kernels, bitwise twins of loopjax.layers.rms_norm (same casts, same order):

    rms_norm(x, weight, eps)                 = layers.rms_norm(x, weight, eps)
    add_rms_norm(x, residual, weight, eps)   = layers.add_rms_norm: rms_norm(x + residual)  (Huginn)
    rms_norm_add(x, residual, weight, eps)   = layers.rms_norm_add: residual + rms_norm(x)  (Ouro)
    norm_add_norm(y, residual, weight, next_weight, eps) -> (h, rms_norm(h, next_weight))
        with h = rms_norm_add(y, residual, weight): the norms of layers.linear_norm_add_norm
        after its product, in one kernel; y may be the product's split-K fp32 partials (Ouro)
    add_norm_norm(y, residual, weight, next_weight, eps): the same with h = add_rms_norm(y,
        residual, weight), layers.linear_add_norm_norm's norms (Huginn)

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

from ._common import (
    compiler_params,
    load_tile,
    load_vec,
    next_pow2,
    one_lowering_per_config,
    resolve_interpret,
    store_tile,
)

F32 = jnp.float32

__all__ = [
    "add_norm_norm",
    "add_rms_norm",
    "check_rms_norm_inputs",
    "norm_add_norm",
    "ref_add_norm_norm",
    "ref_norm_add_norm",
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


def sum_partials(y, dtype):
    """The product a norm_add_norm takes: y itself ([N, H] in dtype), or its split-K fp32
    partials [S, N, H] summed in order s = 0..S-1 in f32 and rounded once to dtype."""
    if y.ndim == 2:
        return y
    total = y[0]
    for part in y[1:]:
        total = total + part
    return total.astype(dtype)


def ref_norm_add_norm(y, residual, weight, next_weight, eps: float):
    check_norm_add_norm_inputs(y, residual, weight, next_weight)
    h = layers.rms_norm_add(sum_partials(y, residual.dtype), residual, weight, eps)
    return h, layers.rms_norm(h, next_weight, eps)


def ref_add_norm_norm(y, residual, weight, next_weight, eps: float):
    check_norm_add_norm_inputs(y, residual, weight, next_weight)
    h = layers.add_rms_norm(sum_partials(y, residual.dtype), residual, weight, eps)
    return h, layers.rms_norm(h, next_weight, eps)


def check_norm_add_norm_inputs(y, residual, weight, next_weight):
    check_rms_norm_inputs(residual, weight)
    check_rms_norm_inputs(residual, next_weight)
    want = (residual.shape, residual.dtype)
    if y.ndim == 3 and (y.shape[1:], y.dtype) != (residual.shape, jnp.float32):
        raise ValueError(f"split-K partials must be float32[S, {residual.shape[0]}, {residual.shape[1]}], "
                         f"got {y.dtype}{y.shape}")
    if y.ndim != 3 and (y.shape, y.dtype) != want:
        raise ValueError(f"y must match residual ({residual.dtype}{residual.shape}) or be its "
                         f"float32[S, N, H] partials, got {y.dtype}{y.shape}")


def _normalize(xf, w, h: int, eps: float, dt):
    """rms_norm's body on an f32 tile [BN, W] (0 past the row) and weight [1, W]: the f32
    statistics, the normalized row rounded to dt before the weight multiply, rounded again."""
    # NOTE: XLA's algebraic simplifier turns mean's "/ h" into "* f32(1/h)" (seen in the H200's
    # optimized HLO, run 10); dividing differs from it in ~1e-5 of rows at non-power-of-two h.
    mean = jnp.sum(xf * xf, axis=-1, keepdims=True) * jnp.float32(1.0 / h)
    return _rnd(w * _rnd(xf * jax.lax.rsqrt(mean + eps), dt), dt)


def _norm_add_norm_kernel(y_ref, res_ref, w_ref, w_next_ref, h_ref, hn_ref, *, eps: float,
                          block_rows: int, num_partials: int, add_first: bool, interpret: bool):
    # y [S * N, H] f32 (S partial planes, one after the other) or [N, H]; residual, outs [N, H]
    n, h = res_ref.shape
    dt = res_ref.dtype
    width = h if interpret else next_pow2(h)
    r0 = pl.program_id(0) * block_rows
    y = load_tile(y_ref, r0, block_rows, 0, width, n, h).astype(F32)  # [BN, W], 0 past the row
    for s in range(1, num_partials):  # planes past the first: rows s*N + r0 ... below (s+1)*N
        y = y + load_tile(y_ref, s * n + r0, block_rows, 0, width, (s + 1) * n, h)
    y = _rnd(y, dt)
    res = load_tile(res_ref, r0, block_rows, 0, width, n, h).astype(F32)
    w = load_vec(w_ref, 0, width, h)[None, :].astype(F32)
    w_next = load_vec(w_next_ref, 0, width, h)[None, :].astype(F32)
    if add_first:  # Huginn: norm(y + residual), the sum rounded as layers.add_rms_norm's
        out = _normalize(_rnd(y + res, dt), w, h, eps, dt)
    else:  # Ouro: residual + norm(y)
        out = _rnd(res + _normalize(y, w, h, eps, dt), dt)
    store_tile(h_ref, r0, 0, out.astype(dt), n, h)
    store_tile(hn_ref, r0, 0, _normalize(out, w_next, h, eps, dt).astype(dt), n, h)


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
    out = _normalize(xf, w, h, eps, dt)
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


def _block_rows(n: int, h: int) -> int:
    return max(1, min(next_pow2(n), 8192 // next_pow2(h)))  # ~8K elements per program


def _call(x, residual, weight, eps, mode, block_rows, num_warps, interpret, round_each_op=False):
    n, h = x.shape
    interpret = resolve_interpret(interpret)
    if num_warps is None:
        num_warps = default_num_warps(h)
    if block_rows is None:
        block_rows = _block_rows(n, h)
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


def norm_add_norm(
    y,  # [N, H] a product's output, or its split-K partials float32[S, N, H]
    residual,  # [N, H]
    weight,  # [H]: the norm of y
    next_weight,  # [H]: the norm of the sum
    eps: float,
    *,
    num_warps: int | None = None,
    interpret: bool | None = None,
):
    """(h, rms_norm(h, next_weight)) for h = residual + rms_norm(y, weight) -> two [N, H]: Ouro's
    norms after a branch's last product and before the next branch's first, one kernel where
    XLA runs four or five (the partials' sum, two row statistics, the scalings)."""
    return _norms(y, residual, weight, next_weight, eps, False, num_warps, interpret)


def add_norm_norm(
    y,  # [N, H] a product's output, or its split-K partials float32[S, N, H]
    residual,  # [N, H]
    weight,  # [H]: the norm of the sum
    next_weight,  # [H]: the norm of the normed sum
    eps: float,
    *,
    num_warps: int | None = None,
    interpret: bool | None = None,
):
    """(h, rms_norm(h, next_weight)) for h = rms_norm(y + residual, weight) -> two [N, H]:
    Huginn's sandwich norm closing a branch and the next branch's input norm, one kernel.
    NOTE: on the H200 it differed from XLA's compile of the twin in 46 of 4 M elements (8-way
    partials, N = 128, H = 5280; bitwise at N = 2048 and on y alone: bench/RESULTS.md run 16),
    and it did not speed up the step, so matmul 'auto' does not use it."""
    return _norms(y, residual, weight, next_weight, eps, True, num_warps, interpret)


def _norms(y, residual, weight, next_weight, eps, add_first: bool, num_warps, interpret):
    check_norm_add_norm_inputs(y, residual, weight, next_weight)
    return _norm_add_norm_call(y, residual, weight, next_weight, eps=float(eps), add_first=add_first,
                               num_warps=num_warps or default_num_warps(residual.shape[1]),
                               interpret=resolve_interpret(interpret))


@one_lowering_per_config("eps", "add_first", "num_warps", "interpret")
def _norm_add_norm_call(y, residual, weight, next_weight, *, eps: float, add_first: bool, num_warps: int,
                        interpret: bool):
    """The kernel for checked inputs: one lowering per shape and configuration, shared by
    every call site of a step (kernels/_common.py)."""
    n, h = residual.shape
    # NOTE: one row per program: at decode's few rows the partials (S * H fp32 per row) are
    # the bytes, and one program per row spreads them over SMs (4 rows per program ran the
    # 8-row Ouro-1.4B step 3.6% slower than XLA's kernels, bench/RESULTS.md run 13).
    block_rows = 1
    kernel = functools.partial(_norm_add_norm_kernel, eps=eps, block_rows=block_rows,
                               num_partials=y.shape[0] if y.ndim == 3 else 1, add_first=add_first,
                               interpret=interpret)
    out = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    return pl.pallas_call(
        kernel,
        out_shape=(out, out),
        grid=(pl.cdiv(n, block_rows),),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="loopjax_add_norm_norm" if add_first else "loopjax_norm_add_norm",
    )(y.reshape(-1, h), residual, weight, next_weight)
