"""Paged decode attention on Mosaic GPU (`pallas.mosaic_gpu`, the maintained Hopper
backend): the contract and result of `ref_paged_attention` (one program per token, so
decode's one token per row and any N), a second backend beside the Triton kernel. `plane` is
an i32 scalar or, as for the ref, an [R, M] i32 table of the plane each page is read from
(Ouro's 'shared' KV layout): each page's TMA copy reads its own plane.

Two entry points over one kernel body:
- `paged_attention_mgpu(q, k_cache, v_cache, plane, ...) -> out`: attends a pool whose step
  K/V is already written (`write_kv`).
- `paged_attention_mgpu_write(q, k_new, v_new, write_slots, k_cache, v_cache, plane, ...) ->
  (out, k_cache, v_cache)`: writes the step's K/V itself, then attends; the result of
  `write_kv` then `ref_paged_attention` (the pool bitwise). It saves a decode step the two
  XLA scatter kernels per layer (a few us of fixed cost each on the H200). The pools are
  aliased in and out (XLA updates them in place). Contract on values besides the module
  contract of paged_attention.py: write_slots[n] is either the drop slot (>= P * S: nothing
  written, as write_kv's mode="drop") or the slot of key positions[n] of row row_of_token[n],
  and no token reads a slot another token writes (decode: one token per row, and a row's
  newest key lies in a page no other row reads); plane is an i32 scalar.

One program (one warpgroup) per (token, group of `heads_per_program` kv heads, context
split). It streams its row's K/V pages of each of its kv heads in turn straight from the pool
(a page of one head is a contiguous [S, D] tile: one TMA copy into a swizzled smem slot)
through `num_stages` slots, a block of `pages_per_block` pages per slot (block_k =
pages_per_block * S keys, a multiple of 64), and stops at the row's own length (a row's
blocks are divided among the splits in runs of at least `min_blocks_per_split`, so a short
row leaves its last splits empty: they write a zero-weight partial). The slots
run on across the program's heads (the next head's first blocks load while this head's last
are read), so a program of several heads pays the pipeline's ramp once: with many rows the
grid then fits in one wave of resident programs (the config's `default_heads_per_program`).
Keys are processed in tiles of 64 (the rows of a WGMMA register layout). Scores and p @ v
are vector products in fp32 registers (G = Hq/Hkv is 1..8 rows, too few for wgmma's 64), so
fp32 pools are exact (no tf32).

Online softmax in fp32 with the ref's score roundings (scores rounded to the activation
dtype, scaled in it); like the Triton kernel, probabilities stay in fp32 (the ref rounds
normalized probs, which an online softmax cannot). Where G * D <= 128 (Ouro, Huginn: G = 1)
each of the 64 key lanes of a tile keeps its own running max, sum and [D] accumulator, so
the loop has no cross-warp reduction; the lanes merge once at the end. Larger G reduce
every tile (registers). With one context split the kernel writes the normalized output in
q's dtype (acc / sum: `combine_splits`' arithmetic for one split, so no XLA combine kernel
runs); with more, each split writes an unnormalized fp32 partial (acc, max, sum), combined
in XLA as the Triton kernel does (`combine_splits`).

Shapes taken, block / stage / split defaults and the call's checks: paged_attention_mgpu_config.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from ._common import one_lowering_per_config
from .paged_attention import check_write_inputs, combine_splits
from .paged_attention_mgpu_config import ROWS, settle_config, shape_problem

__all__ = ["paged_attention_mgpu", "paged_attention_mgpu_write", "shape_problem"]

ROW_LAYOUT = plmgpu.Layout.WGMMA.reduce(1)  # [64] vectors: one entry per key of a tile
COL_LAYOUT = plmgpu.Layout.WGMMA.reduce(0)  # [D] vectors: one entry per head-dim lane
LANE_ACC_MAX = 128  # G * D up to which every key lane keeps its own [D] accumulator
NEG = -1e30  # finite "no key yet" running max (exp(NEG - NEG) = 1, not NaN; exp(NEG - m) = 0)


def _round_scores(scores, dtype, scale):
    """causal_attention's roundings of f32 q.k products: rounded to the activation dtype,
    scaled in it, back to f32."""
    return (scores.astype(dtype) * scale).astype(jnp.float32)


def _scores(q, k, valid, dtype, scale):
    """[64] f32 scores of q [D] against a key tile k [64, D]; invalid keys -inf."""
    scores = jnp.sum(k * jax.lax.broadcast_in_dim(q, k.shape, (1,)), axis=1)
    return jnp.where(valid, _round_scores(scores, dtype, scale), -jnp.inf)


def _lane_update(state, scores, v):
    """One online-softmax state per key lane (row of the tile): m, l [64], acc [64, D].
    Elementwise only: no cross-warp reduction until the end (`_lane_finish`)."""
    m_prev, l_prev, acc = state
    m_next = jnp.maximum(m_prev, scores)
    corr, p = jnp.exp(m_prev - m_next), jnp.exp(scores - m_next)
    bcast = lambda x: jax.lax.broadcast_in_dim(x, v.shape, (0,))  # noqa: E731
    return m_next, l_prev * corr + p, acc * bcast(corr) + bcast(p) * v


def _lane_finish(state):
    """Merge the key lanes -> (m, l) scalars, acc [D] (unnormalized, relative to m)."""
    m_lanes, l_lanes, acc = state
    m_i = jnp.max(m_lanes)
    w = jnp.exp(m_lanes - m_i)
    return m_i, jnp.sum(l_lanes * w), jnp.sum(acc * jax.lax.broadcast_in_dim(w, acc.shape, (0,)), axis=0)


def _tile_update(state, scores, v):
    """One online-softmax state per q head: m, l scalars, acc [D], reduced every tile.
    NOTE: m starts at NEG, not -inf: a tile of no valid key (a writing program whose only key
    is the new one) then leaves the state as it is instead of making it NaN."""
    m_prev, l_prev, acc = state
    m_next = jnp.maximum(m_prev, jnp.max(scores))
    corr, p = jnp.exp(m_prev - m_next), jnp.exp(scores - m_next)
    return m_next, l_prev * corr + jnp.sum(p), acc * corr + jnp.sum(
        jax.lax.broadcast_in_dim(p, v.shape, (0,)) * v, axis=0)


def _fold_key(state, score, v):
    """Fold one key (score f32 scalar, -inf: no key, the state stays bitwise as it is; v [D]
    f32) into a merged state (m, l scalars, acc [D])."""
    m_prev, l_prev, acc = state
    m_next = jnp.maximum(m_prev, score)
    corr, p = jnp.exp(m_prev - m_next), jnp.exp(score - m_next)
    return m_next, l_prev * corr + p, acc * corr + p * v


def _decode_body(
    plane_ref,  # [1, 1] i32: every page's plane, or [R, M_pad] i32: page_table[r, j]'s plane
    pt_ref,  # [R, M_pad] i32, M_pad a multiple of pages_per_block
    row_ref,  # [N] i32
    pos_ref,  # [N] i32
    q_ref,  # [N, Hkv, G, D]
    k_ref,  # [planes, Hkv, P, S, D] (written in place when new_refs)
    v_ref,  # [planes, Hkv, P, S, D]
    new_refs,  # () or (slot_ref [N] i32, k_new_ref [N, Hkv, D], v_new_ref [N, Hkv, D])
    out_refs,  # (out [N, Hkv, G, D] q dtype,) if normalize, else the split partials:
    #            (acc [splits, N, Hkv, G, D] f32 unnormalized, m, l [splits, N, Hkv, G] f32)
    k_smem,  # [stages, block_k, D]
    v_smem,  # [stages, block_k, D]
    ready,  # one barrier per slot: its K and V pages have landed
    *,
    pages_per_block: int,
    num_splits: int,
    min_blocks_per_split: int,
    num_stages: int,
    heads_per_program: int,
    normalize: bool,
):
    n, head_group, split = (jax.lax.axis_index(a) for a in ("token", "head", "split"))
    g, d = q_ref.shape[2], q_ref.shape[3]
    s = k_ref.shape[3]
    block_k = pages_per_block * s
    dtype = q_ref.dtype
    lanes = g * d <= LANE_ACC_MAX  # NOTE: [64, D] f32 per head = G * D / 2 registers per thread
    row = row_ref[n]
    # NOTE: a [1, 1] table (a scalar plane) is read once, not once per page.
    per_page = plane_ref.shape != (1, 1)
    plane = None if per_page else plane_ref[0, 0]
    ctx = pos_ref[n] + 1  # keys 0..positions[n]
    num_blocks = pl.cdiv(ctx, block_k)
    # NOTE: a split takes at least min_blocks_per_split blocks, so a short context leaves the
    # last splits empty (they write a zero-weight partial) instead of spreading thin.
    per_split = jnp.maximum(pl.cdiv(num_blocks, num_splits), min_blocks_per_split)
    start = split * per_split
    steps = jnp.maximum(jnp.minimum(start + per_split, num_blocks) - start, 0)  # blocks per head
    # Global steps g = i * steps + block run over the program's heads i = 0..heads_per_program-1
    # (every head of a row has the same blocks); a slot's g is g % num_stages.
    total_steps = heads_per_program * steps
    divisor = jnp.maximum(steps, 1)  # NOTE: steps == 0 runs no step; keeps the divisions defined
    first_head = head_group * heads_per_program
    scale = jnp.asarray(d**-0.5, dtype)
    pool_ctx = ctx  # keys read from the pool: 0..pool_ctx - 1
    if new_refs:
        slot_ref, k_new_ref, v_new_ref = new_refs
        slot = slot_ref[n]
        owner = (steps > 0) & (start + steps == num_blocks)  # this split holds key positions[n]
        writes = slot < k_ref.shape[2] * s  # the drop slot writes nothing: the pool key is read
        pool_ctx = ctx - writes.astype(jnp.int32)

    def pages_of(step):  # (plane, page) per page of global step `step` (clamped; past the end: not fetched)
        block = jax.lax.rem(step, divisor)
        first = jnp.minimum(start + block, pt_ref.shape[1] // pages_per_block - 1) * pages_per_block
        entries = [first + i for i in range(pages_per_block)]
        planes = [plane_ref[row, j] for j in entries] if per_page else [plane] * pages_per_block
        return list(zip(planes, [pt_ref[row, j] for j in entries], strict=True))

    def fetch(step, pages, slot):  # one TMA copy per page of K and of V into the slot
        h = first_head + jnp.minimum(jax.lax.div(step, divisor), heads_per_program - 1)
        for i, (plane, page) in enumerate(pages):
            rows = pl.ds(i * s, s)
            plmgpu.copy_gmem_to_smem(k_ref.at[plane, h, page], k_smem.at[slot, rows], ready.at[slot])
            plmgpu.copy_gmem_to_smem(v_ref.at[plane, h, page], v_smem.at[slot, rows], ready.at[slot])

    first_pages = [pages_of(i) for i in range(num_stages)]
    for i in range(num_stages):
        pl.when(i < total_steps)(lambda i=i: fetch(i, first_pages[i], i))

    def attend_head(i, _):
        h = first_head + i
        # NOTE: q is read once per head, straight from gmem (Mosaic's vectorized loads are smem-only).
        qs = [plmgpu.load(q_ref.at[n, h, j], layout=COL_LAYOUT, optimized=False).astype(jnp.float32)
              for j in range(g)]  # G x [D]
        if new_refs:
            # NOTE: the split holding key positions[n] writes the new K/V with a plain register
            # store (not a TMA copy) and takes the new key from registers, never from the pool: the
            # store and this program's TMA loads of the same page then need no ordering (the key is
            # masked out of what the loads bring), and a [D] row costs no smem slot, fence or
            # barrier. No other program reads the slot (the contract).
            k_new = plmgpu.load(k_new_ref.at[n, h], layout=COL_LAYOUT, optimized=False)
            v_new = plmgpu.load(v_new_ref.at[n, h], layout=COL_LAYOUT, optimized=False)

            @pl.when(owner & writes)
            def _():
                page, offset = jax.lax.div(slot, s), jax.lax.rem(slot, s)
                k_ref[plane, h, page, offset] = k_new
                v_ref[plane, h, page, offset] = v_new

        def body(block, carry):
            step = i * steps + block
            slot = jax.lax.rem(step, num_stages)
            # NOTE: the planes and page ids of the block fetched below are read first: their
            # global-load latency then hides behind this block's math instead of stalling the copy.
            next_pages = pages_of(step + num_stages)
            plmgpu.barrier_wait(ready.at[slot])
            for t in range(block_k // ROWS):
                tile = pl.ds(t * ROWS, ROWS)
                key_pos = (start + block) * block_k + t * ROWS + plmgpu.broadcasted_iota(
                    jnp.int32, (ROWS,), 0, layout=ROW_LAYOUT)
                k = plmgpu.load(k_smem.at[slot, tile], layout=plmgpu.Layout.WGMMA).astype(jnp.float32)
                scores = [_scores(qj, k, key_pos < pool_ctx, dtype, scale) for qj in qs]
                # NOTE: V is loaded once K is dead: [64, D] f32 tiles are D / 2 registers a thread.
                v = plmgpu.load(v_smem.at[slot, tile], layout=plmgpu.Layout.WGMMA).astype(jnp.float32)
                update = _lane_update if lanes else _tile_update
                carry = [update(state, sc, v) for sc, state in zip(scores, carry, strict=True)]

            @pl.when(step + num_stages < total_steps)
            def _():  # NOTE: the copy waits for the whole warpgroup to finish reading the slot
                fetch(step + num_stages, next_pages, slot)

            return carry

        zeros = lambda shape, layout: plmgpu.layout_cast(jnp.zeros(shape, jnp.float32), layout)  # noqa: E731
        if lanes:
            init = (plmgpu.layout_cast(jnp.full((ROWS,), NEG, jnp.float32), ROW_LAYOUT),
                    zeros((ROWS,), ROW_LAYOUT), zeros((ROWS, d), plmgpu.Layout.WGMMA))
        else:
            init = (jnp.float32(NEG), jnp.float32(0), zeros((d,), COL_LAYOUT))
        carry = jax.lax.fori_loop(0, steps, body, [init] * g)
        for j, state in enumerate(carry):
            state = _lane_finish(state) if lanes else state
            if new_refs:  # the new key, in its owner only (elsewhere -inf: a no-op)
                score = _round_scores(jnp.sum(qs[j] * k_new.astype(jnp.float32)), dtype, scale)
                state = _fold_key(state, jnp.where(owner & writes, score, -jnp.inf),
                                  v_new.astype(jnp.float32))
            m_i, l_i, acc = state
            if normalize:  # NOTE: combine_splits for one split: weight exp(m - m) = 1, acc / l
                out_refs[0][n, h, j] = (acc / l_i).astype(out_refs[0].dtype)
            else:
                acc_ref, m_ref, l_ref = out_refs
                acc_ref[split, n, h, j] = acc
                m_ref[split, n, h, j] = m_i
                l_ref[split, n, h, j] = l_i
        return 0

    if heads_per_program == 1:  # NOTE: no head loop in the kernel's code
        attend_head(0, 0)
    else:
        jax.lax.fori_loop(0, heads_per_program, attend_head, 0)


def paged_attention_mgpu(
    q,  # [N, Hq, D] (decode: N == R, one token per row)
    k_cache,  # [planes, Hkv, P, S, D]
    v_cache,  # [planes, Hkv, P, S, D]
    plane,  # i32 scalar, or [R, M] i32: page_table[r, j] read from plane plane[r, j]
    page_table,  # [R, M] i32
    row_of_token,  # [N] i32
    positions,  # [N] i32
    *,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    min_blocks_per_split: int | None = None,
    num_stages: int | None = None,
    heads_per_program: int | None = None,
    interpret: bool | None = None,
):
    """Paged decode attention on Mosaic GPU (interpret: its CPU interpreter); the same
    contract and result (to fp32-accumulation tolerance) as ref_paged_attention."""
    config = settle_config(q, k_cache, v_cache, plane, page_table, row_of_token, positions,
                     pages_per_block=pages_per_block, num_splits=num_splits,
                     min_blocks_per_split=min_blocks_per_split, num_stages=num_stages,
                     heads_per_program=heads_per_program, interpret=interpret)
    return _decode_call(q, k_cache, v_cache, jnp.asarray(plane, jnp.int32), page_table,
                        row_of_token, positions, **config)


def paged_attention_mgpu_write(
    q,  # [N, Hq, D] (decode: N == R, one token per row)
    k_new,  # [N, Hkv, D] the step's keys, pool dtype
    v_new,  # [N, Hkv, D] the step's values, pool dtype
    write_slots,  # [N] i32: page * S + offset of token n's key positions[n]; >= P * S: drop
    k_cache,  # [planes, Hkv, P, S, D]
    v_cache,  # [planes, Hkv, P, S, D]
    plane,  # i32 scalar: the plane written and read
    page_table,  # [R, M] i32
    row_of_token,  # [N] i32
    positions,  # [N] i32
    *,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    min_blocks_per_split: int | None = None,
    num_stages: int | None = None,
    heads_per_program: int | None = None,
    interpret: bool | None = None,
):
    """write_kv then paged_attention_mgpu in one kernel -> (out [N, Hq, D], k_cache,
    v_cache): the pools bitwise those of write_kv, out that of ref_paged_attention over them
    (to fp32-accumulation tolerance); see the module docstring for the contract. Donate the
    pools (or let them die here) so that XLA updates them in place."""
    check_write_inputs(k_cache, v_cache, plane, write_slots, k_new, v_new)
    if write_slots.shape != positions.shape:
        raise ValueError(f"write_slots must be int32 [{positions.shape[0]}] (one per token), got "
                         f"{write_slots.dtype}{write_slots.shape}")
    config = settle_config(q, k_cache, v_cache, plane, page_table, row_of_token, positions,
                     pages_per_block=pages_per_block, num_splits=num_splits,
                     min_blocks_per_split=min_blocks_per_split, num_stages=num_stages,
                     heads_per_program=heads_per_program, interpret=interpret)
    return _write_call(q, k_new, v_new, write_slots, k_cache, v_cache, jnp.asarray(plane, jnp.int32),
                       page_table, row_of_token, positions, **config)


@one_lowering_per_config("pages_per_block", "num_splits", "min_blocks_per_split", "num_stages",
                         "heads_per_program", "normalize", "interpret")
def _decode_call(q, k_cache, v_cache, plane, page_table, row_of_token, positions, **config):
    """The kernel (and its split combine) for inputs `settle_config` checked; plane: an i32 scalar
    or [R, M] table."""
    return _attend(q, k_cache, v_cache, plane, page_table, row_of_token, positions, (), **config)


@one_lowering_per_config("pages_per_block", "num_splits", "min_blocks_per_split", "num_stages",
                         "heads_per_program", "normalize", "interpret")
def _write_call(q, k_new, v_new, write_slots, k_cache, v_cache, plane, page_table, row_of_token,
                positions, **config):
    """The writing kernel for checked inputs; plane: an i32 scalar. The pools enter as refs,
    which the kernel call turns into input/output aliases (in-place updates)."""
    k_ref, v_ref = jax.new_ref(k_cache), jax.new_ref(v_cache)
    out = _attend(q, k_ref, v_ref, plane, page_table, row_of_token, positions,
                  (write_slots, k_new, v_new), **config)
    return out, k_ref[...], v_ref[...]


def _attend(q, k_cache, v_cache, plane, page_table, row_of_token, positions, new, *,
            pages_per_block: int, num_splits: int, min_blocks_per_split: int, num_stages: int,
            heads_per_program: int, normalize: bool, interpret: bool):
    """One kernel call: new = () (attend only) or (write_slots, k_new, v_new) (write, then
    attend); k_cache, v_cache: arrays, or refs when written."""
    n, hq, d = q.shape
    hkv, s, m = k_cache.shape[1], k_cache.shape[3], page_table.shape[1]
    g, itemsize = hq // hkv, jnp.dtype(q.dtype).itemsize
    block_k = pages_per_block * s
    m_pad = -(-m // pages_per_block) * pages_per_block
    # NOTE: a scalar plane stays a [1, 1] table: no [R, M] fill in XLA, no per-page plane loads.
    plane_table = jnp.asarray(plane, jnp.int32).reshape(jnp.shape(plane) or (1, 1))
    if m_pad != m:  # NOTE: padded entries (page 0; plane 0 in a table) are read but masked by position.
        page_table = jnp.pad(page_table, ((0, 0), (0, m_pad - m)))
        if jnp.ndim(plane):
            plane_table = jnp.pad(plane_table, ((0, 0), (0, m_pad - m)))
    part = (num_splits, n, hkv, g)
    config = dict(pages_per_block=pages_per_block, num_splits=num_splits,
                  min_blocks_per_split=min_blocks_per_split, num_stages=num_stages,
                  heads_per_program=heads_per_program, normalize=normalize)
    num_in, num_out = 7 + len(new), 1 if normalize else 3

    def body(*refs):
        ins, outs, scratch = refs[:num_in], refs[num_in:num_in + num_out], refs[num_in + num_out:]
        _decode_body(*ins[:7], ins[7:], outs, *scratch, **config)

    swizzle = plmgpu.find_swizzle(d * itemsize * 8)
    # NOTE: swizzled slots: the WGMMA-layout register loads then avoid bank conflicts.
    transforms = (plmgpu.TilingTransform((8, swizzle // itemsize)),
                  plmgpu.SwizzleTransform(swizzle))
    scratch = [
        plmgpu.SMEM((num_stages, block_k, d), q.dtype, transforms=transforms),
        plmgpu.SMEM((num_stages, block_k, d), q.dtype, transforms=transforms),
        plmgpu.Barrier(num_arrivals=2 * pages_per_block, num_barriers=num_stages),
    ]
    if normalize:
        out_type = [jax.ShapeDtypeStruct((n, hkv, g, d), q.dtype)]
    else:
        out_type = [jax.ShapeDtypeStruct((*part, d), jnp.float32),
                    jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    outs = plmgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch,
        grid=(n, hkv // heads_per_program, num_splits),
        grid_names=("token", "head", "split"),
        kernel_name="loopjax_paged_decode_write" if new else "loopjax_paged_decode",
        interpret=plmgpu.InterpretGPUParams() if interpret else None,
    )(plane_table, page_table, row_of_token, positions, q.reshape(n, hkv, g, d), k_cache, v_cache,
      *new)
    if normalize:
        return outs[0].reshape(n, hq, d)
    return combine_splits(*outs).astype(q.dtype).reshape(n, hq, d)
