"""Flash-style prefill attention over packed prompts, reading K/V from the paged pool.

Same contract as paged_attention (docs/design.md):
    prefill_attention(q [N,Hq,D], k_cache [planes,Hkv,P,S,D], v_cache, plane i32[],
                      page_table [R,M] i32, row_of_token [N] i32, positions [N] i32)
      -> out [N,Hq,D]
Token n attends keys 0..positions[n] of row row_of_token[n] on plane `plane`. The step's
own K/V is written first (write_kv), so a chunk of a longer prompt (chunked prefill) sees
its cached prefix through the same pages. Several sequences are concatenated without
padding; extra contract of this kernel: each row's tokens are contiguous in the packing
(at most R + 1 runs of equal row_of_token, a padding run included).

The packed tokens are cut into query blocks of at most `block_q` tokens of one run; one
program per (q head, query block) walks key blocks 0..max position of its block with an
online fp32 softmax (Triton-lowered `pl.pallas_call`, tensor-core dots). Blocks run heaviest
first (`heaviest_first`).
`ref_prefill_attention` is ref_paged_attention.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (
    compiler_params,
    is_pow2,
    load_tile,
    load_vec,
    one_lowering_per_config,
    pow2_chunks,
    resolve_interpret,
    store_tile,
)
from .paged_attention import check_paged_inputs, ref_paged_attention, require_scalar_plane

__all__ = ["heaviest_first", "prefill_attention", "query_blocks", "ref_prefill_attention", "shape_problem"]


def ref_prefill_attention(q, k_cache, v_cache, plane, page_table, row_of_token, positions):
    return ref_paged_attention(q, k_cache, v_cache, plane, page_table, row_of_token, positions)


def query_blocks(row_of_token, num_rows: int, block_q: int):
    """(starts, ends) [B] i32 of the query blocks: maximal runs of one row, cut every block_q
    tokens; B = min(N, cdiv(N, block_q) + R + 1) is static, unused blocks have start = N."""
    n = row_of_token.shape[0]
    idx = jnp.arange(n, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones((1,), bool), row_of_token[1:] != row_of_token[:-1]])
    run_start = jax.lax.cummax(jnp.where(new_run, idx, 0))
    is_start = new_run | ((idx - run_start) % block_q == 0)
    num_blocks = min(n, -(-n // block_q) + num_rows + 1)
    (starts,) = jnp.nonzero(is_start, size=num_blocks, fill_value=n)
    starts = starts.astype(jnp.int32)
    ends = jnp.concatenate([starts[1:], jnp.full((1,), n, jnp.int32)])
    return starts, ends


def _kernel(
    starts_ref,  # [B] i32 first token of each query block (N = unused)
    ends_ref,  # [B] i32 one past its last token
    plane_ref,  # [1] i32
    pt_ref,  # [R, M_pad] i32
    row_ref,  # [N] i32
    pos_ref,  # [N] i32
    q_ref,  # [N, Hq * D]
    k_ref,  # [planes, Hkv, P, S, D]
    v_ref,  # [planes, Hkv, P, S, D]
    o_ref,  # [N, Hq * D]
    *,
    block_q: int,
    pages_per_block: int,
    group: int,
):
    h, b = pl.program_id(0), pl.program_id(1)
    n = row_ref.shape[0]
    d, s = k_ref.shape[4], k_ref.shape[3]
    block_k = pages_per_block * s
    dtype = q_ref.dtype
    chunks = pow2_chunks(d)
    t0, t1 = starts_ref[b], ends_ref[b]
    kv_head = h // group
    # NOTE: f32 dots must not run in tf32; bf16 dots use the tensor cores as they are.
    tf32 = None if dtype != jnp.float32 else False

    @pl.when(t0 < n)
    def _():
        plane, row = plane_ref[0], row_ref[t0]
        pos = load_vec(pos_ref, t0, block_q, t1 - t0)  # [BQ]; 0 past the block: key 0 only
        qs = [load_tile(q_ref, t0, block_q, h * d + off, sz, t1, sz) for off, sz in chunks]
        scale = jnp.asarray(d**-0.5, dtype)

        def body(kb, carry):
            m_prev, l_prev, accs = carry
            pages = pt_ref[row, pl.ds(kb * pages_per_block, pages_per_block)]  # [PB]
            scores = jnp.zeros((block_q, block_k), jnp.float32)
            vs = []
            for (off, sz), qc in zip(chunks, qs, strict=True):
                kc = k_ref[plane, kv_head, pages, :, pl.ds(off, sz)].reshape(block_k, sz)
                scores += plgpu.dot(qc, kc, trans_b=True, allow_tf32=tf32)  # [BQ, BK] f32
                vs.append(v_ref[plane, kv_head, pages, :, pl.ds(off, sz)].reshape(block_k, sz))
            scores = (scores.astype(dtype) * scale).astype(jnp.float32)  # causal_attention's casts
            key_pos = kb * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
            scores = jnp.where(key_pos <= pos[:, None], scores, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(scores, axis=-1))  # finite: key 0 in block 0
            corr = jnp.exp(m_prev - m_next)
            p = jnp.exp(scores - m_next[:, None])
            l_next = l_prev * corr + jnp.sum(p, axis=-1)
            pv = [plgpu.dot(p.astype(dtype), vc, allow_tf32=tf32) for vc in vs]  # [BQ, sz] each
            accs = [a * corr[:, None] + x for a, x in zip(accs, pv, strict=True)]
            return m_next, l_next, accs

        init = (
            jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32),
            [jnp.zeros((block_q, sz), jnp.float32) for _, sz in chunks],
        )
        num_kb = pl.cdiv(jnp.max(pos) + 1, block_k)
        _, l_i, accs = jax.lax.fori_loop(0, num_kb, body, init)
        for (off, sz), a in zip(chunks, accs, strict=True):
            store_tile(o_ref, t0, h * d + off, (a / l_i[:, None]).astype(dtype), t1, sz)


def heaviest_first(starts, ends, positions):
    """query_blocks' (starts, ends) reordered by decreasing work: a block walks key blocks up
    to its last token's position, so a prompt's last block walks the most; unused blocks go
    last. The grid launches them in this order, so the longest programs start first instead of
    ending the grid alone."""
    n = positions.shape[0]
    work = jnp.where(starts < n, positions[jnp.clip(ends - 1, 0, n - 1)] + 1, 0)
    order = jnp.argsort(-work, stable=True)
    return starts[order], ends[order]


def shape_problem(page_size: int, head_dim: int, *, block_q: int = 64, block_k: int = 64) -> str | None:
    """Why the kernel cannot take these shapes (a one-line error), or None when it can."""
    if not (is_pow2(page_size) and is_pow2(block_q) and is_pow2(block_k) and block_k >= page_size):
        return (f"the Triton prefill kernel needs powers of two for page_size ({page_size}), block_q "
                f"({block_q}) and block_k ({block_k}), and block_k >= page_size")
    if min(block_q, block_k) < 16 or min(size for _, size in pow2_chunks(head_dim)) < 16:
        return (f"the Triton prefill kernel's tensor-core dots need block_q, block_k >= 16 and "
                f"head_dim in power-of-two chunks of at least 16 (got head_dim {head_dim})")
    return None


def prefill_attention(
    q,  # [N, Hq, D]
    k_cache,  # [planes, Hkv, P, S, D]
    v_cache,  # [planes, Hkv, P, S, D]
    plane,  # i32 scalar
    page_table,  # [R, M] i32
    row_of_token,  # [N] i32
    positions,  # [N] i32
    *,
    block_q: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
):
    """Pallas prefill attention (module docstring); the query-block table is computed
    on device from row_of_token, so the call stays one jitted step."""
    _, _, d, _, _, _, s, _, _ = check_paged_inputs(
        q, k_cache, v_cache, plane, page_table, row_of_token, positions
    )
    require_scalar_plane(plane, "prefill")
    problem = shape_problem(s, d, block_q=block_q, block_k=block_k)
    if problem:
        raise ValueError(problem)
    return _prefill_call(q, k_cache, v_cache, jnp.asarray(plane, jnp.int32).reshape(1), page_table,
                         row_of_token, positions, block_q=block_q, block_k=block_k,
                         num_warps=num_warps, num_stages=num_stages,
                         interpret=resolve_interpret(interpret))


@one_lowering_per_config("block_q", "block_k", "num_warps", "num_stages", "interpret")
def _prefill_call(q, k_cache, v_cache, plane, page_table, row_of_token, positions, *, block_q: int,
                  block_k: int, num_warps: int, num_stages: int, interpret: bool):
    """The kernel, for inputs `prefill_attention` checked; plane [1]."""
    n, hq, d = q.shape
    hkv, s, m, r = k_cache.shape[1], k_cache.shape[3], page_table.shape[1], page_table.shape[0]
    pages_per_block = block_k // s
    m_pad = -(-m // pages_per_block) * pages_per_block
    if m_pad != m:  # NOTE: padded entries are never read as keys (masked by position).
        page_table = jnp.pad(page_table, ((0, 0), (0, m_pad - m)))
    starts, ends = heaviest_first(*query_blocks(row_of_token, r, block_q), positions)
    kernel = functools.partial(_kernel, block_q=block_q, pages_per_block=pages_per_block, group=hq // hkv)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, hq * d), q.dtype),
        grid=(hq, starts.shape[0]),  # NOTE: axis 0 launches fastest: a block's every head, then the next
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="loopjax_paged_prefill",
    )(starts, ends, plane, page_table, row_of_token, positions, q.reshape(n, hq * d), k_cache, v_cache)
    return out.reshape(n, hq, d)
