"""Which implementation a step's pointwise chains use (`EngineConfig.pointwise`): RMSNorm,
the residual norms, RoPE of q and k, SiLU*up.

- 'xla' (default): the jitted XLA ops of loopjax/layers.py, fused by XLA into its own kernels.
- 'pallas': the Pallas kernels of loopjax/kernels (rms_norm, rope, silu_mul; interpret mode on
  a CPU), each bitwise equal to its XLA twin on the same inputs (bench/RESULTS.md runs 5, 11
  and 20 on the H200; tests/test_pointwise_ops.py; in f32 on a CPU, XLA computes Ouro's RoPE
  inside its fusion 1 ulp apart from the same ops alone). A step with them is bit-for-bit the
  XLA step only where XLA picks the same GEMMs for its products in both executables (run 20:
  one Ouro-1.4B loop at 8 rows differs with XLA's autotuned Triton GEMMs, not with cuBLAS's).
  The products are the matmul choice's plain products with the norm before them and the
  SiLU*up or the RoPE after them on the kernels (a streaming matmul's fused prologue/epilogue
  is not used).
  Not the default: no kernel beats XLA's own fusion standalone on the H200 (run 5), and each
  is one more kernel per op where XLA fuses several.
Ops must stay hashable and equal across calls (a static jit argument): every op here is a
module-level function or a cached composition.
"""

from __future__ import annotations

import dataclasses
import functools

from loopjax import layers
from loopjax.engine_config import OPTION_CHOICES
from loopjax.layers import Ops

POINTWISE = OPTION_CHOICES["pointwise"]


def with_pointwise(ops: Ops, name: str) -> Ops:
    """`ops` with its pointwise chains on the implementation `name`."""
    if name not in POINTWISE:
        raise ValueError(f"unknown pointwise {name!r}; choose 'xla' or 'pallas'")
    if name == "xla":
        return ops
    from loopjax import kernels

    return dataclasses.replace(
        ops,
        rms_norm=kernels.rms_norm,
        rms_norm_add=kernels.rms_norm_add,
        add_rms_norm=kernels.add_rms_norm,
        rope_interleaved_qk=kernels.rope_interleaved_qk,
        norm_linear=_kernel_norm_then(ops.linear),
        norm_linear_silu_mul=_kernel_norm_then_silu_mul(ops.linear),
        linear_silu_mul=_then_kernel_silu_mul(ops.linear),
        linear_norm_add_norm=_then_kernel_norms(ops.linear, kernels.norm_add_norm),
        linear_add_norm_norm=_then_kernel_norms(ops.linear, kernels.add_norm_norm),
        linear_rope_rotate_half_qkv=_then_kernel_rope(ops.linear),
        fused_mlp=None, fused_mlp_scratch=None,  # the MLP branch: the two ops above
    )


@functools.cache
def _then_kernel_rope(linear):
    """linear_rope_rotate_half_qkv: `linear` into qkv [N, (Hq + 2*Hkv) * D], then the
    rotate-half RoPE kernel for q and k; v is qkv's slice (layers.split_qkv)."""
    from loopjax import kernels

    def linear_rope_rotate_half_qkv(x, w_qkv, cos, sin, num_heads: int, num_kv_heads: int):
        qkv = linear(x, w_qkv)
        q, k = kernels.rope_rotate_half_qk(qkv, cos, sin, num_heads=num_heads, num_kv_heads=num_kv_heads)
        return q, k, layers.split_qkv(qkv, num_heads, num_kv_heads)[2]
    return linear_rope_rotate_half_qkv


@functools.cache
def _kernel_norm_then(linear):
    """norm_linear: the RMSNorm kernel, then `linear`."""
    from loopjax import kernels

    def norm_linear(x, norm_weight, eps: float, w):
        return linear(kernels.rms_norm(x, norm_weight, eps), w)
    return norm_linear


@functools.cache
def _kernel_norm_then_silu_mul(linear):
    """norm_linear_silu_mul: the RMSNorm kernel, `linear` into [N, 2F] ([gate | up]), the
    SiLU*up kernel."""
    from loopjax import kernels

    def norm_linear_silu_mul(x, norm_weight, eps: float, w_gate_up):
        return _then_kernel_silu_mul(linear)(kernels.rms_norm(x, norm_weight, eps), w_gate_up)
    return norm_linear_silu_mul


@functools.cache
def _then_kernel_silu_mul(linear):
    """linear_silu_mul: `linear` into [N, 2F] ([gate | up]), then the SiLU*up kernel."""
    from loopjax import kernels

    def linear_silu_mul(x, w_gate_up):
        return kernels.silu_mul(linear(x, w_gate_up))
    return linear_silu_mul


@functools.cache
def _then_kernel_norms(linear, norms):
    """linear_norm_add_norm / linear_add_norm_norm: `linear`, then the fused norms kernel
    `norms` (kernels.norm_add_norm or add_norm_norm: both norms and the add)."""

    def linear_then_norms(x, w, residual, norm_weight, next_norm_weight, eps: float):
        return norms(linear(x, w), residual, norm_weight, next_norm_weight, eps)
    return linear_then_norms
