"""Mosaic GPU paged decode attention: its CPU interpreter vs ref_paged_attention (fp32 and
bf16, page and block boundaries, rows of different lengths, split contexts, pipeline slots
reused, GQA, head_dim 96, per-page plane tables); the writing entry point vs write_kv then
ref_paged_attention (the pool bitwise); the in-kernel normalization of one split bitwise equal
to the partials + combine_splits; bad inputs; both entry points lowered for CUDA on this CPU
host at the real Ouro-1.4B and Huginn-0125 decode shapes (so a Mosaic GPU lowering error fails
CI), and the engine backend (per_loop: the writing kernel; Ouro 'shared': write_kv + attend)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import use_abstract_mesh

from loopjax.kernels import paged_attention_mgpu as mgpu
from loopjax.kernels.paged_attention import ref_paged_attention, write_kv
from loopjax.kernels.paged_attention_mgpu import paged_attention_mgpu, paged_attention_mgpu_write
from loopjax.kernels.prefill_attention import prefill_attention

F32, BF16 = jnp.float32, jnp.bfloat16
ATOL = {F32: 2e-5, BF16: 3e-2}  # fp32-accumulation tolerance, as tests/test_kernels.py


def _case(rs, n, hq, hkv, d, s, m, dtype, planes=2):
    """n rows of up to m pages each (distinct random pages, 3 spare) and positions at a
    first key, a page's last and next key, the last key, and random (odd) lengths."""
    pages = n * m + 3
    pool = [jnp.asarray(rs.standard_normal((planes, hkv, pages, s, d)), dtype) for _ in range(2)]
    pt = jnp.asarray(rs.permutation(pages)[: n * m].reshape(n, m), jnp.int32)
    pos = np.array([0, s - 1, s, m * s - 1, rs.integers(0, m * s) | 1])[np.arange(n) % 5]
    q = jnp.asarray(rs.standard_normal((n, hq, d)), dtype)
    return q, *pool, pt, jnp.asarray(np.minimum(pos, m * s - 1), jnp.int32)


CASES = [  # n, hq, hkv, d, page_size, max_pages, dtype, num_splits, pages_per_block, num_stages
    # (G * D <= 128: per-key-lane accumulators; above: reduced every tile)
    (1, 1, 1, 128, 16, 4, F32, None, None, 2),  # one row, one token, one block
    (5, 2, 2, 128, 16, 9, BF16, 2, None, 2),  # padded page table (9 -> 12), split context
    (4, 2, 2, 96, 16, 12, F32, 1, 4, 1),  # Huginn's head_dim; 3 blocks through 1 slot
    (3, 8, 2, 64, 32, 6, BF16, 1, 2, 2),  # GQA 4; 3 blocks through 2 slots
    (5, 3, 3, 96, 64, 3, BF16, 3, 1, 2),  # one 64-slot page per block; more splits than blocks
    (3, 2, 1, 128, 8, 16, F32, 2, 16, 1),  # 128-key blocks (2 tiles) of 8-slot pages, GQA 2
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_matches_ref(case):
    n, hq, hkv, d, s, m, dtype, splits, ppb, stages = case
    rs = np.random.default_rng(n * 100 + d + s)
    q, kc, vc, pt, pos = _case(rs, n, hq, hkv, d, s, m, dtype)
    rows = jnp.asarray(rs.permutation(n), jnp.int32)  # token n reads row rows[n]
    args = (q, kc, vc, jnp.int32(1), pt, rows, pos)
    fn = functools.partial(paged_attention_mgpu, num_splits=splits, pages_per_block=ppb,
                           num_stages=stages, interpret=True)
    out, ref = jax.jit(fn)(*args), ref_paged_attention(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=ATOL[dtype], rtol=0)


def test_reads_the_given_plane():
    """Plane 0 and plane 1 hold different K/V: each call attends its own plane only."""
    rs = np.random.default_rng(7)
    q, kc, vc, pt, pos = _case(rs, 2, 2, 2, 64, 16, 4, F32)
    rows = jnp.arange(2, dtype=jnp.int32)
    fn = functools.partial(paged_attention_mgpu, interpret=True)
    outs = [fn(q, kc, vc, jnp.int32(p), pt, rows, pos) for p in (0, 1)]
    for p, out in enumerate(outs):
        np.testing.assert_allclose(out, ref_paged_attention(q, kc, vc, jnp.int32(p), pt, rows, pos),
                                   atol=ATOL[F32], rtol=0)
    assert not np.allclose(outs[0], outs[1])


def _write_case(case):
    """A CASES case plus the step's new K/V and its slots: each token writes key positions[n]
    of its row (a page's first or last key, the first key at all: nothing else to attend),
    except token 3 (the row's last key, where there is one), which has the drop slot and so
    attends the pool's entry there: its new V is 100x, so taking it moves out far past ATOL."""
    n, hq, hkv, d, s, m, dtype, splits, ppb, stages = case
    rs = np.random.default_rng(n * 100 + d + s)
    q, kc, vc, pt, pos = _case(rs, n, hq, hkv, d, s, m, dtype)
    rows = jnp.asarray(rs.permutation(n), jnp.int32)
    slots = pt[rows, pos // s] * s + pos % s
    drop = np.arange(n) == 3
    slots = jnp.where(drop, kc.shape[2] * s, slots).astype(jnp.int32)
    k_new, v_new = (jnp.asarray(rs.standard_normal((n, hkv, d)), dtype) for _ in range(2))
    v_new = jnp.where(drop[:, None, None], 100 * v_new, v_new)
    config = dict(num_splits=splits, pages_per_block=ppb, num_stages=stages)
    return (q, k_new, v_new, slots, kc, vc, jnp.int32(1), pt, rows, pos), config, drop


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_write_matches_write_kv_then_ref(case):
    """paged_attention_mgpu_write == write_kv then ref_paged_attention: the pools bitwise
    (nothing but the written slots changes; the drop slot writes nothing), out to tolerance."""
    args, config, drop = _write_case(case)
    q, k_new, v_new, slots, kc, vc, plane, pt, rows, pos = args
    fn = jax.jit(functools.partial(paged_attention_mgpu_write, interpret=True, **config))
    out, k_out, v_out = fn(*args)
    k_ref, v_ref = write_kv(kc, vc, plane, slots, k_new, v_new)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_ref))
    np.testing.assert_array_equal(np.asarray(v_out), np.asarray(v_ref))
    ref = ref_paged_attention(q, k_ref, v_ref, plane, pt, rows, pos)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=ATOL[case[6]], rtol=0)


MIN_BLOCKS_CASES = [  # a CASES case, fewest blocks per split
    ((5, 2, 2, 128, 16, 16, BF16, 4, None, 2), 2),  # rows of 1-4 blocks: 1-2 splits used of 4
    ((5, 2, 2, 128, 16, 16, F32, 3, None, 2), 5),  # every row in its first split
    ((4, 2, 1, 128, 8, 40, F32, 8, None, 3), 3),  # 8-slot pages, 5 blocks: splits of 3 and 2 blocks
]


@pytest.mark.parametrize("case, min_blocks", MIN_BLOCKS_CASES,
                         ids=[f"{'-'.join(map(str, c[:8]))}-m{b}" for c, b in MIN_BLOCKS_CASES])
def test_min_blocks_per_split_matches_ref(case, min_blocks):
    """Splits of at least min_blocks blocks (the last ones empty for short rows): the writing
    kernel (the new key's owner is the split holding the row's last block) and the reading
    one match write_kv then ref_paged_attention."""
    args, config, _ = _write_case(case)
    q, k_new, v_new, slots, kc, vc, plane, pt, rows, pos = args
    config = mgpu.settle_config(q, kc, vc, plane, pt, rows, pos, interpret=True,
                                min_blocks_per_split=min_blocks, **config)
    assert config["min_blocks_per_split"] == min_blocks and not config["normalize"]
    out, k_out, v_out = mgpu._write_call(*args, **config)
    k_ref, v_ref = write_kv(kc, vc, plane, slots, k_new, v_new)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_ref))
    ref = ref_paged_attention(q, k_ref, v_ref, plane, pt, rows, pos)
    read = mgpu._decode_call(q, k_ref, v_ref, plane, pt, rows, pos, **config)
    for got in (out, read):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                                   atol=ATOL[case[6]], rtol=0)


@pytest.mark.parametrize("case", [CASES[2], CASES[3]], ids=["lanes", "tiles"])
def test_one_split_normalizes_in_kernel_bitwise(case):
    """With one context split the kernel writes acc / sum in q's dtype: bitwise the partials
    (acc, max, sum) + combine_splits of the same kernel (per-key-lane and per-tile softmax)."""
    args, config, _ = _write_case(case)
    q, k_new, v_new, slots, kc, vc, plane, pt, rows, pos = args
    config = mgpu.settle_config(q, kc, vc, plane, pt, rows, pos, interpret=True, **config)
    assert config["num_splits"] == 1 and config["normalize"]
    partials = {**config, "normalize": False}
    fused = mgpu._write_call(*args, **config)[0]
    np.testing.assert_array_equal(np.asarray(fused), np.asarray(mgpu._write_call(*args, **partials)[0]))
    read = (q, kc, vc, plane, pt, rows, pos)
    np.testing.assert_array_equal(np.asarray(mgpu._decode_call(*read, **config)),
                                  np.asarray(mgpu._decode_call(*read, **partials)))


HEADS_CASES = [  # a CASES case, kv heads per program
    ((3, 4, 4, 64, 16, 5, BF16, 1, None, 3), 2),  # 2 blocks a head through 3 slots: prefetch crosses heads
    ((3, 4, 4, 64, 16, 5, F32, 1, None, 3), 4),  # one program per token
    ((5, 2, 2, 128, 16, 9, BF16, 2, None, 2), 2),  # split context (a split of no block: row at key 0)
    ((3, 8, 2, 64, 32, 6, BF16, 1, 2, 2), 2),  # GQA 4: reduced every tile
]


@pytest.mark.parametrize("case, heads", HEADS_CASES,
                         ids=[f"{'-'.join(map(str, c[:7]))}-h{h}" for c, h in HEADS_CASES])
def test_heads_per_program_bitwise_one_head(case, heads):
    """Several kv heads per program (the slots running on across heads) give bitwise what one
    head per program gives, for both entry points (the writing one: the pools too)."""
    args, config, _ = _write_case(case)
    q, k_new, v_new, slots, kc, vc, plane, pt, rows, pos = args
    results = []
    for h in (1, heads):
        write = jax.jit(functools.partial(paged_attention_mgpu_write, interpret=True,
                                          heads_per_program=h, **config))
        read = jax.jit(functools.partial(paged_attention_mgpu, interpret=True, heads_per_program=h,
                                         **config))
        results.append([*write(*args), read(q, kc, vc, plane, pt, rows, pos)])
    for one, many in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(many), np.asarray(one))
    np.testing.assert_allclose(np.asarray(results[1][3], np.float32),
                               np.asarray(ref_paged_attention(q, kc, vc, plane, pt, rows, pos), np.float32),
                               atol=ATOL[case[6]], rtol=0)


def test_default_heads_per_program_fits_one_wave():
    """One head per program while the programs fit one wave (2 per SM of 132); above it the
    fewest heads (a divisor) that fit, unless the busiest SM then holds more heads than with
    one head per program (Huginn's 55 heads: 11 per program at 32 rows, 160 programs, measured
    slower)."""
    from loopjax.kernels.paged_attention_mgpu_config import default_heads_per_program as heads

    assert [heads(n, 16, 1) for n in (1, 8, 16, 32, 64, 128)] == [1, 1, 1, 2, 4, 8]  # Ouro-1.4B
    assert [heads(n, 55, 1) for n in (8, 16, 32, 64, 128)] == [1] * 5  # Huginn-0125
    assert heads(1, 16, 4) == 1 and heads(32, 16, 2) == 4 and heads(20, 16, 1) == 1


PLANE_TABLE_CASES = [  # n, hq, hkv, d, page_size, max_pages, dtype, num_splits, pages_per_block
    (5, 2, 2, 64, 16, 9, F32, 2, 4),  # padded table (9 -> 12), 4 planes in a block, split context
    (3, 8, 2, 128, 8, 16, BF16, 1, 8),  # GQA 4, 2 blocks of 8-slot pages through one split
]


@pytest.mark.parametrize("case", PLANE_TABLE_CASES, ids=lambda c: "-".join(map(str, c[:7])))
def test_plane_table_matches_ref(case):
    """plane [R, M]: each page read from its own plane (3 planes of different K/V). Rows: random
    planes per page; one plane then another from a page boundary on (Ouro 'shared': full pages
    at the loop's plane, decode pages at theirs); and every page at plane 1, which equals the
    scalar plane 1 exactly and differs from the random table."""
    n, hq, hkv, d, s, m, dtype, splits, ppb = case
    rs = np.random.default_rng(n * 10 + d)
    q, kc, vc, pt, _ = _case(rs, n, hq, hkv, d, s, m, dtype, planes=3)
    table = rs.integers(0, 3, (n, m))
    table[1] = np.where(np.arange(m) < 2, 2, 0)  # row 1: pages 0, 1 at plane 2, then plane 0
    table[2] = 1
    table = jnp.asarray(table, jnp.int32)
    # Row 0 every page (past a block boundary), row 1 the first key at plane 0, row 2 a key
    # inside the last page, rows 3, 4 a page's first key and a random one.
    pos_of_row = np.array([m * s - 1, 2 * s, m * s - 1 - s // 2, s, rs.integers(0, m * s)])[:n]
    rows = rs.permutation(n)
    pos, rows = jnp.asarray(pos_of_row[rows], jnp.int32), jnp.asarray(rows, jnp.int32)
    fn = jax.jit(functools.partial(paged_attention_mgpu, num_splits=splits, pages_per_block=ppb,
                                   interpret=True))
    out = fn(q, kc, vc, table, pt, rows, pos)
    ref = ref_paged_attention(q, kc, vc, table, pt, rows, pos)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=ATOL[dtype], rtol=0)
    scalar = fn(q, kc, vc, jnp.int32(1), pt, rows, pos)
    on_plane_1 = np.asarray(rows) == 2  # tokens reading row 2 (every page at plane 1)
    np.testing.assert_array_equal(np.asarray(out)[on_plane_1], np.asarray(scalar)[on_plane_1])
    assert not np.allclose(np.asarray(out, np.float32)[~on_plane_1],
                           np.asarray(scalar, np.float32)[~on_plane_1])


def _bad(match, *args, fn=paged_attention_mgpu, **kwargs):
    with pytest.raises(ValueError, match=match) as err:
        fn(*args, interpret=True, **kwargs)
    assert "\n" not in str(err.value)


def test_bad_inputs_raise():
    rs = np.random.default_rng(0)
    q, kc, vc, pt, pos = _case(rs, 2, 2, 2, 64, 16, 4, BF16)
    rows, plane = jnp.arange(2, dtype=jnp.int32), jnp.int32(0)
    _bad("multiple of num kv heads", q[:, :1].repeat(3, 1), kc, vc, plane, pt, rows, pos)
    _bad("page_table must be int32", q, kc, vc, plane, pt.astype(F32), rows, pos)
    _bad("positions must be", q, kc, vc, plane, pt, rows, pos[:1])
    _bad("dtypes differ", q.astype(F32), kc, vc, plane, pt, rows, pos)
    _bad("int32 scalar or an int32 \\[2, 4\\] table", q, kc, vc, jnp.zeros((2, 3), jnp.int32), pt,
         rows, pos)
    _bad("int32 scalar or", q, kc, vc, jnp.zeros(pt.shape, F32), pt, rows, pos)
    _bad("at most 8 q heads", q.repeat(9, 1), kc, vc, plane, pt, rows, pos)
    _bad("multiple of 64", q, kc, vc, plane, pt, rows, pos, pages_per_block=2)
    _bad("page_size a multiple of 8", q, kc[:, :, :, :4], vc[:, :, :, :4], plane, pt, rows, pos)
    _bad("32-byte", q[..., :8], kc[..., :8], vc[..., :8], plane, pt, rows, pos)
    _bad("num_stages=0", q, kc, vc, plane, pt, rows, pos, num_stages=0)
    _bad("heads_per_program must divide the 2 kv heads", q, kc, vc, plane, pt, rows, pos,
         heads_per_program=3)
    _bad("shared memory", q, kc, vc, plane, pt, rows, pos, num_stages=8, pages_per_block=16)


_bad_write = functools.partial(_bad, fn=paged_attention_mgpu_write)


def test_write_bad_inputs_raise():
    rs = np.random.default_rng(0)
    q, kc, vc, pt, pos = _case(rs, 2, 2, 2, 64, 16, 4, BF16)
    rows, plane = jnp.arange(2, dtype=jnp.int32), jnp.int32(0)
    new, slots = q.reshape(2, 2, 64), pos
    _bad_write("slot_mapping must be int32", q, new, new, slots.astype(F32), kc, vc, plane, pt, rows, pos)
    _bad_write("k must be \\[2, 2, 64\\]", q, new[:, :1], new, slots, kc, vc, plane, pt, rows, pos)
    _bad_write("v dtype float32 != pool dtype bfloat16", q, new, new.astype(F32), slots, kc, vc, plane,
               pt, rows, pos)
    _bad_write("plane must be a scalar", q, new, new, slots, kc, vc, jnp.zeros(pt.shape, jnp.int32),
               pt, rows, pos)
    _bad_write("write_slots must be int32 \\[1\\]", q[:1], new, new, slots, kc, vc, plane, pt, rows[:1],
               pos[:1])
    _bad_write("at most 8 q heads", q.repeat(9, 1), new, new, slots, kc, vc, plane, pt, rows, pos)


# ------------------------------------------------------------------- CUDA lowering on CPU

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))
MODELS = {"ouro": (16, 16, 128), "huginn": (55, 55, 96), "gqa8": (32, 4, 128)}  # Hq, Hkv, D


def _lower_cuda(fn, rows, hq, hkv, d, context, dtype=BF16, page_size=16, plane_table=False):
    """StableHLO of fn (paged_attention_mgpu, or paged_attention_mgpu_write with its pools
    donated, as a step donates them) for CUDA at these shapes."""
    max_pages = context // page_size
    pool = jax.ShapeDtypeStruct((4, hkv, rows * max_pages + 8, page_size, d), dtype)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    plane = i32((rows, max_pages) if plane_table else ())
    q, new = jax.ShapeDtypeStruct((rows, hq, d), dtype), jax.ShapeDtypeStruct((rows, hkv, d), dtype)
    table = (i32((rows, max_pages)), i32((rows,)), i32((rows,)))
    writes = getattr(fn, "func", fn) is paged_attention_mgpu_write
    args = (q, new, new, i32((rows,)), pool, pool) if writes else (q, pool, pool)
    args = (*args, plane, *table)
    with use_abstract_mesh(H200):
        gpu_fn = functools.partial(fn, interpret=False)  # the default on a CPU host is interpret mode
        return jax.jit(gpu_fn, donate_argnums=(4, 5) if writes else ()).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rows, context", [(32, 1024), (1, 4096), (1, 32768)])
def test_lowers_for_cuda(model, rows, context):
    """Real decode shapes, default configs (32 rows: one split, normalized in the kernel; 1 row:
    the context split across programs; at 32,768 in splits of at least 2 blocks), both entry
    points: the writing one is the one kernel
    of its call (no scatter), its two pools aliased in and out."""
    text = _lower_cuda(paged_attention_mgpu, rows, *MODELS[model], context)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
    text = _lower_cuda(paged_attention_mgpu_write, rows, *MODELS[model], context)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 and "stablehlo.scatter" not in text
    [call] = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert call.count("output_operand_alias<") == 2, call


@pytest.mark.parametrize("rows, context", [(32, 1024), (3, 1008)])
def test_lowers_for_cuda_with_plane_table(rows, context):
    """Ouro-1.4B decode shapes reading a per-page plane table (1008: a padded table, 63 -> 64)."""
    text = _lower_cuda(paged_attention_mgpu, rows, *MODELS["ouro"], context, plane_table=True)
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


@pytest.mark.parametrize("config", [dict(pages_per_block=8, num_stages=2, num_splits=4),
                                    dict(pages_per_block=4, num_stages=6, num_splits=1)])
def test_configs_lower_for_cuda(config):
    fn = functools.partial(paged_attention_mgpu, **config)
    assert "@mosaic_gpu" in _lower_cuda(fn, 32, *MODELS["ouro"], 1024)
    assert "@mosaic_gpu" in _lower_cuda(fn, 8, 4, 4, 64, 2048, dtype=F32)


# ------------------------------------------------------------------- engine backend


def test_engine_backend_keeps_golden_greedy_tokens(monkeypatch):
    """attention_backend='pallas_mgpu' (every kernel in its CPU interpreter; the pointwise
    kernels, bitwise XLA's, are tested on in test_kernels.py's engine test) leaves the tiny
    Ouro's golden greedy tokens (those of backend 'xla') as they are, its decode steps writing
    K/V in the attention kernel (per_loop layout); with Ouro's 'shared' layout (decode steps
    reading a per-page plane table: write_kv, then the kernel) it gives the tokens of backend
    'xla'."""
    import loopjax
    from loopjax import attention_backend
    from loopjax.engine import Engine, EngineConfig
    from loopjax.sampling_params import SamplingParams

    # NOTE: 2 decode rows, no padding row: the interpreter runs a padding row's programs too.
    small = dict(page_size=8, max_num_rows=2, decode_row_buckets=(2,), max_prefill_tokens=32,
                 prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64, verbose=False)
    model, ref = loopjax.load("tests/data/ouro"), np.load("tests/data/ouro/reference_fp32.npz")
    assert attention_backend.attention_fn("pallas_mgpu", decode=True) is paged_attention_mgpu
    assert attention_backend.attention_fn("pallas_mgpu", decode=False) is prefill_attention  # Triton's
    prompts = {k: ref[f"{k}_input_ids"].tolist() for k in ("p0", "p1", "p2")}
    prompts["page"] = prompts["p2"][:8]  # its first decoded token opens a decode page
    # p0 and its first two greedy tokens (the reference's tokens are KV-cache independent):
    # 7 prompt tokens, so the second decode step writes position 8, the first of a new page
    golden = ref["p0_greedy_tokens"].tolist()
    prompts["p0+2"] = prompts["p0"] + golden[:2]
    fused_layers = []  # one entry per layer call traced through the writing kernel
    monkeypatch.setattr(mgpu, "paged_attention_mgpu_write",
                        lambda *a, **k: fused_layers.append(1) or paged_attention_mgpu_write(*a, **k))

    def greedy(backend, requests, max_tokens, **config):
        engine = Engine(model, EngineConfig(attention_backend=backend, **small, **config))
        for k in requests:
            engine.add_request(prompts[k], SamplingParams(temperature=0.0, ignore_eos=True,
                                                          max_tokens=max_tokens), k)
        finals = {}
        while engine.has_unfinished():
            finals.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        return finals

    # NOTE: no warm-up: it would run every executable once more in the interpreter (~20 s).
    # Each decode step takes 6-9 s in the interpreter: 3 tokens (2 decode steps) here.
    tokens = greedy("pallas_mgpu", ("p0+2", "p1"), 3, warmup=False)
    assert tokens == {"p0+2": golden[2:5], "p1": ref["p1_greedy_tokens"].tolist()[:3]}
    assert fused_layers, "the per_loop decode steps did not take the writing kernel"
    fused_layers.clear()
    # NOTE: 2 tokens (1 decode step): "page" (8 prompt tokens) writes its first decoded token
    # into a decode page, then reads it through the plane table.
    shared = [greedy(backend, ("p2", "page"), 2, kv_layout="shared", warmup=False)
              for backend in ("pallas_mgpu", "xla")]
    assert shared[0] == shared[1] and not fused_layers


def test_default_splits_one_from_a_program_per_sm():
    """One context split from ONE_SPLIT_PROGRAMS (token, kv head) programs (measured faster in
    the step, and no combine kernel); fewer programs split the context until about
    FEW_PROGRAMS_TARGET programs run (the shared heuristic's ~2 per SM was slower at 1 row),
    never past the context's blocks."""
    from loopjax.kernels import paged_attention_mgpu_config as mgpu
    from loopjax.kernels.paged_attention import default_num_splits

    assert mgpu.mosaic_num_splits(8, 16, 32) == 1 and mgpu.mosaic_num_splits(3, 55, 32) == 1
    assert default_num_splits(1, 16, 32) == 17 and mgpu.mosaic_num_splits(1, 16, 32) == 4
    assert mgpu.mosaic_num_splits(1, 16, 2) == 2  # a 2-block context: at most 2 splits
    assert mgpu.mosaic_num_splits(1, 55, 32) == 2


def test_wide_page_tables_and_64_programs_split_into_a_program_per_sm():
    """From FEW_PROGRAMS_TARGET programs (Ouro-1.4B's 4-row bucket), and above
    LONG_CONTEXT_BLOCKS blocks of page table (long contexts) at any count below
    ONE_SPLIT_PROGRAMS, the context is split until ~ONE_SPLIT_PROGRAMS programs run, in splits
    of at least LONG_CONTEXT_MIN_BLOCKS blocks (a short row then fills only its first splits);
    elsewhere the rules above hold with splits of any size. settle_config applies both."""
    from loopjax.kernels import paged_attention_mgpu_config as mgpu
    from loopjax.step_plan import LONG_CONTEXT_KEYS

    assert mgpu.LONG_CONTEXT_BLOCKS * mgpu.ROWS == LONG_CONTEXT_KEYS  # where the 4-row bucket starts
    wide, min_blocks = mgpu.LONG_CONTEXT_BLOCKS + 1, mgpu.default_min_blocks_per_split
    assert mgpu.mosaic_num_splits(1, 16, wide) == 8 and mgpu.mosaic_num_splits(1, 16, 64) == 4
    assert mgpu.mosaic_num_splits(4, 16, 512) == mgpu.mosaic_num_splits(4, 16, 32) == 2
    assert mgpu.mosaic_num_splits(7, 16, 32) == 1 and mgpu.mosaic_num_splits(8, 16, 512) == 1
    assert mgpu.mosaic_num_splits(1, 55, 512) == 2 and mgpu.mosaic_num_splits(2, 55, 32) == 1  # <= 128
    assert min_blocks(1, 16, wide) == min_blocks(4, 16, 32) == mgpu.LONG_CONTEXT_MIN_BLOCKS == 2
    assert min_blocks(1, 16, 64) == min_blocks(8, 16, wide) == min_blocks(1, 55, 64) == 1
    rs = np.random.default_rng(5)
    q, kc, vc, pt, pos = _case(rs, 1, 16, 16, 128, 16, 4 * wide, BF16, planes=1)
    config = mgpu.settle_config(q, kc, vc, jnp.int32(0), pt, jnp.zeros(1, jnp.int32), pos,
                                pages_per_block=None, num_splits=None, num_stages=None, interpret=True)
    assert (config["num_splits"], config["min_blocks_per_split"]) == (8, 2)


def test_write_check_probe_smoke(capsys):
    """bench/probes/attn_write_check.py --smoke: the writing kernel against write_kv then the
    ref and against the two-kernel path, in the interpreter (2 rows; 1 row with split context)."""
    from loopjax.bench.probes import attn_write_check

    assert attn_write_check.main(["--smoke"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "rows" in line]
    assert len(lines) == 2 and all("pools bitwise True" in line and line.endswith("ok") for line in lines)
