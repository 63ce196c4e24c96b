"""Fused SiLU(gate) * up over the packed MLP projection gate_up [N, 2F] (columns
[gate | up], docs/design.md), bitwise twins of the XLA path the models use:

    silu_mul(gate_up)      = layers.silu_mul(gate, up)           (Huginn)
    silu_f32_mul(gate_up)  = models.ouro._silu_mul(gate, up)     (Ouro)

out [N, F] in gate_up's dtype. One program per (row block, column block).
GPU spelling: the sigmoid as XLA expands lax.logistic, 1 / (1 + exp(-x)) with an IEEE
divide, in f32 and rounded once to the dtype, then * up rounded once. NOTE: that is also
what XLA compiles layers.silu_mul to under jit (jax.nn.silu is one jitted unit; XLA keeps
its bf16 intermediates in f32, measured on CPU): jit(layers.silu_mul) == jit(ouro._silu_mul)
there. `round_each_op=True` spells the literal jaxpr instead (every sigmoid op rounded to
the dtype) in case the GPU compiler differs; bench/kernels.py checks both on the H200.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from loopjax import layers

from ._common import compiler_params, div_rn, load_tile, next_pow2, resolve_interpret, store_tile

__all__ = ["check_silu_inputs", "ref_silu_f32_mul", "ref_silu_mul", "silu_f32_mul", "silu_mul"]


def check_silu_inputs(gate_up):
    """Shared validation: raises ValueError with a one-line message."""
    if gate_up.ndim != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [N, 2F] (columns [gate | up]), got shape {gate_up.shape}")
    if gate_up.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"gate_up must be float32, bfloat16 or float16, got {gate_up.dtype}")
    return gate_up.shape[0], gate_up.shape[1] // 2


def ref_silu_mul(gate_up):
    _, f = check_silu_inputs(gate_up)
    return layers.silu_mul(gate_up[:, :f], gate_up[:, f:])


def _ouro_silu_mul():
    from loopjax.models import ouro  # NOTE: the model's own function is the reference

    return ouro._silu_mul


def ref_silu_f32_mul(gate_up):
    _, f = check_silu_inputs(gate_up)
    return _ouro_silu_mul()(gate_up[:, :f], gate_up[:, f:])


def _silu(g, compute_dtype, interpret: bool):
    """x * 1 / (1 + exp(-x)), each op computed in f32 and rounded to compute_dtype."""
    f32 = jnp.float32
    e = jnp.exp(-g.astype(f32)).astype(compute_dtype)
    d = (e.astype(f32) + 1.0).astype(compute_dtype)
    sig = div_rn(jnp.ones_like(d, f32), d.astype(f32), interpret).astype(compute_dtype)
    return (g.astype(f32) * sig.astype(f32)).astype(compute_dtype)


def _kernel(
    gu_ref, o_ref, *, block_rows: int, block_cols: int, act_f32: bool, round_each_op: bool, interpret: bool
):
    # gu_ref: [N, 2F]; o_ref: [N, F]
    n, f = o_ref.shape
    r0, c0 = pl.program_id(0) * block_rows, pl.program_id(1) * block_cols
    valid = f - c0
    gate = load_tile(gu_ref, r0, block_rows, c0, block_cols, n, valid)  # [BN, BF]
    up = load_tile(gu_ref, r0, block_rows, f + c0, block_cols, n, valid)  # [BN, BF]
    dtype = o_ref.dtype
    # NOTE: both twins compile to this under jit (act_f32 only names the twin).
    act = _silu(gate, dtype if round_each_op else jnp.float32, interpret).astype(dtype)
    out = (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(dtype)
    store_tile(o_ref, r0, c0, out, n, valid)


def _call(gate_up, act_f32, round_each_op, block_rows, block_cols, num_warps, interpret):
    n, f = check_silu_inputs(gate_up)
    interpret = resolve_interpret(interpret)
    if block_cols is None:  # NOTE: interpret mode has no power-of-two rule
        block_cols = f if interpret else min(1024, next_pow2(f))
    if block_rows is None:
        block_rows = max(1, min(next_pow2(n), 4096 // next_pow2(block_cols)))
    kernel = functools.partial(
        _kernel,
        block_rows=block_rows,
        block_cols=block_cols,
        act_f32=act_f32,
        round_each_op=round_each_op,
        interpret=interpret,
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, f), gate_up.dtype),
        grid=(pl.cdiv(n, block_rows), pl.cdiv(f, block_cols)),
        compiler_params=compiler_params(num_warps),
        interpret=interpret,
        name="loopjax_silu_mul",
    )(gate_up)


def silu_mul(
    gate_up,  # [N, 2F]
    *,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int = 4,
    round_each_op: bool = False,
    interpret: bool | None = None,
):
    return _call(gate_up, False, round_each_op, block_rows, block_cols, num_warps, interpret)


def silu_f32_mul(
    gate_up,  # [N, 2F]
    *,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int = 4,
    interpret: bool | None = None,
):
    return _call(gate_up, True, False, block_rows, block_cols, num_warps, interpret)
