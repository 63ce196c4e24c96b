"""Pallas kernels, each beside its pure-JAX `ref_` twin (same signature, same validation).
Installed as `loopjax.kernels`; see docs/design.md for the KV pool and attention contracts.

GPU backend: Triton-lowered `pl.pallas_call` (jax 0.11.2); `interpret=True` runs a kernel
on CPU. Attention kernels match their twin to fp32-accumulation tolerance; the pointwise
kernels (rms_norm, norm_add_norm, add_norm_norm, rope, silu_mul) and the K/V writes
(kv_write, rope_kv_write) spell the twin's ops and casts to be
bitwise equal.
"""

from .paged_attention import paged_attention, ref_paged_attention, write_kv
from .prefill_attention import prefill_attention, ref_prefill_attention
from .rms_norm import (
    add_norm_norm,
    add_rms_norm,
    norm_add_norm,
    ref_add_norm_norm,
    ref_add_rms_norm,
    ref_norm_add_norm,
    ref_rms_norm,
    ref_rms_norm_add,
    rms_norm,
    rms_norm_add,
)
from .rope import ref_rope_interleaved_qk, ref_rope_rotate_half_qk, rope_interleaved_qk, rope_rotate_half_qk
from .rope_kv_write import ref_rope_write_kv, rope_write_kv
from .silu_mul import ref_silu_f32_mul, ref_silu_mul, silu_f32_mul, silu_mul

__all__ = [
    "add_norm_norm",
    "add_rms_norm",
    "norm_add_norm",
    "paged_attention",
    "prefill_attention",
    "ref_add_norm_norm",
    "ref_add_rms_norm",
    "ref_norm_add_norm",
    "ref_paged_attention",
    "ref_prefill_attention",
    "ref_rms_norm",
    "ref_rms_norm_add",
    "ref_rope_interleaved_qk",
    "ref_rope_rotate_half_qk",
    "ref_rope_write_kv",
    "ref_silu_f32_mul",
    "ref_silu_mul",
    "rms_norm",
    "rms_norm_add",
    "rope_interleaved_qk",
    "rope_rotate_half_qk",
    "rope_write_kv",
    "silu_f32_mul",
    "silu_mul",
    "write_kv",
]
