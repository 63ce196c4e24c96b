"""Paged attention over the depth-plane KV pool (docs/design.md, "Paged attention kernel
contract"), plus the pool writer.

Pool layout (one array per cache layer for K and one for V):
    k_cache, v_cache [planes, Hkv, P, S, D]   P pages of S slots, model dtype.
A token's flat slot is `page * S + offset`; slot `P * S` means "do not write".

    paged_attention(q [N,Hq,D], k_cache, v_cache, plane i32[], page_table [R,M] i32,
                    row_of_token [N] i32, positions [N] i32) -> out [N,Hq,D]

Token n attends the keys of row `row_of_token[n]` at positions 0..positions[n] of plane
`plane` (its own K/V already written by `write_kv`). Key position j of row r lives at slot
`page_table[r, j // S] * S + j % S`. GQA is repeat-interleave: q head h reads kv head
h // (Hq // Hkv). Scores are scaled by D^-0.5, softmax in fp32.

Contract on values (not checkable on traced inputs): 0 <= positions[n] < M * S,
0 <= row_of_token[n] < R, every page_table entry in [0, P) (unused entries: any valid page,
e.g. 0), 0 <= plane < planes. The width M of page_table bounds the work of every kernel
here, so callers should slice it to the bucketed context of the step.

`ref_paged_attention` is the pure-JAX (XLA) twin. It reproduces layers.causal_attention's
casts (scores rounded to the activation dtype, scaled, fp32 softmax, probs rounded back,
fp32-accumulated probs @ v) so the paged engine matches the dense identity path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["check_paged_inputs", "ref_paged_attention", "write_kv", "check_write_inputs"]


def _is_int32(x) -> bool:
    return jnp.asarray(x).dtype == jnp.int32


def check_paged_inputs(q, k_cache, v_cache, plane, page_table, row_of_token, positions):
    """Shape/dtype validation shared by every paged attention implementation. Raises
    ValueError with a one-line message; returns (N, Hq, D, planes, Hkv, P, S, R, M)."""
    if q.ndim != 3:
        raise ValueError(f"q must be [N, Hq, D], got shape {q.shape}")
    if k_cache.ndim != 5:
        raise ValueError(f"k_cache must be [planes, Hkv, pages, page_size, D], got shape {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"unsupported dtype {q.dtype} (float32, bfloat16, float16)")
    n, hq, d = q.shape
    planes, hkv, p, s, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"head_dim of q ({d}) != head_dim of the pool ({dk})")
    if hq % hkv:
        raise ValueError(f"num q heads {hq} is not a multiple of num kv heads {hkv}")
    if jnp.ndim(plane) != 0 or not _is_int32(plane) and not isinstance(plane, int):
        raise ValueError(f"plane must be an int32 scalar, got {jnp.asarray(plane).dtype}{jnp.shape(plane)}")
    if page_table.ndim != 2 or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [R, max_pages], got {page_table.dtype}{page_table.shape}")
    for name, a in (("row_of_token", row_of_token), ("positions", positions)):
        if a.shape != (n,) or a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [{n}] (one per token), got {a.dtype}{a.shape}")
    r, m = page_table.shape
    return n, hq, d, planes, hkv, p, s, r, m


def _softmax_av(scores, mask, v_g, out_spec, dtype):
    """causal_attention's tail: scores [..., keys] f32 (already rounded/scaled), masked
    fp32 softmax, probs rounded to dtype, fp32-accumulated probs @ v."""
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return jnp.einsum(out_spec, probs, v_g, preferred_element_type=jnp.float32).astype(dtype)


def ref_paged_attention(q, k_cache, v_cache, plane, page_table, row_of_token, positions):
    """Pure-JAX paged attention (see module docstring). Gathers only the pages of
    page_table (width M); picks, from static shapes, between a per-token gather of its
    row's pages (decode: N ~ R) and one gather per row with a row mask (prefill: N >> R)."""
    n, hq, d, _, hkv, _, s, r, m = check_paged_inputs(
        q, k_cache, v_cache, plane, page_table, row_of_token, positions
    )
    g = hq // hkv
    plane = jnp.asarray(plane, jnp.int32)
    scale = jnp.asarray(d**-0.5, q.dtype)
    qg = q.reshape(n, hkv, g, d)  # [N, Hkv, G, D]: q head h -> kv head h // G
    key_pos = jnp.arange(m * s, dtype=jnp.int32).reshape(m, s)  # [M, S]
    # Gathered-element counts of the two strategies (K and V, plus the flat score tensor).
    per_token_cost = 2 * n * m * s * hkv * d
    per_row_cost = 2 * r * m * s * hkv * d + n * hq * r * m * s
    if per_token_cost <= per_row_cost:
        pages = page_table[row_of_token]  # [N, M]
        k = k_cache[plane, :, pages]  # [N, M, Hkv, S, D]
        v = v_cache[plane, :, pages]
        sc = jnp.einsum("nkgd,nmksd->nkgms", qg, k, preferred_element_type=jnp.float32)
        sc = (sc.astype(q.dtype) * scale).astype(jnp.float32).reshape(n, hkv, g, m * s)
        mask = (key_pos.reshape(-1)[None, :] <= positions[:, None])[:, None, None, :]  # [N,1,1,MS]
        v = v.transpose(0, 1, 3, 2, 4).reshape(n, m * s, hkv, d)  # [N, MS, Hkv, D]
        out = _softmax_av(sc, mask, v, "nkgj,njkd->nkgd", q.dtype)
    else:
        k = k_cache[plane, :, page_table]  # [R, M, Hkv, S, D]
        v = v_cache[plane, :, page_table]
        sc = jnp.einsum("nkgd,rmksd->nkgrms", qg, k, preferred_element_type=jnp.float32)
        sc = (sc.astype(q.dtype) * scale).astype(jnp.float32).reshape(n, hkv, g, r * m * s)
        same_row = row_of_token[:, None] == jnp.arange(r, dtype=jnp.int32)[None, :]  # [N, R]
        causal = key_pos.reshape(-1)[None, :] <= positions[:, None]  # [N, MS]
        mask = (same_row[:, :, None] & causal[:, None, :]).reshape(n, 1, 1, r * m * s)
        v = v.transpose(0, 1, 3, 2, 4).reshape(r * m * s, hkv, d)  # [RMS, Hkv, D]
        out = _softmax_av(sc, mask, v, "nkgj,jkd->nkgd", q.dtype)
    return out.reshape(n, hq, d)


def check_write_inputs(k_cache, v_cache, plane, slot_mapping, k, v):
    """Validation of write_kv's inputs; raises ValueError with a one-line message."""
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be [planes, Hkv, P, S, D], got {k_cache.shape}, {v_cache.shape}"
        )
    _, hkv, _, _, d = k_cache.shape
    n = slot_mapping.shape[0] if slot_mapping.ndim == 1 else -1
    if slot_mapping.ndim != 1 or slot_mapping.dtype != jnp.int32:
        raise ValueError(f"slot_mapping must be int32 [N], got {slot_mapping.dtype}{slot_mapping.shape}")
    for name, a in (("k", k), ("v", v)):
        if a.shape != (n, hkv, d):
            raise ValueError(f"{name} must be [{n}, {hkv}, {d}] (N, Hkv, D), got {a.shape}")
        if a.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {a.dtype} != pool dtype {k_cache.dtype}")
    if jnp.ndim(plane) != 0:
        raise ValueError(f"plane must be a scalar, got shape {jnp.shape(plane)}")


def write_kv(k_cache, v_cache, plane, slot_mapping, k, v):
    """Scatter k, v [N, Hkv, D] into plane `plane` of the pool at flat slots
    slot_mapping [N] i32 (page * S + offset); slot P * S (padding) is dropped.
    Returns (k_cache, v_cache); donate the pool so XLA updates it in place."""
    check_write_inputs(k_cache, v_cache, plane, slot_mapping, k, v)
    planes, hkv, p, s, d = k_cache.shape
    plane = jnp.asarray(plane, jnp.int32)

    def put(cache, new):
        flat = cache.reshape(planes, hkv, p * s, d)  # merging P, S is a bitcast
        flat = flat.at[plane, :, slot_mapping].set(new, mode="drop")  # update [N, Hkv, D]
        return flat.reshape(cache.shape)

    return put(k_cache, k), put(v_cache, v)
