"""Weight-streaming matmul: interpret-mode kernel vs its XLA twin on tiny shapes (row and
column masks, K tails, empty K splits), the fused epilogues and RMSNorm prologue, bad
inputs, the block-size table, and the kernel lowered for CUDA on this CPU host (so Triton
lowering errors fail CI)."""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import use_abstract_mesh

from loopjax import layers
from loopjax import matmul_ops as mo
from loopjax.kernels import streaming_matmul as sm
from loopjax.kernels import streaming_matmul_mgpu as smg
from loopjax.kernels import streaming_matmul_norms as smn

BF16, F32 = jnp.bfloat16, jnp.float32
REAL_SHAPES = [  # (K, N) of every decode product of Ouro-1.4B and Huginn-0125
    (2048, 6144), (2048, 2048), (2048, 11264), (5632, 2048),
    (5280, 15840), (5280, 5280), (5280, 35840), (17920, 5280),
    (2048, 49152), (5280, 65536),
]


def _inputs(m, k, n, dtype, seed=0):
    kx, kw, kr = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (m, k), F32).astype(dtype)
    w = (jax.random.normal(kw, (k, n), F32) / np.sqrt(k)).astype(dtype)
    r = jax.random.normal(kr, (m, n), F32).astype(dtype)
    return x, w, r


def _exact(x, w):
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64)


def _assert_close(out, ref, dtype, ulps=1, floor=0.0):
    """fp32: accumulation-order noise only; bf16: `ulps` rounding steps apart (both
    accumulate in fp32 and round once, but a different summation order can flip the last
    bit; an epilogue rounds again), plus `floor` for values that cancel to ~0."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    if dtype == F32:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), 1e-30))) - 7)  # bf16 spacing
        assert np.all(np.abs(a - b) <= ulps * ulp + floor + 1e-6), np.max(np.abs(a - b) / ulp)


# (M, K, N, block_n, block_k, split_k): row masks (M < 16), K tails (K % block_k), odd N,
# uneven and empty K splits (K=96, block_k=16, split 4: 2+2+2+0 tiles).
CASES = [
    (1, 64, 48, 16, 16, 1, F32),
    (3, 80, 37, 16, 32, 2, BF16),
    (16, 96, 64, 32, 16, 4, F32),
    (5, 40, 20, 16, 16, 2, BF16),
    (2, 24, 16, 16, 32, 1, BF16),  # K < block_k: one masked tile
]


@pytest.mark.parametrize("m, k, n, block_n, block_k, split_k, dtype", CASES)
def test_matches_ref(m, k, n, block_n, block_k, split_k, dtype):
    x, w, _ = _inputs(m, k, n, dtype)
    # NOTE: interpret=None (default): the interpreter on this CPU host
    out = sm.streaming_matmul(x, w, block_n=block_n, block_k=block_k, split_k=split_k)
    ref = sm.ref_streaming_matmul(x, w)
    _assert_close(out, ref, dtype)
    # and both are the exact product up to fp32 accumulation and one final rounding
    exact = _exact(x, w)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    eps = 2.0**-23 * k + (2.0**-8 if dtype == BF16 else 0)
    assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= eps * scale + 1e-6)


@pytest.mark.parametrize("split_k", [1, 2])
def test_epilogues(split_k):
    """split 1: the epilogue runs in the kernel; split 2: in XLA after the partial sum."""
    m, k, n = 3, 48, 40
    x, w, r = _inputs(m, k, n, BF16, seed=split_k)
    kw = dict(block_n=16, block_k=16, split_k=split_k, interpret=True)
    floor = 2.0**-8  # one bf16 step of the O(1) product, carried through the epilogue
    out = sm.streaming_matmul_add(x, w, r, **kw)
    _assert_close(out, sm.ref_streaming_matmul_add(x, w, r), BF16, ulps=1, floor=floor)
    out = sm.streaming_matmul_silu_mul(x, w, **kw)
    assert out.shape == (m, n // 2)
    _assert_close(out, sm.ref_streaming_matmul_silu_mul(x, w), BF16, ulps=2, floor=floor)


@pytest.mark.parametrize("split_k", [1, 3])
def test_accumulate_continues_the_fp32_sum(split_k):
    """streaming_matmul_accumulate = layers.linear_accumulate: the product's fp32 sums (every
    split's, also with one split) plus acc, rounded once; and it is the product over [x | x2]
    of [w; w2] with x2 @ w2 as acc (Huginn's adapter in two halves), to a product's rounding."""
    m, k, n = 3, 96, 40
    x, w, _ = _inputs(m, k, n, BF16, seed=split_k)
    x2, w2, _ = _inputs(m, k, n, BF16, seed=split_k + 10)
    acc = jnp.dot(x2, w2, preferred_element_type=F32)
    got = sm.streaming_matmul_accumulate(x, w, acc, block_n=16, block_k=16, split_k=split_k, interpret=True)
    assert got.dtype == BF16 and got.shape == (m, n)
    _assert_close(got, sm.ref_streaming_matmul_accumulate(x, w, acc), BF16, ulps=1, floor=2.0**-8)
    whole = layers.linear(jnp.concatenate([x, x2], axis=1), jnp.concatenate([w, w2], axis=0))
    _assert_close(got, whole, BF16, ulps=1, floor=2.0**-8)
    with pytest.raises(ValueError, match="acc must be float32"):
        sm.streaming_matmul_accumulate(x, w, acc.astype(BF16), interpret=True)


@pytest.mark.parametrize("split_k,order", [(1, "norm_add_norm"), (3, "norm_add_norm"), (3, "add_norm_norm")])
def test_norm_add_norm_epilogue(split_k, order):
    """The product's output (split 1) or its fp32 partials (split 3) go to the norm_add_norm
    (Ouro) or add_norm_norm (Huginn) kernel: (h, rms_norm(h)) of layers.linear_norm_add_norm /
    linear_add_norm_norm within a product's rounding, and no XLA reduction of the partials runs
    between the two kernels."""
    m, k, n = 3, 96, 40
    x, w, r = _inputs(m, k, n, BF16, seed=split_k)
    nw, nw_next = _norm_weight(n, BF16, seed=1), _norm_weight(n, BF16, seed=2)
    kw = dict(block_n=16, block_k=16, split_k=split_k, interpret=True)
    fused = getattr(smn, f"streaming_matmul_{order}")
    got = fused(x, w, r, nw, nw_next, 1e-6, **kw)
    want = getattr(smn, f"ref_streaming_matmul_{order}")(x, w, r, nw, nw_next, 1e-6)
    floor = 2.0**-7  # a product's last bit, through the norm and the add
    for a, b in zip(got, want, strict=True):
        _assert_close(a, b, BF16, ulps=2, floor=floor)
    assert not np.allclose(np.asarray(got[0], np.float32), np.asarray(got[1], np.float32), atol=0.1)
    closed = jax.make_jaxpr(functools.partial(fused, eps=1e-6, **kw))(x, w, r, nw, nw_next)
    outside = _primitives_outside_kernels(closed.jaxpr)
    assert outside.count("pallas_call") == 2 and "reduce_sum" not in outside, outside


def _primitives_outside_kernels(jaxpr) -> list[str]:
    """The primitives a jaxpr runs, inside nested jits but not inside Pallas kernels."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name != "pallas_call":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                names += _primitives_outside_kernels(sub)
    return names


def _norm_weight(k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(1 + 0.2 * rng.standard_normal(k, dtype=np.float32)).astype(dtype)


@pytest.mark.parametrize("m, k, n, block_n, block_k, split_k, dtype", CASES)
def test_norm_prologue_matches_ref(m, k, n, block_n, block_k, split_k, dtype):
    """norm_weight: the product of layers.rms_norm(x) (its ref_ twin) within the product's
    tolerance; with the epilogues too (in the kernel at split 1, in XLA past it)."""
    x, w, r = _inputs(m, k, n, dtype, seed=3)
    x = x * 4  # NOTE: an RMS far from 1, so that a skipped norm cannot pass
    norm = dict(norm_weight=_norm_weight(k, dtype), norm_eps=1e-6)
    kw = dict(block_n=block_n, block_k=block_k, split_k=split_k, **norm)
    out = sm.streaming_matmul(x, w, **kw)
    _assert_close(out, sm.ref_streaming_matmul(x, w, **norm), dtype)
    assert not np.allclose(out, sm.ref_streaming_matmul(x, w), rtol=0.1)
    floor = 2.0**-8 if dtype == BF16 else 0.0
    _assert_close(sm.streaming_matmul_add(x, w, r, **kw),
                  sm.ref_streaming_matmul_add(x, w, r, **norm), dtype, floor=floor)
    if n % 2 == 0:
        _assert_close(sm.streaming_matmul_silu_mul(x, w, **kw),
                      sm.ref_streaming_matmul_silu_mul(x, w, **norm), dtype, ulps=2, floor=floor)


# (M, K, block_k, split_k, dtype): K tails, K < block_k, K splits, real hidden sizes.
NORM_ROWS = [(1, 64, 16, 1, F32), (3, 80, 32, 2, BF16), (2, 24, 32, 1, F32),
             (5, 2048, 64, 4, F32), (7, 2048, 64, 1, BF16), (3, 5280, 64, 3, BF16),
             (20, 200, 32, 2, F32)]


@pytest.mark.parametrize("m, k, block_k, split_k, dtype", NORM_ROWS)
def test_norm_prologue_row_is_rms_norm_bitwise(m, k, block_k, split_k, dtype):
    """The normalized row the product multiplies, read through an identity weight (x @ I
    adds exact zeros, then rounds a value already in the dtype): bitwise the jitted
    layers.rms_norm on CPU."""
    x = _inputs(m, k, 16, dtype, seed=k)[0] * 3
    nw, cols = _norm_weight(k, dtype, seed=m), min(k, 128)
    eye = jnp.eye(k, cols, dtype=dtype)
    fused = jax.jit(functools.partial(sm.streaming_matmul, norm_eps=1e-6, block_n=16,
                                      block_k=block_k, split_k=split_k, interpret=True))
    want = jax.jit(layers.rms_norm, static_argnums=2)(x, nw, 1e-6)[:, :cols]
    np.testing.assert_array_equal(fused(x, eye, norm_weight=nw), want)


def test_norm_drop_ins_dispatch_on_rows():
    """The Ops drop-ins: the fused kernel up to 128 rows, layers' XLA ops above."""
    nw = _norm_weight(32, F32)

    def has_kernel(fn, m):
        x, w, _ = _inputs(m, 32, 16, F32)
        return "pallas_call" in str(jax.make_jaxpr(fn, static_argnums=2)(x, nw, 1e-6, w))

    for fn in (mo.streaming_norm_linear, mo.streaming_norm_linear_silu_mul):
        assert has_kernel(fn, 3) and has_kernel(fn, 128) and not has_kernel(fn, 129)
    x, w, _ = _inputs(129, 32, 16, F32)
    np.testing.assert_array_equal(mo.streaming_norm_linear(x, nw, 1e-6, w),
                                  layers.norm_linear(x, nw, 1e-6, w))


def test_auto_ops_pick_the_kernel_where_it_was_measured_to_win(monkeypatch):
    """matmul_ops('auto') on a GPU: every product runs the streaming kernel below 8 rows; from
    8 rows only the weight shapes listed as measured wins do, up to their listed rows; the norm
    stays in XLA (the fused-norm prologue loses); equal choices give equal (hashable) Ops."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mo, "STREAMING_MAX_ROWS", {(32, 16): 32})
    ops, nw = mo.matmul_ops("auto"), _norm_weight(32, F32)
    assert mo.matmul_ops("auto") == ops and hash(ops) == hash(mo.matmul_ops("auto"))
    assert mo.matmul_ops("streaming").norm_linear is mo.streaming_norm_linear
    for name in ("rms_norm", "rms_norm_add", "add_rms_norm", "rope_interleaved_qk"):
        assert getattr(ops, name) is getattr(layers.XLA_OPS, name), name  # products only
    for rows, n, kernel in ((7, 8, True), (8, 8, False), (8, 16, True), (32, 16, True), (33, 16, False)):
        x, w, _ = _inputs(rows, 32, n, F32)
        for op, args in ((ops.linear, (x, w)), (ops.norm_linear, (x, nw, 1e-6, w)),
                         (ops.norm_linear_silu_mul, (x, nw, 1e-6, w))):
            eps_static = (2,) if len(args) == 4 else ()
            jaxpr = str(jax.make_jaxpr(op, static_argnums=eps_static)(*args))
            assert ("pallas_call" in jaxpr) == kernel, (op, rows, n)
            assert jaxpr.count("pallas_call") <= 1
    for rows, n, kernel in ((7, 8, True), (8, 8, False), (32, 16, True), (33, 16, False)):
        x, w, r = _inputs(rows, 32, n, F32)  # w [32, n]: the product's weight; r [rows, n]
        jaxpr = str(jax.make_jaxpr(ops.linear_silu_mul)(x, w))
        assert ("pallas_call" in jaxpr) == kernel, ("linear_silu_mul", rows, n)
        # Ouro's norms after the product run in the norm_add_norm kernel, Huginn's in XLA
        for op, kernels in ((ops.linear_norm_add_norm, 2), (ops.linear_add_norm_norm, 1)):
            jaxpr = str(jax.make_jaxpr(op, static_argnums=5)(
                x, w, r, _norm_weight(n, F32), _norm_weight(n, F32, seed=1), 1e-6))
            assert jaxpr.count("pallas_call") == (kernels if kernel else 0), (op, rows, n)
    monkeypatch.undo()  # run on the CPU (interpret mode): the norm is XLA's, then the kernel
    x, w, _ = _inputs(4, 32, 16, F32)
    # NOTE: both jitted: eager and jitted rms_norm may differ in the last bit (another fusion)
    unfused = jax.jit(lambda x, w: mo.streaming_linear(layers.rms_norm(x, nw, 1e-6), w))(x, w)
    assert jnp.array_equal(jax.jit(ops.norm_linear, static_argnums=2)(x, nw, 1e-6, w), unfused)


def test_auto_ops_keep_xla_products_in_the_dtype_on_a_gpu(monkeypatch):
    """Where 'auto' does not stream on a GPU, XLA's dot returns the activation dtype (no fp32
    GEMM output + convert kernel): every product op, and the same numbers as layers' ops up to
    the last bit of bf16 (the summation order is XLA's either way)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    ops = mo.matmul_ops("auto")
    x, w, r = _inputs(200, 32, 16, BF16)  # 200 rows: above every streaming limit
    nw = _norm_weight(32, BF16)
    cases = {"linear": (x, w), "norm_linear": (x, nw, 1e-6, w),
             "linear_silu_mul": (x, jnp.concatenate([w, w[:, ::-1]], axis=1)),
             "linear_norm_add_norm": (x, w, r, _norm_weight(16, BF16), _norm_weight(16, BF16, seed=1), 1e-6)}
    cases["linear_add_norm_norm"] = cases["linear_norm_add_norm"]
    for name, args in cases.items():
        statics = tuple(i for i, a in enumerate(args) if isinstance(a, float))
        jaxpr = str(jax.make_jaxpr(getattr(ops, name), static_argnums=statics)(*args))
        assert "preferred_element_type=bfloat16" in jaxpr and "pallas_call" not in jaxpr, name
        got = jax.tree.leaves(jax.jit(getattr(ops, name), static_argnums=statics)(*args))
        want = jax.tree.leaves(jax.jit(getattr(layers.XLA_OPS, name), static_argnums=statics)(*args))
        for g, t in zip(got, want, strict=True):
            assert jnp.allclose(g.astype(F32), t.astype(F32), rtol=2 ** -7, atol=1e-6), name


def test_streaming_linear_dispatches_on_rows():
    """The drop-in linear: the kernel up to 128 rows, plain XLA above."""
    def has_kernel(m):
        x, w, _ = _inputs(m, 32, 16, F32)
        return "pallas_call" in str(jax.make_jaxpr(mo.streaming_linear)(x, w))

    assert has_kernel(3) and has_kernel(128) and not has_kernel(129)
    x, w, _ = _inputs(129, 32, 16, F32)
    np.testing.assert_array_equal(mo.streaming_linear(x, w), layers.linear(x, w))


def test_epilogue_refs_are_the_model_math():
    x, w, r = _inputs(2, 32, 8, BF16)
    gate, up = jnp.split(layers.linear(x, w), 2, axis=-1)
    np.testing.assert_array_equal(sm.ref_streaming_matmul_silu_mul(x, w), layers.silu_mul(gate, up))
    np.testing.assert_array_equal(sm.ref_streaming_matmul_add(x, w, r), layers.linear(x, w) + r)
    nw = _norm_weight(32, BF16)
    np.testing.assert_array_equal(sm.ref_streaming_matmul(x, w, norm_weight=nw, norm_eps=1e-5),
                                  layers.linear(layers.rms_norm(x, nw, 1e-5), w))
    np.testing.assert_array_equal(
        sm.ref_streaming_matmul_silu_mul(x, w, norm_weight=nw, norm_eps=1e-5),
        layers.norm_linear_silu_mul(x, nw, 1e-5, w))


def _bad(fn, match, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_bad_inputs_raise():
    x, w, r = _inputs(3, 32, 16, BF16)
    for fn in (sm.streaming_matmul, sm.ref_streaming_matmul):
        _bad(fn, "disagree on K", x, w[:16])
        _bad(fn, "dtype", x, w.astype(F32))
        _bad(fn, "dtype", x.astype(jnp.int32), w.astype(jnp.int32))
        _bad(fn, r"must be \[M, K\]", x[0], w)
        _bad(fn, "1..128 rows", jnp.zeros((129, 32), BF16), w)
        _bad(fn, "1..128 rows", jnp.zeros((0, 32), BF16), w)
    _bad(sm.streaming_matmul_add, "residual must be", x, w, r[:, :8])
    _bad(sm.ref_streaming_matmul_add, "residual must be", x, w, r.astype(F32))
    _bad(sm.streaming_matmul_silu_mul, r"\[K, 2F\]", x, w[:, :15])
    _bad(sm.ref_streaming_matmul_silu_mul, r"\[K, 2F\]", x, w[:, :15])
    _bad(sm.streaming_matmul, "power of two", x, w, block_n=24)
    _bad(sm.streaming_matmul, "power of two", x, w, block_k=8)
    _bad(sm.streaming_matmul, "split_k must be in 1..2", x, w, block_k=16, split_k=3)
    _bad(sm.streaming_matmul, "split_k", x, w, split_k=0)
    nw = _norm_weight(32, BF16)
    for fn in (sm.streaming_matmul, sm.ref_streaming_matmul):
        _bad(fn, r"norm_weight must be \[32\]", x, w, norm_weight=nw[:16], norm_eps=1e-6)
        _bad(fn, r"norm_weight must be \[32\] \(K\) bfloat16", x, w, norm_weight=nw.astype(F32),
             norm_eps=1e-6)
        _bad(fn, "norm_eps is required", x, w, norm_weight=nw)


def test_configs_fill_the_gpu():
    """Every real shape, every row bucket: a valid config, about 1 program per SM or more up
    to 32 rows (>= 90% of the SMs: Ouro-1.4B's wo at 1-16 rows measured fastest with 32 column
    blocks x 4 splits = 128, run 15), half that at 128 rows, where the split is capped by its
    fp32 partials (<= half the weight's bytes)."""
    for k, n in REAL_SHAPES:
        for m in (1, 8, 32, 128):
            cfg = sm.pick_config(m, k, n, BF16)
            sm._check_config(cfg, k)
            programs = -(-n // cfg.block_n) * cfg.split_k
            assert programs >= (0.9 * sm.NUM_SMS if m <= 32 else sm.NUM_SMS // 2), (k, n, m, cfg)
            if cfg.split_k > 1:
                assert cfg.split_k * m * n * 4 <= k * n * 2 / 2, (k, n, m, cfg)
            assert sm._fit_stages(cfg, sm.block_rows(m), 2, 2).num_stages >= 2


def test_tuned_table_wins_and_kwargs_override(monkeypatch):
    tuned = sm.Config(block_n=32, block_k=128, split_k=5, num_warps=2, num_stages=3)
    monkeypatch.setitem(sm.TUNED, (2048, 2048, 16), tuned)
    assert sm.pick_config(3, 2048, 2048, BF16) == tuned
    assert sm.pick_config(3, 2048, 2048, F32).block_k == 64  # same tile bytes in fp32
    assert sm.pick_config(32, 2048, 2048, BF16) != tuned  # another row bucket
    assert sm.pick_config(3, 2048, 2048, BF16, split_k=2).split_k == 2


@pytest.mark.parametrize("m, k, n, block_n, block_k, split_k", [(3, 256, 128, 64, 64, 2),
                                                                 (100, 128, 64, 32, 64, 1)])
def test_mgpu_matches_ref(m, k, n, block_n, block_k, split_k):
    """Mosaic GPU variant in its CPU interpreter: rows past M (TMA zero-fill), 128-row block,
    K split, tiles of different widths."""
    x, w, _ = _inputs(m, k, n, BF16)
    out = smg.streaming_matmul_mgpu(x, w, block_n=block_n, block_k=block_k, split_k=split_k,
                                   interpret=True)
    _assert_close(out, sm.ref_streaming_matmul(x, w), BF16)


def test_mgpu_bad_inputs_and_configs():
    x, w, _ = _inputs(3, 96, 64, BF16)
    _bad(smg.streaming_matmul_mgpu, "bfloat16/float16", x.astype(F32), w.astype(F32))
    _bad(smg.streaming_matmul_mgpu, "must divide", x, w, block_k=64)  # 96 = 1.5 tiles
    _bad(smg.streaming_matmul_mgpu, "must divide", x, w[:, :48], block_n=32)
    _bad(smg.streaming_matmul_mgpu, "disagree on K", x, w[:64])
    for k, n in REAL_SHAPES:
        for m in (1, 32, 128):
            cfg = smg.mgpu_config(m, k, n)
            assert k % (cfg.block_k * cfg.split_k) == 0 and n % cfg.block_n == 0, (k, n, cfg)


# ------------------------------------------------------------------- CUDA lowering on CPU

H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))


def _lower_cuda(fn, *shapes):
    """fn(*args, interpret=False) lowered for CUDA on this host (no GPU needed)."""
    args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
    fn = functools.partial(fn, interpret=False)
    with use_abstract_mesh(H200):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m, k, n", [(1, 2048, 6144), (128, 5280, 15840), (8, 17920, 5280)])
def test_lowers_for_cuda(m, k, n):
    """Default configs at real shapes (K and N tails for Huginn) lower to one Triton call
    per product; split-K adds only XLA's reduction."""
    text = _lower_cuda(sm.streaming_matmul, (m, k), (k, n))
    assert text.count("__gpu$xla.gpu.triton") == 1


@pytest.mark.parametrize("split_k", [1, 3])
def test_epilogues_lower_for_cuda(split_k):
    m, k, f = 4, 5280, 17920
    text = _lower_cuda(functools.partial(sm.streaming_matmul_silu_mul, split_k=split_k),
                       (m, k), (k, 2 * f))
    assert text.count("__gpu$xla.gpu.triton") == 1
    text = _lower_cuda(functools.partial(sm.streaming_matmul_add, split_k=split_k),
                       (m, k), (k, 5280), (m, 5280))
    assert text.count("__gpu$xla.gpu.triton") == 1


# (M, K, N, product): the norm-fed products of Ouro-1.4B (hidden 2048) and Huginn-0125
# (5280, a K tail), with their default configs (K splits included).
NORM_PRODUCTS = [(1, 2048, 6144, "qkv"), (7, 2048, 11264, "gate_up"), (1, 5280, 15840, "qkv"),
                 (4, 5280, 35840, "gate_up"), (128, 5280, 15840, "qkv")]


@pytest.mark.parametrize("m, k, n, product", NORM_PRODUCTS)
def test_norm_prologue_lowers_for_cuda(m, k, n, product):
    """The fused RMSNorm prologue (with the SiLU*up epilogue for gate_up) at the real
    shapes: one Triton call per product."""
    fn = sm.streaming_matmul_silu_mul if product == "gate_up" else sm.streaming_matmul
    cfg = sm.pick_config(m, k, n)
    text = _lower_cuda(lambda x, w, nw, **kw: fn(x, w, norm_weight=nw, norm_eps=1e-6, **kw),
                       (m, k), (k, n), (k,))
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "loopjax_streaming_matmul_norm" in text, (cfg, text[:200])


def test_call_sites_share_one_lowering_per_config():
    """Each variant called from two sites (two weights of one shape) lowers its kernel once:
    both sites call one jitted function; a different configuration lowers its own."""
    from loopjax.bench.warmup_probe import triton_calls, triton_kernels

    def two_layers(x, w1, w2, r, nw, interpret):
        out = []
        for w in (w1, w2):
            out += [sm.streaming_matmul(x, w, interpret=interpret),
                    sm.streaming_matmul_add(x, w, r, interpret=interpret),
                    sm.streaming_matmul_silu_mul(x, w, interpret=interpret),
                    sm.streaming_matmul(x, w, norm_weight=nw, norm_eps=1e-6, interpret=interpret)]
        # another configuration: its own kernel
        out.append(sm.streaming_matmul(x, w1, block_n=32, interpret=interpret))
        return out

    text = _lower_cuda(two_layers, (2, 128), (128, 64), (128, 64), (2, 64), (128,))
    names = ["none", "add", "silu", "norm_none"]
    expected = {f"loopjax_streaming_matmul_{n}": 2 if n == "none" else 1 for n in names}
    assert triton_calls(text) == triton_kernels(text) == expected


def test_mgpu_call_sites_share_one_kernel():
    """Mosaic GPU: two sites of one shape, one kernel hash (XLA compiles it once)."""
    from loopjax.bench.warmup_probe import mosaic_kernels

    text = _lower_cuda(lambda x, w1, w2, interpret: [smg.streaming_matmul_mgpu(x, w, interpret=interpret)
                                                     for w in (w1, w2)], (1, 256), (256, 64), (256, 64))
    assert mosaic_kernels(text) == (1, 1)


def test_bench_smoke(capsys):
    """bench/matmul.py --smoke: every product row checks out (a fused-norm row for each
    norm-fed product), every decode variant runs, the kernel ones with the norm fused too."""
    from loopjax.bench import matmul

    assert matmul.main(["--smoke", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "ERROR" not in out and "BAD" not in out and "skipped" not in out
    product_rows = [line for line in out.splitlines() if line.startswith("smoke.")]
    assert len(product_rows) == 8 and sum(" ok" in line for line in product_rows) == 8
    assert sum(line.split()[3] == "pallas+norm" for line in product_rows) == 2
    for variant in ("xla", "pallas", "pallas+silu"):
        [line] = [ln for ln in out.splitlines() if ln.split()[:2] == [variant, "3"]]
        plain, fused = line.split("|")  # variant M ms %roof wcopies [rel_err] | ...
        assert len(plain.split()) == (5 if variant == "xla" else 6), line
        if variant == "xla":
            assert fused.strip() == "-"
        else:  # ms %roof wcopies rel_err, the error vs XLA small
            ms, _, _, err = fused.split()
            assert float(ms) > 0 and float(err) < 2e-2, line


@pytest.mark.parametrize("m, k, n", [(1, 2048, 2048), (128, 5280, 15840), (32, 17920, 5280)])
def test_mgpu_lowers_for_cuda(m, k, n):
    text = _lower_cuda(smg.streaming_matmul_mgpu, (m, k), (k, n))
    assert text.count("mosaic_gpu") >= 1


def test_bench_sweep_times_the_products_as_the_step_runs_them():
    """bench/matmul.py --sweep: Ouro's w_gate_up runs with its SiLU*up epilogue, wo and w_down
    with their partials into norm_add_norm, each against its XLA twin; --wide adds tiles."""
    from loopjax.bench import matmul, matmul_sweep

    key, x = jax.random.PRNGKey(0), jax.random.normal(jax.random.PRNGKey(1), (3, 64))
    w = jax.random.normal(jax.random.PRNGKey(2), (64, 128))
    for name, width in (("ouro.wo", 128), ("ouro.w_gate_up", 64), ("huginn.wo", 128)):
        kernel, twin = matmul._in_step(name, key, 3, 128, jnp.float32)
        got, want = kernel(x, w, interpret=True, split_k=2, block_k=32), twin(x, w)
        assert got.shape == want.shape == (3, width)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    base = matmul_sweep.sweep_configs(32, 2048, 2048, jnp.bfloat16)
    wide = matmul_sweep.wide_configs(32, 2048, 2048, jnp.bfloat16)
    assert wide[:len(base)] == base and len(wide) > len(base) and len(set(wide)) == len(wide)
