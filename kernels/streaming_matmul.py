"""Weight-streaming matmul for decode: few activation rows times a large weight.

    streaming_matmul(x [M, K], w [K, N]) -> [M, N] in x's dtype   (= layers.linear)

At M = 1..128 rows the product is bound by reading w from HBM once, so the kernel is laid
out for the weight stream, not for the FLOPs:
- all M rows live in one row block (block_m = next power of two >= max(16, M); rows past M
  are masked loads reading 0, never a padded copy of x), so every weight byte is read once;
- the grid is (column blocks, K splits): with few column blocks the K range is split
  (`split_k`) so that enough programs keep all 132 SMs loading; each split writes an fp32
  partial [split_k, M, N] that XLA sums and rounds (the epilogue then runs in that fusion);
- each program walks its K range in [block_k, block_n] weight tiles (contiguous along N, so
  Triton can issue 16-byte loads; `num_stages` tiles in flight through its software
  pipeline; evict-first, since a decode step reads each weight once), accumulating in fp32
  with `jnp.dot(..., preferred_element_type=f32)`; the result is rounded once to x's dtype;
- K need not be a multiple of block_k (the last split also reads a masked tail tile), nor N
  of block_n (masked columns).

Fused epilogues (in-kernel when split_k == 1, in the XLA reduction otherwise):
    streaming_matmul_add(x, w, residual [M, N])      = linear(x, w) + residual
    streaming_matmul_accumulate(x, w, acc [M, N] f32) = layers.linear_accumulate (always the
        fp32 partials, S >= 1, summed with acc in XLA, rounded once)
    streaming_matmul_silu_mul(x, w_gate_up [K, 2F])  = layers.silu_mul(gate, up)
with gate, up = split(linear(x, w_gate_up)) (columns [gate | up], docs/design.md); SiLU in
fp32 rounded once, then * up rounded once, as layers.silu_mul (and kernels/silu_mul.py).
Ouro's RoPE epilogue (q, k, v of the qkv product): kernels/streaming_matmul_rope.py, on
this kernel's K loop (`_accumulate`); the sandwich norms after a product, on its "partials":
kernels/streaming_matmul_norms.py.

Fused RMSNorm prologue (any of the three, `norm_weight=[K], norm_eps=eps`): the product
takes layers.rms_norm(x, norm_weight, eps) instead of x. Each program first computes the
inverse RMS of its rows over the whole K row (x is tiny next to the weight: M*K elements
per program, one row at a time; with split_k > 1 every split reads all of x once), then
normalizes every x tile as it loads it, with rms_norm's casts and order (fp32 statistics,
the normalized row rounded to the dtype before the weight multiply). In interpret mode the
normalized row is bitwise layers.rms_norm's (jitted, on CPU).

`interpret=None` (the default) runs the interpreter unless the backend is a GPU.

Each has a `ref_` twin (pure XLA, the same keyword arguments) sharing `check_matmul_inputs`.
Block sizes come from `TUNED` (data: (K, N, block_m) -> Config, measured by
`python -m loopjax.bench.matmul --sweep` on the H200), else from `default_config`; explicit
keyword arguments override both. The inputs are checked and the configuration settled at
the call; the kernel runs in one jitted function with the configuration static, so the
call sites of a step with the same shapes and configuration share one lowering. The
`layers.Ops` entries built on them live in loopjax/matmul_ops.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from loopjax import layers

from ._common import load_tile, next_pow2, one_lowering_per_config, resolve_interpret
from .silu_mul import _silu
from .streaming_config import (  # noqa: F401  (the kernel's configuration and validation)
    MAX_ROWS,
    NUM_SMS,
    SMEM_BUDGET,
    TUNED,
    Config,
    _check_config,
    _fit_stages,
    block_rows,
    check_matmul_inputs,
    default_config,
    default_split,
    pick_config,
)

__all__ = [
    "TUNED",
    "Config",
    "block_rows",
    "check_matmul_inputs",
    "default_config",
    "default_split",
    "pick_config",
    "ref_streaming_matmul",
    "ref_streaming_matmul_accumulate",
    "ref_streaming_matmul_add",
    "ref_streaming_matmul_silu_mul",
    "streaming_matmul",
    "streaming_matmul_accumulate",
    "streaming_matmul_add",
    "streaming_matmul_silu_mul",
]

# ------------------------------------------------------------------------------ references


def _ref_input(x, norm_weight, norm_eps):
    """What the product multiplies: x, or layers.rms_norm(x) with the fused prologue."""
    return x if norm_weight is None else layers.rms_norm(x, norm_weight, norm_eps)


def ref_streaming_matmul(x, w, *, norm_weight=None, norm_eps=None):
    check_matmul_inputs(x, w, norm_weight=norm_weight, norm_eps=norm_eps)
    return layers.linear(_ref_input(x, norm_weight, norm_eps), w)


def ref_streaming_matmul_add(x, w, residual, *, norm_weight=None, norm_eps=None):
    check_matmul_inputs(x, w, residual, norm_weight=norm_weight, norm_eps=norm_eps)
    return layers.linear(_ref_input(x, norm_weight, norm_eps), w) + residual


def ref_streaming_matmul_silu_mul(x, w_gate_up, *, norm_weight=None, norm_eps=None):
    check_matmul_inputs(x, w_gate_up, gate_up=True, norm_weight=norm_weight, norm_eps=norm_eps)
    gate, up = jnp.split(layers.linear(_ref_input(x, norm_weight, norm_eps), w_gate_up), 2, axis=-1)
    return layers.silu_mul(gate, up)


def ref_streaming_matmul_accumulate(x, w, acc):
    check_matmul_inputs(x, w)
    return layers.linear_accumulate(x, w, acc)


# ------------------------------------------------------------------------------ the kernel


def _mask(shape, r0=0, rows=None, c0=0, cols=None, ok=None):
    """bool `shape` mask from the parts that apply: row r0+i in [lo, hi) for rows = (lo, hi),
    column c0+j in [lo, hi) for cols = (lo, hi), scalar ok. None when nothing is masked."""
    parts = []
    for axis, start, bounds in ((0, r0, rows), (1, c0, cols)):
        if bounds is not None:
            idx = start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
            lo, hi = bounds
            parts.append(idx < hi if isinstance(lo, int) and lo == 0 else (idx >= lo) & (idx < hi))
    if ok is not None:
        parts.append(jnp.broadcast_to(ok, shape))
    return functools.reduce(jnp.logical_and, parts) if parts else None


def _load(ref, r0, rows: int, c0, cols: int, mask, evict: bool):
    """ref[r0:r0+rows, c0:c0+cols] (2-D ref); masked entries read as 0."""
    window = ref.at[pl.ds(r0, rows), pl.ds(c0, cols)]
    policy = "evict_first" if evict else None  # NOTE: weights are read once per step
    if mask is None:
        return plgpu.load(window, eviction_policy=policy)
    return plgpu.load(window, mask=mask, other=0, eviction_policy=policy)


def _inv_rms_rows(x_ref, block_m: int, eps: float, interpret: bool):
    """[block_m, 1] f32: rsqrt(mean(x.f32^2) + eps) of each of x's M rows (0 past M), as
    layers.rms_norm computes it, over the whole row. On the GPU one row at a time, as a
    power-of-two tile masked past K (a whole row block would not fit in registers); in
    interpret mode all of x at once ([M, K], padded after), so that XLA runs the sum in the
    order it runs layers.rms_norm's (bitwise on CPU)."""
    m, k = x_ref.shape

    def inv_rms(xf):  # [rows, width] f32, 0 past K -> [rows, 1]
        mean = jnp.sum(xf * xf, axis=-1, keepdims=True) * jnp.float32(1.0 / k)
        return jax.lax.rsqrt(mean + eps)

    if interpret:
        return jnp.pad(inv_rms(x_ref[...].astype(jnp.float32)), ((0, block_m - m), (0, 0)))
    rows = jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)

    def one_row(r, inv):
        xf = load_tile(x_ref, r, 1, 0, next_pow2(k), m, k).astype(jnp.float32)  # [1, W]
        return jnp.where(rows == r, inv_rms(xf), inv)

    return jax.lax.fori_loop(0, m, one_row, jnp.zeros((block_m, 1), jnp.float32))


def _normalize(xt, inv, nw):
    """rms_norm's tail on an x tile: (x.f32 * inv) rounded to the dtype, then * weight rounded
    (the dtype's multiply). xt [block_m, bk] dtype; inv [block_m, 1] f32; nw [1, bk] dtype."""
    f32, dt = jnp.float32, xt.dtype
    normed = (xt.astype(f32) * inv).astype(dt)
    return (nw.astype(f32) * normed.astype(f32)).astype(dt)


def _accumulate(x_ref, w_ref, nw_ref, col_offsets, col_limit, *, block_m: int, cfg: Config,
                norm_eps: float | None, interpret: bool):
    """This program's share of x @ w (its K split, program_id(1)): one fp32 [block_m, block_n]
    accumulator per weight column tile w[:, off:off+block_n], off in col_offsets (the SiLU and
    RoPE epilogues stream two tiles at once). col_limit = (c, n): local column i of every tile
    counts while c + i < n (a masked last column block), or None. nw_ref [1, K]: the RMSNorm
    prologue's weight (norm_eps), or None."""
    m, k = x_ref.shape
    bn, bk, splits = cfg.block_n, cfg.block_k, cfg.split_k
    s, x_rows_masked = pl.program_id(1), m < block_m
    c0, cols = (0, None) if col_limit is None else (col_limit[0], (0, col_limit[1]))
    inv_rms = None if nw_ref is None else _inv_rms_rows(x_ref, block_m, norm_eps, interpret)

    num_full = k // bk  # unmasked K tiles; the K tail (k % bk) is one masked tile
    per_split = -(-num_full // splits)
    start = s * per_split
    end = jnp.minimum(start + per_split, num_full)

    def step(accs, k0, k_range):
        """accs += x[:, k0:k0+bk] @ w[k0:k0+bk, tile columns]; k_range = (lo, hi): the K
        rows to count (the tail tile), else None."""
        ok = None if k_range is None else s == splits - 1
        xm = _mask((block_m, bk), 0, (0, m) if x_rows_masked else None, k0, k_range, ok)
        xt = _load(x_ref, 0, block_m, k0, bk, xm, False)  # [block_m, bk]
        if inv_rms is not None:  # NOTE: a tile only runs past K when K < bk (then k0 = 0)
            nm = _mask((1, bk), 0, None, k0, (0, k)) if k < bk else None
            xt = _normalize(xt, inv_rms, _load(nw_ref, 0, 1, k0, bk, nm, False))
        wm = _mask((bk, bn), k0, k_range, c0, cols, ok)
        wts = [_load(w_ref, k0, bk, off, bn, wm, True) for off in col_offsets]  # [bk, bn] each
        return tuple(a + jnp.dot(xt, wt, preferred_element_type=jnp.float32)
                     for a, wt in zip(accs, wts, strict=True))

    def body(b, accs):
        return step(accs, pl.multiple_of(b * bk, bk), None)

    accs = tuple(jnp.zeros((block_m, bn), jnp.float32) for _ in col_offsets)
    accs = jax.lax.fori_loop(start, end, body, accs)
    if k % bk:
        # NOTE: the tail tile ends at K (overlapping the last full tile, whose rows it masks)
        # so that no slice leaves the array; only the last split counts it.
        accs = step(accs, max(k - bk, 0), (num_full * bk, k))
    return accs


def _kernel(
    x_ref,  # [M, K]
    w_ref,  # [K, N_w]   (N_w = N, or 2F for the SiLU epilogues: columns [gate | up])
    *refs,  # r_ref [M, N] if epilogue == "add"; nw_ref [1, K] if norm_eps is not None;
    #         then o_ref [M, N] dtype or [S, M, N] f32
    block_m: int,
    cfg: Config,
    epilogue: str,  # "none" | "add" | "silu"
    norm_eps: float | None,  # None: no RMSNorm prologue
    interpret: bool,
):
    r_ref = refs[0] if epilogue == "add" else None
    nw_ref = refs[-2] if norm_eps is not None else None
    o_ref = refs[-1]
    m, n, bn = x_ref.shape[0], o_ref.shape[-1], cfg.block_n  # n: output columns (F for SiLU)
    c0 = pl.multiple_of(pl.program_id(0) * bn, bn)
    col_offsets = (c0, c0 + n) if epilogue == "silu" else (c0,)  # gate, up
    x_rows_masked, cols_masked = m < block_m, n % bn != 0
    accs = _accumulate(x_ref, w_ref, nw_ref, col_offsets, (c0, n) if cols_masked else None,
                       block_m=block_m, cfg=cfg, norm_eps=norm_eps, interpret=interpret)

    out_mask = _mask((block_m, bn), 0, (0, m) if x_rows_masked else None, c0, (0, n) if cols_masked else None)
    window = (pl.ds(0, block_m), pl.ds(c0, bn))
    if len(o_ref.shape) == 3:  # fp32 partials [S, M, N]; the caller reduces and applies the epilogue
        plgpu.store(o_ref.at[(pl.program_id(1), *window)], accs[0], mask=out_mask)
        return
    dtype = o_ref.dtype
    out = accs[0].astype(dtype)
    if epilogue == "add":
        out = out + _load(r_ref, 0, block_m, c0, bn, out_mask, False)
    elif epilogue == "silu":
        up = accs[1].astype(dtype)
        act = _silu(out, jnp.float32, interpret).astype(dtype)
        out = (act.astype(jnp.float32) * up.astype(jnp.float32)).astype(dtype)
    plgpu.store(o_ref.at[window], out, mask=out_mask)


def _call(x, w, residual, epilogue: str, interpret: bool | None, overrides: dict,
          norm_weight=None, norm_eps: float | None = None):
    """Checks the inputs and settles the configuration (outside the jit: one-line errors at
    the call), then runs `_kernel_call`."""
    m, k, n_w = check_matmul_inputs(x, w, residual if epilogue != "accumulate" else None,
                                    gate_up=epilogue == "silu", norm_weight=norm_weight, norm_eps=norm_eps)
    if epilogue == "accumulate" and (residual.shape != (m, n_w) or residual.dtype != jnp.float32):
        raise ValueError(f"acc must be float32[{m}, {n_w}], got {residual.dtype}{residual.shape}")
    cfg = pick_config(m, k, n_w, x.dtype, **overrides)
    _check_config(cfg, k)
    fused_silu = cfg.split_k == 1 and epilogue == "silu"
    cfg = _fit_stages(cfg, block_rows(m), 2 if fused_silu else 1, x.dtype.itemsize)
    residual = residual if epilogue in ("add", "accumulate") else None
    return _kernel_call(x, w, residual, norm_weight, cfg=cfg, epilogue=epilogue,
                        norm_eps=None if norm_weight is None else float(norm_eps),
                        interpret=resolve_interpret(interpret))


@one_lowering_per_config("cfg", "epilogue", "norm_eps", "interpret")
def _kernel_call(x, w, residual, norm_weight, *, cfg: Config, epilogue: str,
                 norm_eps: float | None, interpret: bool):
    """The kernel and its split-K reduction and epilogue, for inputs `_call` checked and the
    configuration it settled; residual None unless epilogue == "add"; norm_weight None
    exactly when norm_eps is None."""
    m, k = x.shape
    n_w = w.shape[1]
    block_m = block_rows(m)
    fused = cfg.split_k == 1 and epilogue != "accumulate"  # "accumulate": the fp32 sums, S >= 1
    n_out = n_w // 2 if (fused and epilogue == "silu") else n_w
    kernel_epilogue = epilogue if fused and epilogue != "partials" else "none"
    if fused:
        out_shape = jax.ShapeDtypeStruct((m, n_out), x.dtype)
    else:
        out_shape = jax.ShapeDtypeStruct((cfg.split_k, m, n_out), jnp.float32)
    kernel = functools.partial(_kernel, block_m=block_m, cfg=cfg, epilogue=kernel_epilogue,
                               norm_eps=norm_eps, interpret=interpret)
    operands = (x, w) + ((residual,) if kernel_epilogue == "add" else ())  # "partials": none
    if norm_eps is not None:
        operands += (norm_weight.reshape(1, k),)  # NOTE: 2-D for the tile loads (a bitcast)
    prologue = "_norm" if norm_eps is not None else ""
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(pl.cdiv(n_out, cfg.block_n), cfg.split_k),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"loopjax_streaming_matmul{prologue}_{epilogue}",
    )(*operands)
    if fused or epilogue == "partials":
        return out
    if epilogue == "accumulate":  # NOTE: one fp32 sum with the other part, rounded once
        return (jnp.sum(out, axis=0) + residual).astype(x.dtype)
    # NOTE: split-K: XLA fuses the partial sum, the rounding and the epilogue in one kernel.
    y = jnp.sum(out, axis=0).astype(x.dtype)
    if epilogue == "add":
        return y + residual
    if epilogue == "silu":
        return layers.silu_mul(*jnp.split(y, 2, axis=-1))
    return y


def _overrides(block_n: int | None = None, block_k: int | None = None, split_k: int | None = None,
               num_warps: int | None = None, num_stages: int | None = None) -> dict:
    """The block-size keywords every entry point takes (`**blocks`): None keeps TUNED's (else
    default_config's) value; a misspelt name is a TypeError at the call."""
    return dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                num_stages=num_stages)


def streaming_matmul(
    x,  # [M, K], M in 1..128
    w,  # [K, N], x's dtype
    *,
    norm_weight=None,  # [K], x's dtype: multiply layers.rms_norm(x, norm_weight, norm_eps)
    norm_eps: float | None = None,
    interpret: bool | None = None,
    **blocks,  # _overrides' keywords
):
    """x @ w with fp32 accumulation rounded once to x's dtype -> [M, N] (= layers.linear)."""
    return _call(x, w, None, "none", interpret, _overrides(**blocks), norm_weight, norm_eps)


def streaming_matmul_add(
    x,  # [M, K]
    w,  # [K, N]
    residual,  # [M, N], x's dtype
    *,
    norm_weight=None,  # [K]: the product takes layers.rms_norm(x, norm_weight, norm_eps)
    norm_eps: float | None = None,
    interpret: bool | None = None,
    **blocks,  # _overrides' keywords
):
    """linear(x, w) + residual -> [M, N] (the product rounded before the add, as XLA does)."""
    return _call(x, w, residual, "add", interpret, _overrides(**blocks), norm_weight, norm_eps)


def streaming_matmul_silu_mul(
    x,  # [M, K]
    w_gate_up,  # [K, 2F], columns [gate | up]
    *,
    norm_weight=None,  # [K]: the product takes layers.rms_norm(x, norm_weight, norm_eps)
    norm_eps: float | None = None,
    interpret: bool | None = None,
    **blocks,  # _overrides' keywords
):
    """layers.silu_mul(gate, up) of linear(x, w_gate_up) -> [M, F]."""
    return _call(x, w_gate_up, None, "silu", interpret, _overrides(**blocks), norm_weight, norm_eps)


def streaming_matmul_accumulate(
    x,  # [M, K]
    w,  # [K, N]
    acc,  # [M, N] float32: another part of the same sum
    *,
    interpret: bool | None = None,
    **blocks,  # _overrides' keywords
):
    """layers.linear_accumulate: (x @ w + acc) with the product's fp32 accumulator (every
    split's partial) summed with acc in XLA and rounded once to x's dtype."""
    return _call(x, w, acc, "accumulate", interpret, _overrides(**blocks))
