"""The step's K/V into the paged pool: a Pallas (Triton) kernel, twin of paged_attention.write_kv.

    write_kv_kernel(k_cache, v_cache, plane, slot_mapping, k, v) -> (k_cache, v_cache)
        k_cache, v_cache [planes, Hkv, P, S, D]; plane an i32 scalar; slot_mapping [N] i32
        (page * S + offset, P * S = the drop slot: not written); k, v [N, Hkv, D].
        = paged_attention.write_kv (XLA's scatter), bitwise: both only copy.

Why a kernel: XLA's scatter of a prefill step's K/V ran at ~0.5 TB/s on the H200 (run 14: a
4 x 512-token Ouro-1.4B prefill step spent 2 x 35 us per layer application in it, 7 ms of
49; Huginn-0125 2 x 87 us). Here one program stores `block_tokens` tokens of one kv head: a
[block_tokens, D] tile loaded at once and stored through one pointer per row (the rows'
slots), so each row is one contiguous D-element store, and the pools are aliased in and out
(XLA updates them in place, nothing else of the pool is touched). D need not be a power of
two (Huginn's 96): the tile is masked past D.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import next_pow2, one_lowering_per_config, resolve_interpret
from .paged_attention import check_write_inputs, write_kv

__all__ = ["block_slots", "ref_write_kv", "store_at_slots", "write_kv_kernel"]

BLOCK_TOKENS = 32  # tokens per program: [32, 128] bf16 = 8 KB per load and store


def ref_write_kv(k_cache, v_cache, plane, slot_mapping, k, v):
    return write_kv(k_cache, v_cache, plane, slot_mapping, k, v)


def block_slots(slots_ref, t0, block_tokens: int, num_tokens: int, drop_slot: int):
    """(slots [BT], keep [BT] bool) of tokens t0..t0+BT: a token past N reads the drop slot,
    and only real tokens with a real slot are kept."""
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (block_tokens,), 0)
    real = rows < num_tokens
    slots = plgpu.load(slots_ref.at[pl.ds(t0, block_tokens)], mask=real, other=drop_slot)
    return slots, real & (slots < drop_slot)


def store_at_slots(out_ref, plane, head, slots, keep, value, c0: int, valid_cols: int):
    """out_ref [planes, Hkv, P * S, D]: out[plane, head, slots[i], c0 + c] = value[i, c] for
    the kept rows i and c < valid_cols; value [BT, W] (W a power of two on the GPU)."""
    cols = jax.lax.broadcasted_iota(jnp.int32, value.shape, 1)
    # Every index a [BT, W] array: one pointer per element on the GPU, a plain scatter in
    # interpret mode. Dropped rows keep their out-of-bounds slot: masked on the GPU, dropped by
    # the interpreter's scatter (a stand-in in-bounds slot could collide with a real row's there).
    index = (jnp.full(cols.shape, plane), jnp.full(cols.shape, head),
             jnp.broadcast_to(slots[:, None], cols.shape), cols + c0)
    plgpu.store(out_ref.at[index], value, mask=keep[:, None] & (cols < valid_cols))


def _kernel(plane_ref, slots_ref, k_ref, v_ref, k_in_ref, v_in_ref, k_out_ref, v_out_ref, *,
            block_tokens: int, drop_slot: int, interpret: bool):
    # plane [1]; slots [N]; k, v [N, Hkv, D]; caches [planes, Hkv, P * S, D] (aliased in -> out)
    del k_in_ref, v_in_ref  # the same buffers as the outputs
    n, _, d = k_ref.shape
    width = d if interpret else next_pow2(d)  # NOTE: Triton tiles are powers of two
    t0, h = pl.program_id(0) * block_tokens, pl.program_id(1)
    slots, keep = block_slots(slots_ref, t0, block_tokens, n, drop_slot)
    rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (block_tokens, width), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (block_tokens, width), 1)
    load_mask = (rows < n) & (cols < d)
    for new_ref, out_ref in ((k_ref, k_out_ref), (v_ref, v_out_ref)):
        tile = plgpu.load(new_ref.at[pl.ds(t0, block_tokens), h, pl.ds(0, width)], mask=load_mask, other=0)
        store_at_slots(out_ref, plane_ref[0], h, slots, keep, tile, 0, d)


def write_kv_kernel(k_cache, v_cache, plane, slot_mapping, k, v, *, interpret: bool | None = None):
    """paged_attention.write_kv in one Pallas kernel (module docstring); donate the pool."""
    check_write_inputs(k_cache, v_cache, plane, slot_mapping, k, v)
    return _write_call(k_cache, v_cache, jnp.asarray(plane, jnp.int32).reshape(1),
                       slot_mapping.astype(jnp.int32), k, v, interpret=resolve_interpret(interpret))


@one_lowering_per_config("interpret")
def _write_call(k_cache, v_cache, plane, slot_mapping, k, v, *, interpret: bool):
    planes, hkv, p, s, d = k_cache.shape
    n = k.shape[0]
    flat = jax.ShapeDtypeStruct((planes, hkv, p * s, d), k_cache.dtype)
    kernel = functools.partial(_kernel, block_tokens=BLOCK_TOKENS, drop_slot=p * s, interpret=interpret)
    k_out, v_out = pl.pallas_call(
        kernel,
        out_shape=(flat, flat),
        grid=(pl.cdiv(n, BLOCK_TOKENS), hkv),
        input_output_aliases={4: 0, 5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="loopjax_write_kv",
    )(plane, slot_mapping, k.astype(k_cache.dtype), v.astype(v_cache.dtype),
      k_cache.reshape(flat.shape), v_cache.reshape(flat.shape))
    return k_out.reshape(k_cache.shape), v_out.reshape(v_cache.shape)
