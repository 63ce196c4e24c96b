"""Which dense-product implementation a step uses (`EngineConfig.matmul`): a `layers.Ops`.

- 'xla': XLA's dot for every product (layers.XLA_OPS).
- 'streaming': the Pallas weight-streaming kernel for every product up to 128 rows, with the
  RMSNorm fused into its prologue, and SiLU*up or Ouro's RoPE into its epilogue, where the
  model allows (kernels/streaming_matmul.py, streaming_matmul_rope.py; plain XLA above 128
  rows).
- 'auto': what was measured to win on the H200, product by product: the streaming kernel for
  every product of a step of fewer than 8 rows (run 2: 1 row Ouro-1.4B 9.5 vs 11.6 ms,
  Huginn-0125 34.9 vs 51.2 ms; run 11's per-product table: 1.1-4.0x XLA at 1 row), and from 8
  rows for the weight shapes and row counts in `STREAMING_MAX_ROWS`; XLA otherwise. Where a
  product streams, SiLU*up runs in its epilogue (linear_silu_mul) and the norms after it run
  on its split-K partials in one kernel (linear_norm_add_norm; run 13: the 1-row Ouro-1.4B step
  5,745 -> 4,969 us; Huginn's order, linear_add_norm_norm, keeps XLA's norms: run 16), and
  Ouro's RoPE runs in the qkv product's epilogue, which writes q, k, v
  (linear_rope_rotate_half_qkv; run 14: 1 row 5,017 -> 4,826 us, 32 rows 8,993 -> 8,768). The
  fused-norm prologue loses on the GPU (run 10: the weights-only Ouro step 6.9 vs 5.1 ms at
  1 row, 7.3 vs 4.7 ms at 8), so norm_linear* keep the norm in XLA. XLA's products there
  (`GPU_XLA_OPS`) return the activation dtype from the dot (layers.linear_in_dtype), so that
  cuBLAS writes bf16 and no convert kernel follows (run 14, 4 x 512 prefill steps: Ouro-1.4B
  44.8 -> 40.3 ms, Huginn-0125 397.6 -> 359.2 ms). Where `MOSAIC_ROWS` says so, a streamed
  product runs on a Mosaic GPU kernel instead of the Triton one (run 18: Ouro-1.4B's qkv +
  RoPE at 1-64 rows, SiLU*up and the norms' partials at 8-64; context-512 steps 1 row 4,804
  -> 4,669 us, 8 rows 5,513 -> 5,305, 32 rows 8,353 -> 8,073, 64 rows 12,119 -> 11,458 with
  wqkv and w_gate_up now streamed there).
- 'persistent' (experimental, measured in bench/RESULTS.md runs 17, 25 and 28): 'auto' with
  Ouro's whole MLP branch (w_gate_up + SiLU*up, w_down's split-K partials, the norms after
  them) in one resident Mosaic GPU kernel (kernels/persistent_mlp.py) where it takes the
  shapes, its programs synchronizing through Ops.mlp_scratch's counters (run 25: still 2.4-3.9%
  slower than 'auto' at 1-32 rows; run 28, its phase-1 programs signalling before their
  phase-2 copies: 0-3% at 1-8 rows, 3-6% at 32-64).
Ops must be hashable and equal across calls (a static jit argument): every op here is a
module-level function or a cached `_where_measured` wrapper.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from loopjax import layers
from loopjax.engine_config import OPTION_CHOICES
from loopjax.kernels import persistent_mlp as pm
from loopjax.kernels import streaming_matmul as sm
from loopjax.kernels import streaming_matmul_norms as smn
from loopjax.kernels import streaming_matmul_rope as smr
from loopjax.kernels import streaming_matmul_rope_mgpu as smrm
from loopjax.kernels import streaming_matmul_swapped as sms
from loopjax.kernels._common import mosaic_gpu_problem
from loopjax.kernels.rms_norm import norm_add_norm
from loopjax.layers import XLA_OPS, Ops

MATMULS = OPTION_CHOICES["matmul"]
# The Ops fields chosen here -> the position of the weight among the arguments after x.
PRODUCTS = {"linear": 0, "linear_accumulate": 0, "norm_linear": -1, "norm_linear_silu_mul": -1,
            "linear_silu_mul": 0, "linear_norm_add_norm": 0, "linear_add_norm_norm": 0,
            "linear_rope_rotate_half_qkv": 0}
# Weight shape [K, N] -> the most rows at which its streaming product (TUNED configs) is used
# from 8 rows up. Huginn-0125 (run 11): wqkv, wo, w_down each beat XLA by >= 5% per product at
# 8 and 32 rows and gain 12-15% in the step; its w_gate_up and lm_head tie per product
# (0.97-1.05x) and stay on XLA. Ouro-1.4B (run 13, with the split-K partials going to the
# norm_add_norm kernel): all four products on the kernel give the fastest step at 8, 16 and
# 32 rows (5,780 / 6,760 / 8,877 us vs 5,873 / 7,088 / 9,116 with only the old 8-row three);
# at 64 and 128 rows wo and w_down alone (12,074 / 18,457 us vs XLA's 12,249 / 19,166; all
# four: 12,148 / 19,311). Run 18: with the Mosaic kernels (MOSAIC_ROWS) all four at 64 rows
# (11,458 us vs 12,119 with wqkv and w_gate_up on XLA).
STREAMING_MAX_ROWS = {(5280, 15840): 32, (5280, 5280): 32, (17920, 5280): 32,
                      (2048, 6144): 64, (2048, 11264): 64, (2048, 2048): 128, (5632, 2048): 128}
# Op -> the rows at which its streamed product runs on a Mosaic GPU kernel instead of the
# Triton one, where that kernel takes the shapes and the GPU is a Hopper
# (`_common.mosaic_gpu_problem`): linear_rope_rotate_half_qkv on
# kernels/streaming_matmul_rope_mgpu.py (one program per head, TMA rings; 1-8 rows or
# multiples of 8), linear_silu_mul on persistent_mlp's phase 1 alone and linear_norm_add_norm
# on the swapped-operand product's split-K partials (streaming_matmul_swapped.swapped_partials)
# into the same norms kernel (both: M = 8, 16, 32, 64). Measured on the H200
# (bench/RESULTS.md run 18): qkv + RoPE 9.3-12.7 us per kernel at 1-64 rows vs the Triton
# kernel's 11.0-14.8; the other two gain only together (steps 8 / 32 / 64 rows -1.7% / -2.0% /
# -5.4% with all three; within 1% at 8-32 rows with one of them).
MOSAIC_OPS = ("linear_rope_rotate_half_qkv", "linear_silu_mul", "linear_norm_add_norm")
MOSAIC_ROWS: dict[str, frozenset[int]] = {"linear_rope_rotate_half_qkv": frozenset({1, 8, 16, 32, 64}),
                                           "linear_silu_mul": frozenset({8, 16, 32, 64}),
                                           "linear_norm_add_norm": frozenset({8, 16, 32, 64})}


# XLA's products where 'auto' does not stream on a GPU: the layers ops with the dot's result in
# the activation dtype (layers.linear_in_dtype: no fp32 GEMM output + convert kernel). Built
# once: Ops must be equal across calls (a static jit argument) and partials compare by identity.
# linear_accumulate keeps its fp32 product (it continues a sum).
GPU_XLA_OPS = Ops(**{name: functools.partial(getattr(layers, name), product=layers.linear_in_dtype)
                     for name in PRODUCTS if name not in ("linear", "linear_accumulate")},
                  linear=layers.linear_in_dtype, linear_accumulate=layers.linear_accumulate)


def matmul_ops(name: str) -> Ops:
    if name not in MATMULS:
        raise ValueError(f"unknown matmul {name!r}; choose 'auto', 'xla', 'streaming' or 'persistent'")
    if name == "xla" or (name in ("auto", "persistent") and jax.default_backend() != "gpu"):
        return XLA_OPS
    streaming = Ops(linear=streaming_linear, linear_accumulate=streaming_linear_accumulate,
                    norm_linear=streaming_norm_linear,
                    norm_linear_silu_mul=streaming_norm_linear_silu_mul,
                    linear_silu_mul=streaming_linear_silu_mul,
                    linear_norm_add_norm=streaming_linear_norm_add_norm,
                    linear_add_norm_norm=streaming_linear_add_norm_norm,
                    linear_rope_rotate_half_qkv=streaming_linear_rope_qkv)
    if name == "streaming":
        return streaming
    # 'auto': the norm stays in XLA before a streamed product (the fused prologue loses), and
    # after Huginn's (the add_norm_norm kernel does not win)
    measured = dataclasses.replace(streaming, norm_linear=_norm_then_streaming,
                                   norm_linear_silu_mul=_norm_then_streaming_silu_mul,
                                   linear_add_norm_norm=_streaming_then_add_norm_norm)
    auto = Ops(**{name: _where_measured(getattr(measured, name), getattr(GPU_XLA_OPS, name), weight_arg)
                  for name, weight_arg in PRODUCTS.items()})
    if name == "auto":
        return auto
    return dataclasses.replace(auto, fused_mlp=_persistent_mlp_or(auto), fused_mlp_scratch=pm.new_counters)


@functools.cache
def _persistent_mlp_or(ops: Ops):
    """Ops.fused_mlp: Ouro's MLP branch on kernels/persistent_mlp.py (both products and the
    norms after them in one resident kernel) where the kernel takes the shapes (decode rows);
    elsewhere `ops`' own two ops."""
    def fused_mlp(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, eps: float, counters):
        if mosaic_gpu_problem() or pm.shape_problem(x, w_gate_up, w_down) is not None:
            return ops.mlp_norm_add_norm(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, eps,
                                         counters)
        return pm.persistent_mlp_norm_add_norm(x, w_gate_up, w_down, residual, norm_weight,
                                               next_norm_weight, eps, counters)
    return fused_mlp


def _norm_then_streaming(x, norm_weight, eps: float, w):
    """layers.norm_linear with the product on the streaming kernel, the norm in XLA."""
    return streaming_linear(layers.rms_norm(x, norm_weight, eps), w)


def _norm_then_streaming_silu_mul(x, norm_weight, eps: float, w_gate_up):
    gate, up = jax.numpy.split(_norm_then_streaming(x, norm_weight, eps, w_gate_up), 2, axis=-1)
    return layers.silu_mul(gate, up)


def _streaming_then_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps: float):
    """layers.linear_add_norm_norm with the product on the streaming kernel, the norms in XLA
    (which fuses the partials' sum into them). The add_norm_norm kernel on the partials measured
    no faster in the Huginn-0125 step (bench/RESULTS.md run 16: 8 rows 32,646 vs 32,654 us, 32
    rows 42,573 vs 42,759) and differed from XLA's fusion in 46 of 4 M elements at 128 rows."""
    return layers.linear_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps,
                                       product=streaming_linear)


@functools.cache
def _where_measured(kernel, fallback, weight_arg: int):
    """Op (x, *args) with the weight at args[weight_arg]: `kernel` where it won on the H200
    for x's rows and the weight's shape (static shapes), else `fallback`. Cached so equal
    choices give one (hashable) function."""

    def pick(x, *args):
        rows, weight_shape = x.shape[0], tuple(args[weight_arg].shape)
        wins = rows < 8 or rows <= STREAMING_MAX_ROWS.get(weight_shape, 0)
        return kernel(x, *args) if wins else fallback(x, *args)
    return pick


# ------------------------------------------------ the streaming kernel as layers.Ops entries
# The kernel at 1..MAX_ROWS rows, XLA above (prefill, where the weights are no longer the
# cost); default block sizes. Each keeps the signature of its layers.py namesake.


def _few_rows(x) -> bool:
    return x.ndim == 2 and x.shape[0] <= sm.MAX_ROWS


def streaming_linear(x, w):  # x [M, K]; w [K, N]
    return sm.streaming_matmul(x, w) if _few_rows(x) else layers.linear(x, w)


def streaming_linear_accumulate(x, w, acc):  # x [M, K]; w [K, N]; acc [M, N] f32
    return sm.streaming_matmul_accumulate(x, w, acc) if _few_rows(x) else layers.linear_accumulate(x, w, acc)


def streaming_norm_linear(x, norm_weight, eps: float, w):  # x [M, K]; norm_weight [K]; w [K, N]
    if not _few_rows(x):
        return layers.norm_linear(x, norm_weight, eps, w)
    return sm.streaming_matmul(x, w, norm_weight=norm_weight, norm_eps=eps)


def streaming_norm_linear_silu_mul(x, norm_weight, eps: float, w_gate_up):  # w_gate_up [K, 2F]
    if not _few_rows(x):
        return layers.norm_linear_silu_mul(x, norm_weight, eps, w_gate_up)
    return sm.streaming_matmul_silu_mul(x, w_gate_up, norm_weight=norm_weight, norm_eps=eps)


def _on_mosaic(op: str, x) -> bool:
    return x.shape[0] in MOSAIC_ROWS.get(op, ()) and mosaic_gpu_problem() is None


def streaming_linear_silu_mul(x, w_gate_up):  # x [M, K]; w_gate_up [K, 2F]
    if not _few_rows(x):
        return layers.linear_silu_mul(x, w_gate_up)
    if _on_mosaic("linear_silu_mul", x) and pm.silu_mul_problem(x, w_gate_up) is None:
        return pm.silu_mul_product(x, w_gate_up)
    return sm.streaming_matmul_silu_mul(x, w_gate_up)


def streaming_linear_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps: float):
    if not _few_rows(x):
        return layers.linear_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps)
    if _on_mosaic("linear_norm_add_norm", x) and sms.partials_problem(x, w) is None:
        return norm_add_norm(sms.swapped_partials(x, w), residual, norm_weight, next_norm_weight, eps)
    return smn.streaming_matmul_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps)


def streaming_linear_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps: float):
    if not _few_rows(x):
        return layers.linear_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps)
    return smn.streaming_matmul_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps)


def streaming_linear_rope_qkv(x, w_qkv, cos, sin, num_heads: int, num_kv_heads: int):
    if not _few_rows(x):  # x [M, K]; w_qkv [K, (Hq + 2*Hkv) * D]; cos, sin [M, D/2] f32
        return layers.linear_rope_rotate_half_qkv(x, w_qkv, cos, sin, num_heads, num_kv_heads)
    heads = dict(num_heads=num_heads, num_kv_heads=num_kv_heads)
    if _on_mosaic("linear_rope_rotate_half_qkv", x) and smrm.shape_problem(x, w_qkv, **heads) is None:
        return smrm.streaming_matmul_rope_qkv_mgpu(x, w_qkv, cos, sin, **heads)
    return smr.streaming_matmul_rope_qkv(x, w_qkv, cos, sin, **heads)
