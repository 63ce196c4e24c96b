"""Kernels vs their ref_ twins (Pallas interpret mode on CPU), bad inputs, and CUDA lowering.

Attention: fp32-accumulation tolerance against the twin (and the twin against the dense
layers.causal_attention). Pointwise kernels: exact equality. Every GPU kernel is also
lowered for CUDA against an abstract H200, so a Triton lowering error fails CI here.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from loopjax import kernels as K
from loopjax import layers
from loopjax.kernels.prefill_attention import heaviest_first, query_blocks

KV_WRITE = importlib.import_module("loopjax.kernels.kv_write")

F32, BF16 = jnp.float32, jnp.bfloat16
ATOL = {F32: 2e-5, BF16: 3e-2}


def _rand(rs, shape, dtype, scale=1.0):
    return jnp.asarray(rs.standard_normal(shape) * scale, dtype)


def _pool(rs, planes, hkv, pages, page_size, d, dtype):
    shape = (planes, hkv, pages, page_size, d)
    return _rand(rs, shape, dtype), _rand(rs, shape, dtype)


def _page_table(rs, rows, max_pages, extra=3):
    """Distinct random pages per row; the pool has rows * max_pages + extra pages."""
    num_pages = rows * max_pages + extra
    return jnp.asarray(rs.permutation(num_pages)[: rows * max_pages].reshape(rows, max_pages), jnp.int32)


def _close(a, b, dtype):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=ATOL[dtype], rtol=0)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))


# ------------------------------------------------------------------ ref twin and write_kv


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("decode", [False, True])
def test_ref_paged_matches_dense_causal(dtype, decode):
    rs = np.random.default_rng(0)
    lens, hq, hkv, d, s = [5, 9, 1], 4, 2, 16, 4
    pt = _page_table(rs, 3, 3)
    kc = jnp.zeros((2, hkv, 12, s, d), dtype)
    vc = jnp.zeros_like(kc)
    qs, ks, vs = ([_rand(rs, (n, h, d), dtype) for n in lens] for h in (hq, hkv, hkv))
    rows = np.repeat(np.arange(3), lens).astype(np.int32)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    slots = np.asarray(pt)[rows, pos // s] * s + pos % s
    kc, vc = K.write_kv(
        kc, vc, jnp.int32(1), jnp.asarray(slots, jnp.int32), jnp.concatenate(ks), jnp.concatenate(vs)
    )
    last = np.cumsum(lens) - 1
    take = last if decode else np.arange(sum(lens))
    out = K.ref_paged_attention(
        jnp.concatenate(qs)[take], kc, vc, jnp.int32(1), pt, jnp.asarray(rows[take]), jnp.asarray(pos[take])
    )
    dense = []
    for q, k, v, n in zip(qs, ks, vs, lens, strict=True):
        dense.append(layers.causal_attention(q, k, v, jnp.tril(jnp.ones((n, n), bool))))
    _close(out, jnp.concatenate(dense)[take], dtype)


def test_write_kv_slots_planes_and_padding():
    rs = np.random.default_rng(1)
    kc, vc = _pool(rs, 3, 2, 4, 4, 8, F32)
    k, v = _rand(rs, (3, 2, 8), F32), _rand(rs, (3, 2, 8), F32)
    slots = jnp.asarray([5, 15, 4 * 4], jnp.int32)  # page 1 offset 1, page 3 offset 3, padding
    k2, v2 = jax.jit(K.write_kv, donate_argnums=(0, 1))(
        jnp.array(kc), jnp.array(vc), jnp.int32(2), slots, k, v
    )
    exp_k = np.array(kc)
    exp_k[2, :, 1, 1], exp_k[2, :, 3, 3] = k[0], k[1]
    _same(k2, jnp.asarray(exp_k))
    assert (np.asarray(v2[2, :, 1, 1]) == np.asarray(v[0])).all()
    _same(v2[:2], vc[:2])


@pytest.mark.parametrize("planes, hkv, pages, page_size, d, n, dtype", [
    (3, 2, 5, 4, 8, 7, F32),  # fewer tokens than a program's block
    (2, 3, 12, 4, 96, 40, BF16),  # Huginn's head_dim, two token blocks
])
def test_write_kv_kernel_is_write_kv(planes, hkv, pages, page_size, d, n, dtype):
    """The Pallas write kernel stores exactly what XLA's scatter stores: real slots written in
    the given plane, the drop slot (and every other entry) untouched."""
    rs = np.random.default_rng(2)
    kc, vc = _pool(rs, planes, hkv, pages, page_size, d, dtype)
    k, v = _rand(rs, (n, hkv, d), dtype), _rand(rs, (n, hkv, d), dtype)
    drop = pages * page_size
    slots = np.asarray(rs.permutation(drop)[:n], np.int32)
    slots[::3] = drop  # padding tokens
    args = (jnp.int32(planes - 1), jnp.asarray(slots), k, v)
    got = jax.jit(KV_WRITE.write_kv_kernel, donate_argnums=(0, 1))(jnp.array(kc), jnp.array(vc), *args)
    want = K.write_kv(kc, vc, *args)
    for g, w, before in zip(got, want, (kc, vc), strict=True):
        _same(g, w)
        assert (np.asarray(g) != np.asarray(before)).any()


@pytest.mark.parametrize("n, hq, hkv, d, dtype, cache_dtype, bias, block_tokens", [
    (7, 2, 1, 16, F32, F32, False, 4),  # GQA, fewer tokens than a block
    (40, 4, 2, 128, BF16, BF16, False, None),  # Ouro's head_dim, two token blocks
    (40, 3, 3, 96, BF16, BF16, True, None),  # Huginn's head_dim (masked to 128) and bias
    (9, 2, 2, 16, BF16, F32, False, 4),  # a wider pool: rounded to qkv's dtype first
    (9, 2, 2, 32, F32, F32, True, 8),
])
def test_rope_write_kv_is_rope_then_write_kv(n, hq, hkv, d, dtype, cache_dtype, bias, block_tokens):
    """The RoPE + K/V write kernel returns the model's rotated q and stores its rotated k and v
    exactly where write_kv stores them (padding tokens dropped, the rest of the pool kept)."""
    rs = np.random.default_rng(n + d)
    qkv = _rand(rs, (n, (hq + 2 * hkv) * d), dtype)
    cos, sin = layers.rope_angles(jnp.arange(n) * 37 + 5, d, 10000.0)
    pages = n // 2 + 3
    kc, vc = _pool(rs, 3, hkv, pages, 4, d, cache_dtype)
    slots = np.asarray(rs.permutation(pages * 4)[:n], np.int32)
    slots[::3] = pages * 4  # padding tokens
    heads = dict(num_heads=hq, num_kv_heads=hkv, qk_bias=_rand(rs, (2, hq, d), dtype) if bias else None)
    args = (qkv, cos, sin, kc, vc, jnp.int32(1), jnp.asarray(slots))
    kern = functools.partial(K.rope_write_kv, block_tokens=block_tokens or 32, interpret=True, **heads)
    got = jax.jit(kern, donate_argnums=(3, 4))(*args[:3], jnp.array(kc), jnp.array(vc), *args[5:])
    want = _jit_twin(functools.partial(K.ref_rope_write_kv, **heads))(*args)
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    for g, before in zip(got[1:], (kc, vc), strict=True):
        assert (np.asarray(g) != np.asarray(before)).any()


# ------------------------------------------------------------------ paged decode kernel

DECODE_CASES = [  # n, hq, hkv, d, page_size, max_pages, dtype, num_splits, pages_per_block
    (1, 2, 2, 16, 4, 1, F32, None, None),  # one row, one page
    (5, 4, 2, 16, 4, 3, F32, 2, 1),  # GQA 2, split context
    (4, 4, 1, 128, 8, 2, BF16, 1, 2),  # GQA 4, head_dim 128
    (3, 3, 3, 96, 4, 4, BF16, 3, 2),  # head_dim 96 (64 + 32 chunks), more splits than blocks
    (2, 2, 2, 96, 16, 2, F32, None, None),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: "-".join(map(str, c[:6])))
def test_paged_decode_matches_ref(case):
    n, hq, hkv, d, s, m, dtype, splits, ppb = case
    rs = np.random.default_rng(n * 100 + d)
    pt = _page_table(rs, n, m)
    kc, vc = _pool(rs, 2, hkv, n * m + 3, s, d, dtype)
    # one token, page boundaries, full pages, a random position
    pos = np.array([0, s - 1, s, m * s - 1, rs.integers(0, m * s)])[np.arange(n) % 5]
    pos = jnp.asarray(np.minimum(pos, m * s - 1), jnp.int32)
    q = _rand(rs, (n, hq, d), dtype)
    args = (q, kc, vc, jnp.int32(1), pt, jnp.arange(n, dtype=jnp.int32), pos)
    fn = functools.partial(K.paged_attention, num_splits=splits, pages_per_block=ppb, interpret=True)
    _close(jax.jit(fn)(*args), K.ref_paged_attention(*args), dtype)


def test_prefill_kernel_reachable_from_paged_attention_module():
    pa = importlib.import_module("loopjax.kernels.paged_attention")  # the engine looks there

    assert pa.prefill_attention is K.prefill_attention


def test_paged_decode_in_fori_loop_with_donated_pool():
    """Each step writes one token per row, then attends: the pool is a donated loop carry."""
    rs = np.random.default_rng(7)
    n, hq, hkv, d, s, m, steps = 2, 4, 2, 16, 4, 2, 5
    pt = _page_table(rs, n, m)
    kc, vc = _pool(rs, 2, hkv, n * m + 3, s, d, F32)
    ks, vs, qs = (
        _rand(rs, (steps, n, hkv, d), F32),
        _rand(rs, (steps, n, hkv, d), F32),
        _rand(rs, (steps, n, hq, d), F32),
    )
    rows = jnp.arange(n, dtype=jnp.int32)

    def run(attn, kc, vc):
        def body(i, carry):
            kc, vc, outs = carry
            pos = jnp.full((n,), i + 1, jnp.int32)  # context 0..i+1 (position 0 pre-filled)
            slots = pt[rows, pos // s] * s + pos % s
            kc, vc = K.write_kv(kc, vc, jnp.int32(1), slots, ks[i], vs[i])
            outs = outs.at[i].set(attn(qs[i], kc, vc, jnp.int32(1), pt, rows, pos))
            return kc, vc, outs

        return jax.lax.fori_loop(0, steps, body, (kc, vc, jnp.zeros((steps, n, hq, d), F32)))

    kern = functools.partial(K.paged_attention, num_splits=2, interpret=True)
    ref_kc, ref_vc, ref_out = jax.jit(functools.partial(run, K.ref_paged_attention))(kc, vc)
    kc2, vc2, out = jax.jit(functools.partial(run, kern), donate_argnums=(0, 1))(jnp.array(kc), jnp.array(vc))
    _same(kc2, ref_kc)
    _same(vc2, ref_vc)
    _close(out, ref_out, F32)


# ------------------------------------------------------------------ prefill kernel

PREFILL_CASES = [  # lens, cached prefix per row, hq, hkv, d, page_size, dtype, block_q, block_k
    ([5, 17, 1], [0, 3, 30], 4, 2, 16, 4, F32, 16, 16),  # odd lengths, one token, chunked rows
    ([33], [0], 2, 2, 96, 8, BF16, 16, 32),  # one prompt across query blocks, head_dim 96
    ([3, 20], [10, 0], 4, 1, 128, 16, F32, 16, 16),  # GQA 4, head_dim 128, a full page
]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=lambda c: f"{c[0]}-{c[4]}-{c[6].__name__}")
def test_prefill_matches_ref(case):
    lens, starts, hq, hkv, d, s, dtype, bq, bk = case
    rs = np.random.default_rng(sum(lens))
    r, m = len(lens), max(a + b for a, b in zip(starts, lens, strict=True)) // s + 1
    pt = _page_table(rs, r, m)
    kc, vc = _pool(rs, 2, hkv, r * m + 3, s, d, dtype)
    rows = jnp.asarray(np.repeat(np.arange(r), lens), jnp.int32)
    pos = jnp.asarray(
        np.concatenate([np.arange(a, a + b) for a, b in zip(starts, lens, strict=True)]), jnp.int32
    )
    q = _rand(rs, (sum(lens), hq, d), dtype)
    args = (q, kc, vc, jnp.int32(1), pt, rows, pos)
    fn = functools.partial(K.prefill_attention, block_q=bq, block_k=bk, interpret=True)
    _close(jax.jit(fn)(*args), K.ref_prefill_attention(*args), dtype)


def test_query_blocks_cut_runs_and_block_size():
    starts, ends = query_blocks(jnp.asarray([0, 0, 0, 1, 1, 2, 2, 2, 2, 2], jnp.int32), 3, 2)
    assert starts.tolist() == [0, 2, 3, 5, 7, 9, 10, 10, 10]
    assert ends.tolist() == [2, 3, 5, 7, 9, 10, 10, 10, 10]
    positions = jnp.asarray([0, 1, 2, 0, 1, 4, 5, 6, 7, 8], jnp.int32)  # row 2 a chunk after 4 cached
    starts, ends = heaviest_first(starts, ends, positions)
    # work (last position + 1): 2, 3, 2, 6, 8, 9, then the unused blocks; ties keep their order
    assert starts.tolist() == [9, 7, 5, 2, 0, 3, 10, 10, 10]
    assert ends.tolist() == [10, 9, 7, 3, 2, 5, 10, 10, 10]


# ------------------------------------------------------------------ pointwise: bitwise
# The twins compile as the models' steps do (layers.IDENTITY_COMPILER_OPTIONS: no excess
# precision), the XLA path the kernels must equal bit for bit.
_jit_twin = functools.partial(jax.jit, compiler_options=layers.IDENTITY_COMPILER_OPTIONS)


@pytest.mark.parametrize(
    "n,h,dtype", [(1, 16, F32), (5, 96, BF16), (7, 200, F32), (3, 2048, BF16), (9, 5280, BF16)]
)
def test_rms_norm_bitwise(n, h, dtype):
    rs = np.random.default_rng(h)
    x, res, w = _rand(rs, (n, h), dtype, 3.0), _rand(rs, (n, h), dtype), _rand(rs, (h,), dtype)
    for name, args in (("rms_norm", (x, w)), ("add_rms_norm", (x, res, w)), ("rms_norm_add", (x, res, w))):
        kern = jax.jit(functools.partial(getattr(K, name), eps=1e-6, interpret=True))
        ref = _jit_twin(functools.partial(getattr(K, "ref_" + name), eps=1e-6))
        _same(kern(*args), ref(*args))


@pytest.mark.parametrize("n,h,dtype,num_partials,order", [
    (1, 2048, BF16, 8, "norm_add_norm"), (5, 96, BF16, 0, "norm_add_norm"),
    (3, 200, F32, 3, "norm_add_norm"), (9, 5280, BF16, 1, "norm_add_norm"), (4, 64, F32, 0, "norm_add_norm"),
    (8, 5280, BF16, 3, "add_norm_norm"), (5, 96, BF16, 0, "add_norm_norm"),
    (3, 200, F32, 2, "add_norm_norm")])
def test_norm_add_norm_bitwise(n, h, dtype, num_partials, order):
    """Both outputs of the fused norms equal the model's ops, on a product's output or on its
    split-K partials (summed in order, rounded once): Ouro's residual + norm(y) and Huginn's
    norm(y + residual)."""
    rs = np.random.default_rng(n * h)
    y = (_rand(rs, (num_partials, n, h), F32, 2.0) if num_partials else _rand(rs, (n, h), dtype, 3.0))
    res, w, w_next = _rand(rs, (n, h), dtype), _rand(rs, (h,), dtype), _rand(rs, (h,), dtype)
    got = jax.jit(functools.partial(getattr(K, order), eps=1e-6, interpret=True))(y, res, w, w_next)
    want = _jit_twin(functools.partial(getattr(K, "ref_" + order), eps=1e-6))(y, res, w, w_next)
    closing = layers.rms_norm_add if order == "norm_add_norm" else layers.add_rms_norm

    def model_math(y_sum, res, w, w_next):
        h_sum = closing(y_sum, res, w, 1e-6)
        return h_sum, layers.rms_norm(h_sum, w_next, 1e-6)

    y_sum = y if y.ndim == 2 else functools.reduce(jnp.add, y).astype(dtype)
    for a, b, c in zip(got, want, _jit_twin(model_math)(y_sum, res, w, w_next), strict=True):
        _same(a, b)
        _same(b, c)  # the twin is the model's math
    assert not np.array_equal(np.asarray(got[0]), np.asarray(got[1]))


@pytest.mark.parametrize(
    "n,f,dtype,blocks",
    [(1, 16, F32, {}), (5, 96, BF16, {}), (9, 100, BF16, dict(block_rows=4, block_cols=32))],
)
def test_silu_mul_bitwise(n, f, dtype, blocks):
    gate_up = _rand(np.random.default_rng(f), (n, 2 * f), dtype, 4.0)
    for name in ("silu_mul", "silu_f32_mul"):
        kern = jax.jit(functools.partial(getattr(K, name), interpret=True, **blocks))
        _same(kern(gate_up), _jit_twin(getattr(K, "ref_" + name))(gate_up))


def test_silu_gpu_spelling_matches_jitted_twins():
    """The GPU body's f32 spelling (plain jit on CPU) equals both twins under jit."""
    silu_mod = importlib.import_module("loopjax.kernels.silu_mul")
    rs = np.random.default_rng(3)
    g, u = _rand(rs, (16, 64), BF16, 4.0), _rand(rs, (16, 64), BF16)

    @jax.jit
    def spelled(g, u):
        act = silu_mod._silu(g, F32, True).astype(g.dtype)
        return (act.astype(F32) * u.astype(F32)).astype(g.dtype)

    gate_up = jnp.concatenate([g, u], axis=1)
    _same(spelled(g, u), jax.jit(K.ref_silu_mul)(gate_up))
    _same(spelled(g, u), jax.jit(K.ref_silu_f32_mul)(gate_up))


@pytest.mark.parametrize(
    "n,hq,hkv,d,dtype,block_rows",
    [(1, 2, 1, 16, F32, None), (5, 4, 2, 96, BF16, None), (7, 2, 2, 128, F32, 4), (3, 3, 3, 96, BF16, 2)],
)
def test_rope_bitwise(n, hq, hkv, d, dtype, block_rows):
    rs = np.random.default_rng(d + n)
    qkv = _rand(rs, (n, (hq + 2 * hkv) * d), dtype)
    cos, sin = layers.rope_angles(jnp.arange(n) * 37 + 5, d, 10000.0)
    heads = dict(num_heads=hq, num_kv_heads=hkv)
    kern = jax.jit(functools.partial(K.rope_rotate_half_qk, block_rows=block_rows, interpret=True, **heads))
    for a, b in zip(
        kern(qkv, cos, sin), _jit_twin(functools.partial(K.ref_rope_rotate_half_qk, **heads))(qkv, cos, sin)
    ):
        _same(a, b)
    if hq == hkv:
        bias = _rand(rs, (2, hq, d), dtype)
        kern = jax.jit(functools.partial(K.rope_interleaved_qk, block_rows=block_rows, interpret=True))
        for a, b in zip(kern(qkv, bias, cos, sin), _jit_twin(K.ref_rope_interleaved_qk)(qkv, bias, cos, sin)):
            _same(a, b)


# ------------------------------------------------------------------ bad inputs


def _attn_args(n=2, hq=4, hkv=2, d=16, dtype=F32, pt_dtype=jnp.int32, pos_n=None):
    z = jnp.zeros
    return (
        z((n, hq, d), dtype),
        z((1, hkv, 4, 4, d), dtype),
        z((1, hkv, 4, 4, d), dtype),
        jnp.int32(0),
        z((n, 2), pt_dtype),
        z((n,), jnp.int32),
        z((pos_n or n,), jnp.int32),
    )


@pytest.mark.parametrize("fn", [K.ref_paged_attention, K.paged_attention, K.prefill_attention])
@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(hq=3), "multiple"), (dict(pt_dtype=jnp.float32), "page_table"), (dict(pos_n=3), "positions")],
)
def test_attention_bad_inputs(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(*_attn_args(**kwargs))


def test_bad_inputs_raise():
    z = jnp.zeros
    q, kc, vc, plane, pt, rows, pos = _attn_args()
    with pytest.raises(ValueError, match="head_dim"):
        K.paged_attention(z((2, 4, 8)), kc, vc, plane, pt, rows, pos)
    with pytest.raises(ValueError, match="dtypes differ"):
        K.ref_paged_attention(q.astype(BF16), kc, vc, plane, pt, rows, pos)
    with pytest.raises(ValueError, match="power-of-two"):
        K.paged_attention(z((2, 6, 16)), z((1, 2, 4, 4, 16)), z((1, 2, 4, 4, 16)), plane, pt, rows, pos)
    with pytest.raises(ValueError, match="block_k"):
        K.prefill_attention(q, kc, vc, plane, pt, rows, pos, block_k=24)
    with pytest.raises(ValueError, match="slot_mapping"):
        K.write_kv(kc, vc, plane, z((2,), F32), z((2, 2, 16)), z((2, 2, 16)))
    with pytest.raises(ValueError, match="k must be"):
        K.write_kv(kc, vc, plane, z((2,), jnp.int32), z((2, 3, 16)), z((2, 2, 16)))
    with pytest.raises(ValueError, match="weight"):
        K.rms_norm(z((2, 8)), z((9,)), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        K.ref_add_rms_norm(z((2, 8)), z((3, 8)), z((8,)), 1e-6)
    with pytest.raises(ValueError, match="split-K partials must be float32"):
        K.norm_add_norm(z((2, 3, 8), BF16), z((3, 8), BF16), z((8,), BF16), z((8,), BF16), 1e-6)
    with pytest.raises(ValueError, match="y must match residual"):
        K.ref_norm_add_norm(z((3, 9)), z((3, 8)), z((8,)), z((8,)), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        K.norm_add_norm(z((3, 8)), z((3, 8)), z((8,)), z((7,)), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        K.silu_mul(z((2, 7)))
    with pytest.raises(ValueError, match="qkv width"):
        K.rope_rotate_half_qk(z((2, 50)), z((2, 8)), z((2, 8)), num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="cos"):
        K.ref_rope_interleaved_qk(z((2, 96)), z((2, 2, 16)), z((2, 4)), z((2, 8)))
    cs = z((2, 8))
    with pytest.raises(ValueError, match="needs num_kv_heads == num_heads"):
        K.rope_write_kv(z((2, 64)), cs, cs, kc, vc, plane, z((2,), jnp.int32), num_heads=2, num_kv_heads=1,
                        qk_bias=z((2, 2, 16)))
    with pytest.raises(ValueError, match="k must be"):  # qkv's kv heads against the pool's
        K.ref_rope_write_kv(z((2, 80)), cs, cs, kc, vc, plane, z((2,), jnp.int32), num_heads=3,
                            num_kv_heads=1)


# ------------------------------------------------------------------ CUDA lowering (no GPU)

H200 = AbstractMesh(
    (1,),
    ("x",),
    (AxisType.Explicit,),
    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"),
)
S = jax.ShapeDtypeStruct
MODELS = {"ouro": (16, 16, 128, 2048, 5632), "huginn": (55, 55, 96, 5280, 17920)}  # Hq, Hkv, D, H, F


def _attn_shapes(n, hq, hkv, d, rows=8, dtype=BF16):
    pool = S((4, hkv, 512, 16, d), dtype)
    i32 = jnp.int32
    return (S((n, hq, d), dtype), pool, pool, S((), i32), S((rows, 64), i32), S((n,), i32), S((n,), i32))


def _rope_write_bias_last(*args, **kwargs):
    """rope_write_kv with qk_bias as the last positional argument (a traced input)."""
    return K.rope_write_kv(*args[:-1], qk_bias=args[-1], **kwargs)


def _lowering_cases():
    for model, (hq, hkv, d, h, f) in MODELS.items():
        yield f"decode-{model}", K.paged_attention, _attn_shapes(8, hq, hkv, d)
        yield (
            f"decode-1split-{model}",
            functools.partial(K.paged_attention, num_splits=1),
            _attn_shapes(64, hq, hkv, d),
        )
        yield f"prefill-{model}", K.prefill_attention, _attn_shapes(300, hq, hkv, d, rows=4)
        yield (
            f"rms_norm-{model}",
            functools.partial(K.add_rms_norm, eps=1e-6),
            (S((7, h), BF16),) * 2 + (S((h,), BF16),),
        )
        yield (
            f"norm_add_norm-{model}",
            functools.partial(K.norm_add_norm if model == "ouro" else K.add_norm_norm, eps=1e-6),
            (S((8, 7, h), F32), S((7, h), BF16), S((h,), BF16), S((h,), BF16)),
        )
        yield f"silu-{model}", K.silu_mul, (S((7, 2 * f), BF16),)
        yield f"silu_f32-{model}", K.silu_f32_mul, (S((7, 2 * f), BF16),)
        cs = S((7, d // 2), F32)
        if model == "ouro":
            rope = functools.partial(K.rope_rotate_half_qk, num_heads=hq, num_kv_heads=hkv)
            yield "rope-ouro", rope, (S((7, (hq + 2 * hkv) * d), BF16), cs, cs)
        else:
            yield (
                "rope-huginn",
                K.rope_interleaved_qk,
                (S((7, 3 * hq * d), BF16), S((2, hq, d), BF16), cs, cs),
            )
        pool, new, i32 = S((4, hkv, 512, 16, d), BF16), S((300, hkv, d), BF16), jnp.int32
        write_args = (pool, pool, S((), i32), S((300,), i32), new, new)
        yield f"kv_write-{model}", KV_WRITE.write_kv_kernel, write_args
        heads = dict(num_heads=hq, num_kv_heads=hkv)
        qkv, cs300 = S((300, (hq + 2 * hkv) * d), BF16), S((300, d // 2), F32)
        rope_args = (qkv, cs300, cs300, pool, pool, S((), i32), S((300,), i32))
        if model == "ouro":
            yield "rope_write_kv-ouro", functools.partial(K.rope_write_kv, **heads), rope_args
        else:
            bias_last = functools.partial(_rope_write_bias_last, **heads)
            yield "rope_write_kv-huginn", bias_last, (*rope_args, S((2, hq, d), BF16))
    yield "decode-gqa4-f32", K.paged_attention, _attn_shapes(4, 8, 2, 16, dtype=F32)


@pytest.mark.parametrize(
    "name,fn,shapes", list(_lowering_cases()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_lowers_for_cuda(name, fn, shapes):
    with jax.sharding.use_abstract_mesh(H200):
        gpu_fn = functools.partial(fn, interpret=False)  # the default on a CPU host is interpret mode
        text = jax.jit(gpu_fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text, name


# ------------------------------------------------------------------ engine with the kernels on

ENGINE_SMALL = dict(
    page_size=8, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
    prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64, verbose=False,
)  # fmt: skip


def _finish(engine):
    finals = {}
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return finals


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_engine_golden_greedy_tokens_with_the_kernels_on(family):
    """The paged decode and prefill kernels and the pointwise kernels (RMSNorm, RoPE, SiLU*up;
    interpret mode) leave the golden tokens as they are."""
    from safetensors.numpy import load_file

    import loopjax
    from loopjax.engine import Engine, EngineConfig
    from loopjax.sampling_params import SamplingParams

    greedy = functools.partial(SamplingParams, temperature=0.0, ignore_eos=True)
    if family == "ouro":
        model, ref = loopjax.load("tests/data/ouro"), np.load("tests/data/ouro/reference_fp32.npz")
        engine = Engine(model, EngineConfig(attention_backend="pallas", pointwise="pallas", **ENGINE_SMALL))
        for k in ("p0", "p1", "p2"):
            engine.add_request(ref[f"{k}_input_ids"].tolist(), greedy(max_tokens=24), k)
        finals = _finish(engine)
        for k in ("p0", "p1", "p2"):
            assert finals[k].token_ids == ref[f"{k}_greedy_tokens"].tolist(), k
    else:
        path = "tests/data/huginn/huginn_shape_242"
        gen = load_file(f"{path}/generate.safetensors")
        prompt = load_file(f"{path}/inputs.safetensors")["prompt_ids"][0].tolist()
        engine = Engine(loopjax.load(path), EngineConfig(attention_backend="pallas", pointwise="pallas",
                                                         **ENGINE_SMALL))
        rid = engine.add_request(prompt, greedy(max_tokens=8), initial_state=gen["gen_init_states"][0])
        assert _finish(engine)[rid].token_ids == gen["gen_tokens"][0].tolist()


@pytest.mark.parametrize("rows, tokens", [(3, 3), (2, 24)])  # per-token and per-row gathers
def test_ref_paged_attention_per_page_plane_table(rows, tokens):
    """A plane table [R, M] reads each page entry at its own plane: equal to reading a pool in
    which every entry's plane was copied into one plane. The Pallas kernels refuse a table."""
    from loopjax.kernels.paged_attention import paged_attention, ref_paged_attention
    from loopjax.kernels.prefill_attention import prefill_attention
    rs = np.random.default_rng(3)
    k_cache, v_cache = (jnp.asarray(rs.normal(size=(4, 2, 6, 4, 16)), jnp.float32) for _ in range(2))
    page_table = jnp.asarray([[0, 2, 4], [1, 3, 5], [5, 0, 1]][:rows], jnp.int32)
    table = jnp.asarray(rs.integers(0, 4, size=(rows, 3)), jnp.int32)
    row_of_token = jnp.asarray(np.arange(tokens) % rows, jnp.int32)
    positions = jnp.asarray(rs.integers(0, 12, size=tokens), jnp.int32)
    q = jnp.asarray(rs.normal(size=(tokens, 4, 16)), jnp.float32)
    out = ref_paged_attention(q, k_cache, v_cache, table, page_table, row_of_token, positions)
    # The same reads from one plane of a pool holding, per row, its entries' planes.
    for r in range(rows):
        kr, vr = np.array(k_cache[:1]), np.array(v_cache[:1])
        for j in range(3):
            kr[0, :, int(page_table[r, j])] = k_cache[int(table[r, j]), :, int(page_table[r, j])]
            vr[0, :, int(page_table[r, j])] = v_cache[int(table[r, j]), :, int(page_table[r, j])]
        mine = np.asarray(row_of_token) == r
        want = ref_paged_attention(q[mine], jnp.asarray(kr), jnp.asarray(vr), jnp.int32(0),
                                   page_table, row_of_token[mine], positions[mine])
        np.testing.assert_allclose(np.asarray(out[mine]), np.asarray(want), atol=1e-5)
    for kernel in (paged_attention, prefill_attention):
        with pytest.raises(ValueError, match="per-page plane"):
            kernel(q, k_cache, v_cache, table, page_table, row_of_token, positions, interpret=True)
    with pytest.raises(ValueError, match="plane must be"):
        ref_paged_attention(q, k_cache, v_cache, table[:, :2], page_table, row_of_token, positions)
