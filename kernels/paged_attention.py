"""Paged attention over the depth-plane KV pool (docs/design.md, "Paged attention kernel
contract"), plus the pool writer.

Pool layout (one array per cache layer for K and one for V):
    k_cache, v_cache [planes, Hkv, P, S, D]   P pages of S slots, model dtype.
A token's flat slot is `page * S + offset`; slot `P * S` means "do not write".

    paged_attention(q [N,Hq,D], k_cache, v_cache, plane i32[], page_table [R,M] i32,
                    row_of_token [N] i32, positions [N] i32) -> out [N,Hq,D]

Token n attends the keys of row `row_of_token[n]` at positions 0..positions[n] of plane
`plane` (its own K/V already written by `write_kv`); `ref_paged_attention` also takes a
per-entry plane table `plane [R, M]` i32 (key j of row r is read from plane
`plane[r, j // S]`: Ouro's 'shared' layout), as does `paged_attention_mgpu`; the Triton
kernels here refuse one. Key position j of row r lives at slot
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

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import is_pow2, one_lowering_per_config, pow2_chunks, resolve_interpret

__all__ = [
    "check_paged_inputs",
    "check_write_inputs",
    "paged_attention",
    "ref_paged_attention",
    "require_scalar_plane",
    "shape_problem",
    "write_kv",
]


def __getattr__(name: str):
    # NOTE: `paged_attention.prefill_attention` resolves lazily (the prefill module imports
    # this one), so callers holding this module find both kernels.
    if name == "prefill_attention":
        from .prefill_attention import prefill_attention

        return prefill_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    if page_table.ndim != 2 or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [R, max_pages], got {page_table.dtype}{page_table.shape}")
    for name, a in (("row_of_token", row_of_token), ("positions", positions)):
        if a.shape != (n,) or a.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32 [{n}] (one per token), got {a.dtype}{a.shape}")
    r, m = page_table.shape
    scalar = jnp.ndim(plane) == 0 and (isinstance(plane, int) or _is_int32(plane))
    if not scalar and (jnp.shape(plane) != (r, m) or not _is_int32(plane)):
        raise ValueError(f"plane must be an int32 scalar or an int32 [{r}, {m}] table (one per "
                         f"page_table entry), got {jnp.asarray(plane).dtype}{jnp.shape(plane)}")
    return n, hq, d, planes, hkv, p, s, r, m


def require_scalar_plane(plane, kernel: str) -> None:
    """The Triton kernels read one plane per call; a per-page plane table (Ouro's 'shared'
    KV layout) is read by ref_paged_attention and paged_attention_mgpu."""
    if jnp.ndim(plane) != 0:
        raise ValueError(f"the Pallas {kernel} kernel reads one plane per call; a per-page plane "
                         "table (Ouro kv layout 'shared') needs attention backend 'xla', "
                         "'pallas_mgpu' or 'auto'")


def shape_problem(group_size: int, page_size: int) -> str | None:
    """Why the Triton decode kernel cannot take these shapes (a one-line error), or None."""
    if not (is_pow2(group_size) and is_pow2(page_size)):
        return (f"the Triton decode kernel needs power-of-two q heads per kv head (got "
                f"{group_size}) and page_size (got {page_size})")
    return None


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
        planes = plane[row_of_token] if plane.ndim else plane  # [N, M] or scalar
        k = k_cache[planes, :, pages]  # [N, M, Hkv, S, D]
        v = v_cache[planes, :, pages]
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


def write_plane(cache, plane, slots, new):
    """cache [planes, Hkv, P, S, D]; new [N, Hkv, D] stored at (plane, slots[N]); slots past
    the end (the drop slot P * S) are dropped. plane [P', 1] with slots [P', N] stores new in
    P' planes at once. Contract: no real (plane, slot) repeats within one call (a token owns
    its slot; padding and masked tokens all go to the out-of-bounds drop slot)."""
    planes, hkv, p, s, d = cache.shape
    flat = cache.reshape(planes, hkv, p * s, d)  # merging P, S is a bitcast
    new = new.astype(cache.dtype)
    if slots.shape[-1] == 1 and jax.default_backend() == "cpu":
        # NOTE: XLA rewrites a one-token scatter as a dynamic-update-slice, and XLA:CPU then
        # copies the whole layer's pool around it (a 1-row decode step ran ~50x slower than
        # an 8-row one on CPU): one more token, to the drop slot, keeps it a scatter. XLA:GPU
        # updates in place (bench/RESULTS.md run 34 call 4): left as it was.
        slots = jnp.concatenate([slots, jnp.full_like(slots, p * s)], axis=-1)
        new = jnp.concatenate([new, new], axis=0)
    # NOTE: unique_indices (true by the contract) lets XLA:GPU store without atomics.
    flat = flat.at[plane, :, slots].set(new, mode="drop", unique_indices=True)
    return flat.reshape(cache.shape)


def write_kv(k_cache, v_cache, plane, slot_mapping, k, v):
    """Scatter k, v [N, Hkv, D] into plane `plane` of the pool at flat slots
    slot_mapping [N] i32 (page * S + offset); slot P * S (padding) is dropped.
    Returns (k_cache, v_cache); donate the pool so XLA updates it in place."""
    check_write_inputs(k_cache, v_cache, plane, slot_mapping, k, v)
    plane = jnp.asarray(plane, jnp.int32)
    return write_plane(k_cache, plane, slot_mapping, k), write_plane(v_cache, plane, slot_mapping, v)


# ----------------------------------------------------------------------------------------
# Pallas decode kernel (Triton-lowered `pl.pallas_call`; interpret=True runs it on CPU).
# ----------------------------------------------------------------------------------------


def _decode_kernel(
    plane_ref,  # [1] i32
    pt_ref,  # [R, M_pad] i32, M_pad a multiple of pages_per_block
    row_ref,  # [N] i32
    pos_ref,  # [N] i32
    q_ref,  # [N, Hkv, G, D]
    k_ref,  # [planes, Hkv, P, S, D]
    v_ref,  # [planes, Hkv, P, S, D]
    o_ref,  # [splits, N, Hkv, G, D] f32 (unnormalized) or [N, Hkv, G, D] dtype if splits == 1
    m_ref,  # [splits, N, Hkv, G] f32 running max (absent if splits == 1)
    l_ref,  # [splits, N, Hkv, G] f32 running sum (absent if splits == 1)
    *,
    pages_per_block: int,
    num_splits: int,
):
    n, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, d = q_ref.shape[2], q_ref.shape[3]
    s = k_ref.shape[3]
    block_k = pages_per_block * s
    dtype = q_ref.dtype
    chunks = pow2_chunks(d)
    plane, row = plane_ref[0], row_ref[n]
    ctx = pos_ref[n] + 1  # keys 0..positions[n]
    num_blocks = pl.cdiv(ctx, block_k)
    per_split = pl.cdiv(num_blocks, num_splits)
    start = split * per_split
    end = jnp.minimum(start + per_split, num_blocks)
    scale = jnp.asarray(d**-0.5, dtype)
    qs = [q_ref[n, h, :, pl.ds(off, sz)].astype(jnp.float32) for off, sz in chunks]  # [G, sz]

    def body(b, carry):
        m_prev, l_prev, accs = carry
        pages = pt_ref[row, pl.ds(b * pages_per_block, pages_per_block)]  # [PB]
        scores = jnp.zeros((g, block_k), jnp.float32)
        vs = []
        for (off, sz), qc in zip(chunks, qs, strict=True):
            kc = k_ref[plane, h, pages, :, pl.ds(off, sz)].reshape(block_k, sz).astype(jnp.float32)
            scores += jnp.sum(qc[:, None, :] * kc[None, :, :], axis=-1)  # [G, BK]
            vs.append(v_ref[plane, h, pages, :, pl.ds(off, sz)].reshape(block_k, sz).astype(jnp.float32))
        # NOTE: the same roundings as causal_attention: scores to dtype, scaled in dtype.
        scores = (scores.astype(dtype) * scale).astype(jnp.float32)
        key_pos = b * block_k + jax.lax.broadcasted_iota(jnp.int32, (g, block_k), 1)
        scores = jnp.where(key_pos < ctx, scores, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(scores, axis=-1))  # finite: key b*BK is valid
        corr = jnp.exp(m_prev - m_next)
        p = jnp.exp(scores - m_next[:, None])  # [G, BK]
        l_next = l_prev * corr + jnp.sum(p, axis=-1)
        pv = [jnp.sum(p[:, :, None] * vc[None, :, :], axis=1) for vc in vs]  # [G, sz] each
        accs = [a * corr[:, None] + x for a, x in zip(accs, pv, strict=True)]
        return m_next, l_next, accs

    init = (
        jnp.full((g,), -jnp.inf, jnp.float32),
        jnp.zeros((g,), jnp.float32),
        [jnp.zeros((g, sz), jnp.float32) for _, sz in chunks],
    )
    m_i, l_i, accs = jax.lax.fori_loop(start, end, body, init)
    if num_splits == 1:
        for (off, sz), a in zip(chunks, accs, strict=True):
            o_ref[n, h, :, pl.ds(off, sz)] = (a / l_i[:, None]).astype(o_ref.dtype)
    else:
        for (off, sz), a in zip(chunks, accs, strict=True):
            o_ref[split, n, h, :, pl.ds(off, sz)] = a
        m_ref[split, n, h, :] = m_i
        l_ref[split, n, h, :] = l_i


def default_num_splits(n: int, hkv: int, max_blocks: int, target_programs: int = 264) -> int:
    """Split the context so that ~2 programs per H200 SM (132) run; at most one block each."""
    return max(1, min(max_blocks, -(-target_programs // (n * hkv))))


def paged_attention(
    q,  # [N, Hq, D]
    k_cache,  # [planes, Hkv, P, S, D]
    v_cache,  # [planes, Hkv, P, S, D]
    plane,  # i32 scalar
    page_table,  # [R, M] i32
    row_of_token,  # [N] i32
    positions,  # [N] i32
    *,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
):
    """Pallas paged decode attention, one program per (token, kv head, context split);
    the G = Hq // Hkv q heads of a kv head share each K/V read. Reads the pool in place
    (no relayout); online softmax with fp32 accumulation. Same contract and result (to
    fp32-accumulation tolerance) as ref_paged_attention. Works for any N, but each
    program walks its token's whole context: use prefill_attention for long prompts."""
    n, hq, d, _, hkv, _, s, _, m = check_paged_inputs(
        q, k_cache, v_cache, plane, page_table, row_of_token, positions
    )
    require_scalar_plane(plane, "decode")
    g = hq // hkv
    interpret = resolve_interpret(interpret)
    problem = shape_problem(g, s)
    if problem:
        raise ValueError(problem)
    if pages_per_block is None:
        pages_per_block = max(1, min(m, 64 // s)) if s < 64 else 1
        pages_per_block = 1 << (pages_per_block.bit_length() - 1)
    if not is_pow2(pages_per_block):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block}")
    if num_splits is None:
        num_splits = default_num_splits(n, hkv, -(-m // pages_per_block))
    return _decode_call(q, k_cache, v_cache, jnp.asarray(plane, jnp.int32).reshape(1), page_table,
                        row_of_token, positions, pages_per_block=pages_per_block,
                        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                        interpret=interpret)


@one_lowering_per_config("pages_per_block", "num_splits", "num_warps", "num_stages", "interpret")
def _decode_call(q, k_cache, v_cache, plane, page_table, row_of_token, positions, *,
                 pages_per_block: int, num_splits: int, num_warps: int, num_stages: int,
                 interpret: bool):
    """The kernel and its split combine, for inputs `paged_attention` checked; plane [1]."""
    n, hq, d = q.shape
    hkv, m = k_cache.shape[1], page_table.shape[1]
    g = hq // hkv
    m_pad = -(-m // pages_per_block) * pages_per_block
    if m_pad != m:  # NOTE: padded entries are never read as keys (masked by position).
        page_table = jnp.pad(page_table, ((0, 0), (0, m_pad - m)))
    kernel = functools.partial(_decode_kernel, pages_per_block=pages_per_block, num_splits=num_splits)
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((n, hkv, g, d), q.dtype)]
        kernel_fn = lambda *refs: kernel(*refs, None, None)  # noqa: E731
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, n, hkv, g, d), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, n, hkv, g), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, n, hkv, g), jnp.float32),
        ]
        kernel_fn = kernel
    outs = pl.pallas_call(
        kernel_fn,
        out_shape=out_shape,
        grid=(n, hkv, num_splits),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="loopjax_paged_decode",
    )(plane, page_table, row_of_token, positions, q.reshape(n, hkv, g, d), k_cache, v_cache)
    if num_splits == 1:
        return outs[0].reshape(n, hq, d)
    return combine_splits(*outs).astype(q.dtype).reshape(n, hq, d)


def combine_splits(acc, m_s, l_s):
    """The softmax of a context split across programs: acc [splits, ..., D] f32
    unnormalized, m_s / l_s [splits, ...] f32 running max / sum -> [..., D] f32."""
    m_all = jnp.max(m_s, axis=0)  # split 0 always holds the first block: finite
    w = jnp.exp(m_s - m_all[None])  # empty splits: exp(-inf) = 0
    l_all = jnp.sum(l_s * w, axis=0)
    return jnp.sum(acc * w[..., None], axis=0) / l_all[..., None]
