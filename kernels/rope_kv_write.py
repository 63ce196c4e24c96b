"""RoPE of q and k and the K/V write into the paged pool, from the fused projection, in one
Pallas (Triton) kernel: a prefill step's attention inputs.

    rope_write_kv(qkv, cos, sin, k_cache, v_cache, plane, slot_mapping, *, num_heads=,
                  num_kv_heads=, qk_bias=None) -> (q [N, Hq, D], k_cache, v_cache)
        qkv [N, (Hq + 2*Hkv) * D], columns [q | k | v], head-major inside each; cos, sin
        [N, D/2] f32; pool and slots as in kv_write. qk_bias None: Ouro's rotate-half RoPE;
        qk_bias [2, Hq, D]: Huginn's interleaved pairs of (x + bias), Hkv = Hq.
        = ref_rope_write_kv: the model's RoPE (layers.rope_rotate_half_qkv or
        rope_interleaved_qk, v a slice), then paged_attention.write_kv of k and v. Bitwise:
        the RoPE is kernels/rope.py's spelling, the rest is copying.

Why: ahead of the write kernel, XLA ran a 4 x 512-token Ouro-1.4B prefill step's q RoPE, k
RoPE and v's slice (the write kernel's operand) as three fusions, 5.9 + 5.0 + 6.1 us per layer
application beside the write's 7.2 (bench/RESULTS.md run 16): each read its part of qkv and
wrote it back once more. Here one program per (block of `block_tokens` tokens, head of q, k or
v) reads its [BT, D] tile of qkv once: a q head is rotated and stored to q, a k head rotated
and stored at its tokens' slots, a v head stored there as it is. The pools are aliased in and
out (XLA updates them in place). Run 21: 24.5 -> 13.1 us per layer application (Ouro-1.4B,
4 x 512), 92.8 -> 46.9 (Huginn-0125). Decode steps keep their own RoPE (there the Mosaic
kernel writes K/V inside the attention; Huginn's decode with this kernel was 0.4% slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from loopjax import layers

from ._common import load_tile, next_pow2, one_lowering_per_config, resolve_interpret, store_tile
from .kv_write import block_slots, store_at_slots
from .paged_attention import check_write_inputs, write_kv
from .rope import _interleaved, _rotate_half, check_rope_inputs

__all__ = ["ref_rope_write_kv", "rope_write_kv"]

BLOCK_TOKENS = 32  # as kv_write: [32, 128] bf16 = 8 KB per load and store


def _check(qkv, cos, sin, k_cache, v_cache, plane, slot_mapping, num_heads, num_kv_heads, qk_bias):
    """One-line ValueErrors for bad inputs (rope's and write_kv's checks); returns (N, D)."""
    n, d = check_rope_inputs(qkv, cos, sin, num_heads, num_kv_heads, qk_bias)
    if qk_bias is not None and num_kv_heads != num_heads:
        raise ValueError(f"the interleaved RoPE (qk_bias) needs num_kv_heads == num_heads, got "
                         f"{num_kv_heads} and {num_heads}")
    new = jax.ShapeDtypeStruct((n, num_kv_heads, d), k_cache.dtype)
    check_write_inputs(k_cache, v_cache, plane, slot_mapping, new, new)
    return n, d


def ref_rope_write_kv(qkv, cos, sin, k_cache, v_cache, plane, slot_mapping, *, num_heads: int,
                      num_kv_heads: int, qk_bias=None):
    _check(qkv, cos, sin, k_cache, v_cache, plane, slot_mapping, num_heads, num_kv_heads, qk_bias)
    if qk_bias is None:
        q, k, v = layers.rope_rotate_half_qkv(qkv, cos, sin, num_heads, num_kv_heads)
    else:
        q, k = layers.rope_interleaved_qk(qkv, qk_bias, cos, sin)
        v = layers.split_qkv(qkv, num_heads, num_kv_heads)[2]
    dt = k_cache.dtype
    return q, *write_kv(k_cache, v_cache, plane, slot_mapping, k.astype(dt), v.astype(dt))


def _kernel(*refs, num_heads: int, num_kv_heads: int, d: int, block_tokens: int, interleaved: bool,
            drop_slot: int, interpret: bool):
    # refs: plane [1], slots [N], qkv [N, (Hq + 2Hkv) * D], (qk_bias [2Hq, D]), cos, sin
    #       [N, D/2] f32, k_in, v_in (aliased to k_out, v_out), q_out [N, Hq * D],
    #       k_out, v_out [planes, Hkv, P * S, D]
    if interleaved:
        plane_ref, slots_ref, x_ref, bias_ref, cos_ref, sin_ref, _, _, q_ref, k_ref, v_ref = refs
    else:
        plane_ref, slots_ref, x_ref, cos_ref, sin_ref, _, _, q_ref, k_ref, v_ref = refs
        bias_ref = None
    n, dt = x_ref.shape[0], x_ref.dtype
    t0, j = pl.program_id(0) * block_tokens, pl.program_id(1)
    col, width = j * d, d if interpret else next_pow2(d)  # NOTE: Triton tiles are powers of two

    def rotated():
        """[(column offset, f32 values rounded to qkv's dtype [BT, W], valid columns)] of head j."""
        if interleaved:
            pairs = _interleaved(x_ref, bias_ref, cos_ref, sin_ref, t0, j, col, block_tokens, d, width,
                                 round_each_op=True)
            return [(0, pairs.astype(dt).astype(jnp.float32), d)]
        half = d // 2
        out1, out2 = _rotate_half(x_ref, cos_ref, sin_ref, t0, col, block_tokens, half,
                                  half if interpret else next_pow2(half))
        return [(0, out1, half), (half, out2, half)]

    @pl.when(j < num_heads)
    def _():
        for off, val, valid in rotated():
            store_tile(q_ref, t0, col + off, val.astype(q_ref.dtype), n, valid)

    def store_kv(out_ref, head, parts):
        slots, keep = block_slots(slots_ref, t0, block_tokens, n, drop_slot)
        for off, val, valid in parts:
            store_at_slots(out_ref, plane_ref[0], head, slots, keep, val.astype(dt).astype(out_ref.dtype),
                           off, valid)

    @pl.when((j >= num_heads) & (j < num_heads + num_kv_heads))
    def _():
        store_kv(k_ref, j - num_heads, rotated())

    @pl.when(j >= num_heads + num_kv_heads)
    def _():
        tile = load_tile(x_ref, t0, block_tokens, col, width, n, d)
        store_kv(v_ref, j - num_heads - num_kv_heads, [(0, tile, d)])


def rope_write_kv(
    qkv,  # [N, (Hq + 2*Hkv) * D]
    cos,  # [N, D/2] f32
    sin,  # [N, D/2] f32
    k_cache,  # [planes, Hkv, P, S, D]
    v_cache,  # [planes, Hkv, P, S, D]
    plane,  # i32 scalar
    slot_mapping,  # [N] i32 (P * S: not written)
    *,
    num_heads: int,
    num_kv_heads: int,
    qk_bias=None,  # [2, Hq, D] (Huginn) or None (Ouro)
    block_tokens: int = BLOCK_TOKENS,
    interpret: bool | None = None,
):
    """ref_rope_write_kv in one Pallas kernel (module docstring); donate the pool."""
    _check(qkv, cos, sin, k_cache, v_cache, plane, slot_mapping, num_heads, num_kv_heads, qk_bias)
    if qk_bias is not None and qk_bias.dtype != qkv.dtype:
        qk_bias = qk_bias.astype(qkv.dtype)  # NOTE: as the model does before the add
    return _call(qkv, cos, sin, k_cache, v_cache, jnp.asarray(plane, jnp.int32).reshape(1), slot_mapping,
                 qk_bias, num_heads=num_heads, num_kv_heads=num_kv_heads, block_tokens=block_tokens,
                 interpret=resolve_interpret(interpret))


@one_lowering_per_config("num_heads", "num_kv_heads", "block_tokens", "interpret")
def _call(qkv, cos, sin, k_cache, v_cache, plane, slot_mapping, qk_bias, *, num_heads: int,
          num_kv_heads: int, block_tokens: int, interpret: bool):
    planes, hkv, p, s, d = k_cache.shape
    n = qkv.shape[0]
    flat = jax.ShapeDtypeStruct((planes, hkv, p * s, d), k_cache.dtype)
    kernel = functools.partial(_kernel, num_heads=num_heads, num_kv_heads=num_kv_heads, d=d,
                               block_tokens=block_tokens, interleaved=qk_bias is not None,
                               drop_slot=p * s, interpret=interpret)
    bias = () if qk_bias is None else (qk_bias.reshape(2 * num_heads, d),)
    pools = (k_cache.reshape(flat.shape), v_cache.reshape(flat.shape))
    first_pool = 5 + len(bias)  # plane, slots, qkv, (bias), cos, sin, then the pools
    q, k_out, v_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, num_heads * d), qkv.dtype), flat, flat),
        grid=(pl.cdiv(n, block_tokens), num_heads + 2 * num_kv_heads),
        input_output_aliases={first_pool: 1, first_pool + 1: 2},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="loopjax_rope_write_kv",
    )(plane, slot_mapping.astype(jnp.int32), qkv, *bias, cos, sin, *pools)
    return q.reshape(n, num_heads, d), k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
