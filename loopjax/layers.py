"""Pure-JAX building blocks shared by both model families, written to match the PyTorch
reference's order of operations and casts (identity is the law).

Shapes: tokens are packed on the first axis. `x [N, H]` is N tokens (one sequence for the
full forward, several packed sequences for prefill, one token per row for decode).
Heads: `q [N, num_heads, head_dim]`, `k, v [N, num_kv_heads, head_dim]`.
Weights are stored `[in, out]` (transposed from PyTorch's `[out, in]`).

The attention backend is the one seam between a model and a KV cache: the model computes
q, k, v (after RoPE) and calls `attn(kv, layer_id, plane, q, k, v) -> (kv, out)`.
`layer_id` is the static index of the layer's cache array, `plane` the (possibly traced)
depth plane within it. `DenseCausal` is the cache-free backend of the full forward; the
engine's paged backend lives in `loopjax/kv_cache.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

# XLA's default excess precision lets a bf16 result feed an fp32 convert unrounded (e.g. a
# product's output into the next RMSNorm: the H200's decode step summed wo's split-K partials
# in f32 straight into the norm, bench/RESULTS.md run 11), which breaks bf16 identity with the
# reference. Every jitted path of the models compiles with it off (the identity forward and
# the engine's steps), so XLA rounds exactly where op-by-op execution does.
IDENTITY_COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


def rms_norm(x, weight, eps: float):
    """weight * (x.f32 * rsqrt(mean(x.f32^2) + eps)).astype(x.dtype): cast back *before* the
    weight multiply, as both references do (this order matters for bf16 identity)."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rms_norm_add(x, residual, weight, eps: float):
    """residual + rms_norm(x): Ouro's sandwich norm closing a branch (x is the branch output)."""
    return residual + rms_norm(x, weight, eps)


def add_rms_norm(x, residual, weight, eps: float):
    """rms_norm(x + residual): Huginn's sandwich norm of the residual sum."""
    return rms_norm(x + residual, weight, eps)


def linear(x, w):
    """x @ w with fp32 accumulation, rounded once to x's dtype (the reference's bf16 GEMMs
    give the fp32 product of the bf16 operands rounded once)."""
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def linear_accumulate(x, w, acc):
    """(x @ w + acc) rounded once to x's dtype: the product's fp32 accumulation continued from
    acc [.., N] f32, another part of the same sum (Huginn's adapter: concat[s, e] @ [A_s; A_e]
    = s @ A_s + e @ A_e, e's part taken once per token). The reference's single GEMM differs
    only in its fp32 summation order, which no GEMM fixes anyway."""
    return (jnp.dot(x, w, preferred_element_type=jnp.float32) + acc).astype(x.dtype)


def linear_in_dtype(x, w):
    """`linear` as XLA:GPU runs it best: the dot's result type is x's dtype. XLA:GPU accumulates
    a bf16/f16 dot in fp32 and rounds once in the GEMM's epilogue (linear's numbers, possibly
    in another summation order), where linear's fp32 result makes it run cuBLAS GEMMs with an
    fp32 output and then a convert kernel (bench/RESULTS.md run 14: ~19 ms of a 394 ms
    Huginn-0125 prefill step). The composite ops below take it as `product`. Not for CPU paths:
    XLA does not pin a bf16 dot's accumulation type there."""
    return jnp.dot(x, w, preferred_element_type=x.dtype)


def norm_linear(x, norm_weight, eps: float, w, product=linear):
    """linear(rms_norm(x, norm_weight, eps), w): a norm feeding a product directly, one op so
    that a kernel can fuse the norm into the product's prologue (layers.Ops)."""
    return product(rms_norm(x, norm_weight, eps), w)


def norm_linear_silu_mul(x, norm_weight, eps: float, w_gate_up, product=linear):
    """The MLP's activation silu_mul(gate, up) of norm_linear(x, ..., w_gate_up) [N, 2F],
    columns [gate | up] -> [N, F]."""
    return linear_silu_mul(rms_norm(x, norm_weight, eps), w_gate_up, product)


def linear_silu_mul(x, w_gate_up, product=linear):
    """silu_mul(gate, up) of linear(x, w_gate_up) [N, 2F], columns [gate | up] -> [N, F]."""
    gate, up = jnp.split(product(x, w_gate_up), 2, axis=-1)
    return silu_mul(gate, up)


def linear_norm_add_norm(x, w, residual, norm_weight, next_norm_weight, eps: float, product=linear):
    """Ouro's sandwich norm closing a branch, then the next branch's input norm, as one op:
    (h, rms_norm(h, next_norm_weight)) for h = residual + rms_norm(linear(x, w), norm_weight).
    One op so that a kernel can take the product's split-K partials and run the sum, both
    norms and the add in one pass (kernels/rms_norm.py `norm_add_norm`)."""
    h = rms_norm_add(product(x, w), residual, norm_weight, eps)
    return h, rms_norm(h, next_norm_weight, eps)


def mlp_norm_add_norm(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, eps: float,
                      silu_mul_op=linear_silu_mul, norm_add_norm_op=linear_norm_add_norm):
    """Ouro's MLP branch from its normed input to the next branch's: norm_add_norm_op(
    silu_mul_op(x, w_gate_up), w_down, residual, ...) -> (h, next_norm(h)) (Ops.mlp_norm_add_norm
    passes its own two ops; a kernel may run the whole branch instead, Ops.fused_mlp)."""
    act = silu_mul_op(x, w_gate_up)
    return norm_add_norm_op(act, w_down, residual, norm_weight, next_norm_weight, eps)


def linear_add_norm_norm(x, w, residual, norm_weight, next_norm_weight, eps: float, product=linear):
    """Huginn's sandwich norm closing a branch, then the next branch's input norm, as one op:
    (h, rms_norm(h, next_norm_weight)) for h = add_rms_norm(linear(x, w), residual, norm_weight)
    (kernels/rms_norm.py `add_norm_norm` takes the product's split-K partials)."""
    h = add_rms_norm(product(x, w), residual, norm_weight, eps)
    return h, rms_norm(h, next_norm_weight, eps)


def silu_mul(gate, up):
    """SiLU(gate) * up. torch computes a bf16 silu in fp32 and rounds once (jax.nn.silu on bf16
    would round after each of its exp/add/divide), then multiplies by up in the activation dtype."""
    act = jax.nn.silu(gate.astype(jnp.float32)).astype(gate.dtype)
    return act * up


def rope_angles(positions, head_dim: int, theta: float):
    """cos, sin [N, head_dim // 2] in fp32: positions * theta^(-2i/head_dim)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(freqs), jnp.sin(freqs)


def rope_rotate_half(x, cos, sin):
    """NeoX/Ouro RoPE. x [N, heads, D]; cos, sin [N, D/2] fp32. The reference builds
    emb = concat(f, f), casts cos/sin to x's dtype, then x*cos + rotate_half(x)*sin with
    rotate_half(x) = concat(-x2, x1)."""
    cos = jnp.concatenate([cos, cos], axis=-1).astype(x.dtype)[:, None, :]
    sin = jnp.concatenate([sin, sin], axis=-1).astype(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def rope_interleaved(x, cos, sin):
    """Huginn RoPE on interleaved pairs (x[2i], x[2i+1]), computed in fp32 and cast back:
    (x0*cos - x1*sin, x1*cos + x0*sin). x [N, heads, D]; cos, sin [N, D/2] fp32."""
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.stack([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def split_qkv(qkv, num_heads: int, num_kv_heads: int):
    """q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D] of a fused projection qkv [N, (Hq + 2*Hkv)
    * D], columns [q | k | v], head-major inside each."""
    n = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q = qkv[:, : num_heads * d].reshape(n, num_heads, d)
    k = qkv[:, num_heads * d : (num_heads + num_kv_heads) * d].reshape(n, num_kv_heads, d)
    v = qkv[:, (num_heads + num_kv_heads) * d :].reshape(n, num_kv_heads, d)
    return q, k, v


def split_qk(qkv, num_heads: int, num_kv_heads: int):
    """q, k of split_qkv (the heads RoPE rotates)."""
    return split_qkv(qkv, num_heads, num_kv_heads)[:2]


def rope_rotate_half_qk(qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """Ouro's RoPE of the q and k heads of a fused projection (split_qk): (q, k)."""
    q, k = split_qk(qkv, num_heads, num_kv_heads)
    return rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)


def rope_rotate_half_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """Ouro's attention inputs of a fused projection: rope_rotate_half_qk's (q, k), and v
    (split_qkv, not rotated)."""
    q, k = rope_rotate_half_qk(qkv, cos, sin, num_heads, num_kv_heads)
    return q, k, split_qkv(qkv, num_heads, num_kv_heads)[2]


def linear_rope_rotate_half_qkv(x, w_qkv, cos, sin, num_heads: int, num_kv_heads: int, product=linear):
    """rope_rotate_half_qkv(linear(x, w_qkv)) -> (q, k, v): one op so that a kernel can run
    the RoPE in the product's epilogue and write q, k, v. x [N, H]; w_qkv [H, (Hq + 2*Hkv)
    * D]; cos, sin [N, D/2] fp32."""
    return rope_rotate_half_qkv(product(x, w_qkv), cos, sin, num_heads, num_kv_heads)


def rope_interleaved_qk(qkv, qk_bias, cos, sin):
    """Huginn's q and k of a fused projection [N, 3 * H * D]: qk_bias [2, H, D] (cast to
    qkv's dtype) added before the interleaved RoPE, as the reference does: (q, k)."""
    h = qk_bias.shape[1]
    q, k = split_qk(qkv, h, h)
    bias = qk_bias.astype(qkv.dtype)
    return rope_interleaved(q + bias[0], cos, sin), rope_interleaved(k + bias[1], cos, sin)


def repeat_kv(k, num_heads: int):
    """GQA: kv head j serves query heads j*g .. j*g+g-1 (repeat-interleave, not tiling)."""
    group = num_heads // k.shape[-2]
    return k if group == 1 else jnp.repeat(k, group, axis=-2)


def causal_attention(q, k, v, mask):
    """Eager attention as the references compute it: scores in the activation dtype,
    scaled by head_dim^-0.5, masked, softmax in fp32, cast back, then @ v.
    q [N, Hq, D]; k, v [S, Hkv, D]; mask [N, S] bool (True = may attend)."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("nhd,shd->hns", q, k, preferred_element_type=jnp.float32)
    scores = scores.astype(q.dtype) * jnp.asarray(scale, q.dtype)
    scores = jnp.where(mask[None], scores.astype(jnp.float32), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("hns,shd->nhd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


class AttentionBackend(Protocol):
    def __call__(self, kv: Any, layer_id: int, plane, q, k, v) -> tuple[Any, jax.Array]:
        """Store k, v for (layer_id, plane) if the backend caches, attend, return (kv, out).
        q [N, Hq, D], k/v [N, Hkv, D] after RoPE; out [N, Hq, D]. A backend may also define
        `attend_projected(kv, layer_id, plane, ops, x, w_qkv, rope)`, the same from the layer's
        normed input (rotary_attention calls it where it exists)."""
        ...


@dataclass(frozen=True)
class QKVRope:
    """A layer's RoPE of q and k, for a fused projection qkv [N, (Hq + 2*Hkv) * D] (columns [q |
    k | v], head-major): Ouro's rotate-half (qk_bias None) or Huginn's interleaved pairs of q, k
    + qk_bias [2, Hq, D]. cos, sin [N, D/2] fp32 (rope_angles)."""

    cos: Any
    sin: Any
    num_heads: int
    num_kv_heads: int
    qk_bias: Any = None

    def project(self, ops: Ops, x, w_qkv):
        """(q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) of x @ w_qkv on `ops`."""
        if self.qk_bias is None:
            return ops.linear_rope_rotate_half_qkv(x, w_qkv, self.cos, self.sin, self.num_heads,
                                                   self.num_kv_heads)
        qkv = ops.linear(x, w_qkv)
        q, k = ops.rope_interleaved_qk(qkv, self.qk_bias, self.cos, self.sin)
        return q, k, split_qkv(qkv, self.num_heads, self.num_kv_heads)[2]


def rotary_attention(attn: AttentionBackend, ops: Ops, kv, layer_id: int, depth, x, w_qkv, rope: QKVRope):
    """A layer's attention from its normed input x [N, H]: project, rotate q and k, attend;
    (kv, out [N, Hq, D]). A backend with `attend_projected` (the paged pool's) takes the
    projection itself: its prefill on the Pallas kernels rotates q and k in its K/V write."""
    attend_projected = getattr(attn, "attend_projected", None)
    if attend_projected is not None:
        return attend_projected(kv, layer_id, depth, ops, x, w_qkv, rope)
    return attn(kv, layer_id, depth, *rope.project(ops, x, w_qkv))


class DenseCausal:
    """Cache-free backend for one sequence of N tokens at positions 0..N-1: each token sees
    the current plane's keys of itself and earlier tokens. `kv` passes through untouched."""

    def __call__(self, kv, layer_id, plane, q, k, v):
        n = q.shape[0]
        mask = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
        return kv, causal_attention(q, k, v, mask)


@dataclass(frozen=True)
class Ops:
    """The ops of a layer that a device kernel may run instead of XLA, so a step can swap one
    in without a second model definition: the dense products (the weight-streaming matmul of
    `loopjax.kernels.streaming_matmul`, loopjax/matmul_ops.py) and the pointwise chains (the
    bitwise-equal Pallas kernels, loopjax/pointwise_ops.py). Each field keeps the signature of
    its XLA default here; frozen and made of functions, so it is hashable and can be a static
    jit argument. The norm_* ops are the products fed directly by an RMSNorm (a kernel may
    fuse the norm into its prologue, and the SiLU*up into its epilogue); linear_norm_add_norm
    and linear_add_norm_norm are a product with the norms after it (a kernel may take its
    split-K partials); linear_rope_rotate_half_qkv a product with Ouro's RoPE after it (a
    kernel may run the RoPE in its epilogue and write q, k, v). Ouro's whole MLP branch is the
    method mlp_norm_add_norm: this Ops' linear_silu_mul then linear_norm_add_norm, or
    `fused_mlp` where set (one kernel for both products, kernels/persistent_mlp.py), so that
    replacing either op needs no other change; it takes `mlp_scratch()` (the fused kernel's
    synchronization counters, a Ref updated in place; None otherwise), one for many calls."""

    linear: Callable = linear
    linear_accumulate: Callable = linear_accumulate
    norm_linear: Callable = norm_linear
    norm_linear_silu_mul: Callable = norm_linear_silu_mul
    linear_silu_mul: Callable = linear_silu_mul
    linear_norm_add_norm: Callable = linear_norm_add_norm
    linear_add_norm_norm: Callable = linear_add_norm_norm
    fused_mlp: Callable | None = None  # mlp_norm_add_norm's signature
    fused_mlp_scratch: Callable | None = None  # () -> a scratch Ref fused_mlp's calls share
    linear_rope_rotate_half_qkv: Callable = linear_rope_rotate_half_qkv
    rms_norm: Callable = rms_norm
    rms_norm_add: Callable = rms_norm_add
    add_rms_norm: Callable = add_rms_norm
    rope_interleaved_qk: Callable = rope_interleaved_qk

    def mlp_scratch(self):
        """The scratch a run of layers hands to each mlp_norm_add_norm (None: nothing)."""
        return self.fused_mlp_scratch() if self.fused_mlp_scratch is not None else None

    def mlp_norm_add_norm(self, x, w_gate_up, w_down, residual, norm_weight, next_norm_weight,
                          eps: float, scratch=None):
        """Ouro's MLP branch (layers.mlp_norm_add_norm) on this Ops; scratch: mlp_scratch()'s."""
        if self.fused_mlp is not None:
            return self.fused_mlp(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, eps,
                                  scratch)
        return mlp_norm_add_norm(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, eps,
                                 silu_mul_op=self.linear_silu_mul,
                                 norm_add_norm_op=self.linear_norm_add_norm)


XLA_OPS = Ops()
