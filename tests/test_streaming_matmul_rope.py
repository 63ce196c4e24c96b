"""The qkv product with Ouro's RoPE in its epilogue (kernels/streaming_matmul_rope.py):
interpret-mode kernel vs its twins, bitwise (exact products make the twin's product the
kernel's; otherwise the plain kernel's product is the same sum), the unfused fallbacks, bad
inputs, the CUDA lowering on this CPU host (one kernel, nothing between it and q, k, v; one
lowering per configuration), the layers.Ops entries ('streaming', 'auto') and the Ouro layer
on them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from test_streaming_matmul import _bad, _lower_cuda, _primitives_outside_kernels

from loopjax import layers
from loopjax import matmul_ops as mo
from loopjax.config import preset
from loopjax.kernels import streaming_matmul as sm
from loopjax.kernels import streaming_matmul_rope as smr
from loopjax.layers import IDENTITY_COMPILER_OPTIONS, DenseCausal, rope_angles
from loopjax.models import ouro

BF16, F32 = jnp.bfloat16, jnp.float32
OURO_1_4B = dict(num_heads=16, num_kv_heads=16)  # D = 128, wqkv [2048, 6144]


def _inputs(m, k, hq, hkv, d, dtype, exact: bool, seed=0):
    """x [M, K], w_qkv [K, (Hq + 2*Hkv) * D], cos, sin at positions far from 0. exact: small
    integers, so that fp32 accumulation is exact in any order (the twin's product is then
    the kernel's, bit for bit)."""
    rs = np.random.default_rng(seed)
    shapes = ((m, k), (k, (hq + 2 * hkv) * d))
    if exact:
        x, w = (rs.integers(-3, 4, s) for s in shapes)
    else:
        x, w = rs.standard_normal(shapes[0]), rs.standard_normal(shapes[1]) / np.sqrt(k)
    cos, sin = rope_angles(jnp.arange(m) * 37 + 1000, d, 10000.0)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), cos, sin


def _twin(fn, **heads):
    """A twin compiled as the models' steps compile (layers.IDENTITY_COMPILER_OPTIONS)."""
    return jax.jit(functools.partial(fn, **heads), compiler_options=IDENTITY_COMPILER_OPTIONS)


def _same(got, want):
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        np.testing.assert_array_equal(np.asarray(a.astype(F32)), np.asarray(b.astype(F32)))


# (M, Hq, Hkv, D, block_n, block_k): block_n = D/2 and smaller; GQA and Hq == Hkv; a K tail
# (K = 80 with block_k 32) and K < block_k.
CASES = [(1, 4, 2, 32, 16, 32), (3, 2, 2, 64, 32, 32), (8, 2, 1, 64, 16, 64), (3, 4, 2, 64, 16, 128),
         (8, 3, 3, 32, 16, 16)]


@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("m, hq, hkv, d, block_n, block_k", CASES)
def test_matches_twins_bitwise(m, hq, hkv, d, block_n, block_k, dtype):
    heads = dict(num_heads=hq, num_kv_heads=hkv)
    kw = dict(block_n=block_n, block_k=block_k, split_k=1, interpret=True)
    kernel = jax.jit(functools.partial(smr.streaming_matmul_rope_qkv, **heads, **kw))
    x, w, cos, sin = _inputs(m, 80, hq, hkv, d, dtype, exact=True)
    got = kernel(x, w, cos, sin)
    _same(got, _twin(smr.ref_streaming_matmul_rope_qkv, **heads)(x, w, cos, sin))
    # NOTE: v is the product itself, so the q and k heads were rotated, not copied
    assert not np.array_equal(np.asarray(got[1], F32), np.asarray(got[2], F32))
    # any product: the plain kernel's (the same sum per column), then layers' RoPE
    x, w, cos, sin = _inputs(m, 80, hq, hkv, d, dtype, exact=False, seed=m)
    product = sm.streaming_matmul(x, w, **kw)
    _same(kernel(x, w, cos, sin), _twin(layers.rope_rotate_half_qkv, **heads)(product, cos, sin))


def test_ref_is_the_layers_op():
    x, w, cos, sin = _inputs(3, 32, 2, 1, 32, BF16, exact=False)
    qkv = layers.linear(x, w)
    q, k = layers.rope_rotate_half_qk(qkv, cos, sin, 2, 1)
    want = (q, k, qkv[:, 3 * 32:].reshape(3, 1, 32))
    _same(smr.ref_streaming_matmul_rope_qkv(x, w, cos, sin, num_heads=2, num_kv_heads=1), want)


def test_real_width_one_row():
    """Ouro-1.4B's qkv product at 1 row with its default configuration (TUNED, block_n 32)."""
    x, w, cos, sin = _inputs(1, 2048, 16, 16, 128, BF16, exact=True)
    _same(smr.streaming_matmul_rope_qkv(x, w, cos, sin, **OURO_1_4B),
          _twin(smr.ref_streaming_matmul_rope_qkv, **OURO_1_4B)(x, w, cos, sin))


def _kernel_calls(jaxpr, name: str) -> int:
    """Calls of the Pallas kernel `name` a jaxpr makes, each call of a nested jit counted."""
    return sum(name in str(eqn.params["name"]) if eqn.primitive.name == "pallas_call"
               else sum(_kernel_calls(sub, name) for sub in jax.extend.core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _kernel_names(fn, *args) -> list[str]:
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return [name for name in _primitives_outside_kernels(jaxpr) if name not in ("pjit", "jit")]


def test_fused_path_runs_one_kernel_and_nothing_after_it():
    x, w, cos, sin = _inputs(3, 64, 2, 1, 32, BF16, exact=True)
    fn = functools.partial(smr.streaming_matmul_rope_qkv, num_heads=2, num_kv_heads=1, split_k=1)
    assert sorted(set(_kernel_names(fn, x, w, cos, sin))) == ["pallas_call", "reshape"]


@pytest.mark.parametrize("kw, d", [(dict(split_k=2, block_k=16), 32), (dict(split_k=1), 16)])
def test_unfused_fallbacks_match(kw, d):
    """split_k > 1 (the partials summed in XLA, then layers' RoPE), and D/2 = 8 (below a
    Triton dot tile): the plain kernel and layers' RoPE, still the twin's result."""
    heads = dict(num_heads=4, num_kv_heads=2)
    x, w, cos, sin = _inputs(3, 64, 4, 2, d, BF16, exact=True)
    fn = functools.partial(smr.streaming_matmul_rope_qkv, **heads, **kw)
    _same(jax.jit(fn)(x, w, cos, sin), _twin(smr.ref_streaming_matmul_rope_qkv, **heads)(x, w, cos, sin))
    names = _kernel_names(fn, x, w, cos, sin)
    assert names.count("pallas_call") == 1 and "mul" in names  # the plain kernel, XLA's RoPE


def test_block_n_defaults():
    assert smr.rope_block_n(32, 128) == 32  # Ouro-1.4B: TUNED's block_n
    assert smr.rope_block_n(128, 128) == 64  # at most D/2
    assert smr.rope_block_n(64, 96) == 16  # the largest power of two dividing D/2 = 48
    assert smr.rope_block_n(64, 16) is None  # D/2 = 8: not fused


def test_bad_inputs_raise():
    x, w, cos, sin = _inputs(3, 32, 2, 1, 32, BF16, exact=False)
    heads = dict(num_heads=2, num_kv_heads=1)
    for fn in (smr.streaming_matmul_rope_qkv, smr.ref_streaming_matmul_rope_qkv):
        _bad(fn, "cos must be float32", x, w, cos[:, :8], sin, **heads)
        _bad(fn, r"sin must be float32 \[3, 16\]", x, w, cos, sin[:2], **heads)
        _bad(fn, "cos must be float32", x, w, cos.astype(BF16), sin, **heads)
        _bad(fn, "width 128 is not", x, w, cos, sin, num_heads=3, num_kv_heads=1)
        _bad(fn, "width 124 is not", x, w[:, :124], cos, sin, **heads)
        _bad(fn, "with an even D", x, jnp.zeros((32, 4 * 33), BF16), cos, sin, **heads)
        _bad(fn, "multiple of num_kv_heads", x, w, cos, sin, num_heads=3, num_kv_heads=2)
        _bad(fn, "disagree on K", x, w[:16], cos, sin, **heads)
        _bad(fn, "1..128 rows", jnp.zeros((129, 32), BF16), w, cos, sin, **heads)
    _bad(smr.streaming_matmul_rope_qkv, "block_n must divide D/2 = 16", x, w, cos, sin, block_n=32, **heads)
    _bad(smr.streaming_matmul_rope_qkv, "power of two", x, w, cos, sin, block_n=8, **heads)
    _bad(smr.streaming_matmul_rope_qkv, "split_k must be in", x, w, cos, sin, split_k=0, **heads)


# ------------------------------------------------------------------- CUDA lowering on CPU


@pytest.mark.parametrize("m, block_n", [(1, 16), (1, None), (8, 64), (32, 32)])
def test_lowers_for_cuda(m, block_n):
    """Ouro-1.4B's qkv product at 1, 8 and 32 rows, with the block_n the GPU sweep tries:
    one Triton call, the fused one."""
    fn = functools.partial(smr.streaming_matmul_rope_qkv, block_n=block_n, **OURO_1_4B)
    text = _lower_cuda(lambda x, w, c, s, **kw: fn(x, w, c.astype(F32), s.astype(F32), **kw),
                       (m, 2048), (2048, 6144), (m, 64), (m, 64))
    assert text.count("__gpu$xla.gpu.triton") == 1 and "loopjax_streaming_matmul_rope" in text


def test_call_sites_share_one_lowering_per_config():
    """Two layers' qkv products (two weights of one shape) lower the kernel once; another
    block_n lowers its own."""
    from loopjax.bench.warmup_probe import triton_calls, triton_kernels

    def two_layers(x, w1, w2, c, s, interpret):
        c, s = c.astype(F32), s.astype(F32)
        fn = functools.partial(smr.streaming_matmul_rope_qkv, num_heads=2, num_kv_heads=1,
                               split_k=1, interpret=interpret)
        return [fn(x, w, c, s) for w in (w1, w2)] + [fn(x, w1, c, s, block_n=16)]

    text = _lower_cuda(two_layers, (2, 128), (128, 256), (128, 256), (2, 32), (2, 32))
    assert triton_calls(text) == triton_kernels(text) == {"loopjax_streaming_matmul_rope": 2}


# ------------------------------------------------------------------- layers.Ops entries


def test_ops_entries(monkeypatch):
    """'streaming': the fused kernel up to 128 rows, layers' op above. 'auto' on a GPU: the
    kernel exactly where the plain qkv product streams (the weight is argument 0 after x)."""
    assert mo.matmul_ops("streaming").linear_rope_rotate_half_qkv is mo.streaming_linear_rope_qkv
    heads = (2, 1)

    def streams(op, m, k=32):
        x, w, cos, sin = _inputs(m, k, *heads, 32, F32, exact=True)
        return "pallas_call" in str(jax.make_jaxpr(op, static_argnums=(4, 5))(x, w, cos, sin, *heads))

    assert streams(mo.streaming_linear_rope_qkv, 128) and not streams(mo.streaming_linear_rope_qkv, 129)
    x, w, cos, sin = _inputs(129, 32, *heads, 32, F32, exact=True)
    _same(mo.streaming_linear_rope_qkv(x, w, cos, sin, *heads),
          layers.linear_rope_rotate_half_qkv(x, w, cos, sin, *heads))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(mo, "STREAMING_MAX_ROWS", {(32, 128): 32})  # K 32 only: K 64 is unlisted
    auto = mo.matmul_ops("auto")
    for rows, k, kernel in ((7, 64, True), (8, 64, False), (8, 32, True), (32, 32, True), (33, 32, False)):
        x, w = _inputs(rows, k, *heads, 32, F32, exact=True)[:2]
        plain = "pallas_call" in str(jax.make_jaxpr(auto.linear)(x, w))
        assert streams(auto.linear_rope_rotate_half_qkv, rows, k) == plain == kernel, (rows, k)


def _ouro_loop(params, x, *, cfg, ops):
    cos, sin = rope_angles(jnp.arange(x.shape[0]) + 3, cfg.head_dim, cfg.rope_theta)
    return ouro.loop(params, cfg, x, cos, sin, DenseCausal(), None, 0, ops)[0]


def test_ouro_layers_on_the_streaming_ops():
    """Ouro's loop with matmul 'streaming' (interpret mode) at D = 32, GQA: every layer's qkv
    product runs the fused kernel, and the loop matches the XLA products' up to fp32
    accumulation order (the engine's golden tokens: tests/test_engine.py)."""
    cfg = dataclasses.replace(preset("ouro-tiny"), head_dim=32, num_kv_heads=2)
    params = ouro.init_params(cfg, jax.random.key(0), F32)
    x = jax.random.normal(jax.random.key(1), (3, cfg.hidden_size), F32)
    ops = mo.matmul_ops("streaming")
    fn = functools.partial(_ouro_loop, cfg=cfg, ops=ops)
    jaxpr = jax.make_jaxpr(fn)(params, x).jaxpr
    assert _kernel_calls(jaxpr, "loopjax_streaming_matmul_rope") == cfg.num_layers
    got = jax.jit(fn, compiler_options=IDENTITY_COMPILER_OPTIONS)(params, x)
    want = jax.jit(functools.partial(_ouro_loop, cfg=cfg, ops=layers.XLA_OPS),
                   compiler_options=IDENTITY_COMPILER_OPTIONS)(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bench_smoke(capsys):
    """bench/matmul_rope.py --smoke: XLA, the plain kernel + XLA's RoPE, and the fused kernel
    at each block_n dividing D/2 (16 and 32; not 64) run and check out against XLA."""
    from loopjax.bench import matmul_rope

    assert matmul_rope.main(["--smoke", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("smoke.")]
    assert [line.split()[3] for line in rows] == ["xla", "pallas+xla_rope", "rope", "rope"]
    assert all(" ok" in line for line in rows) and "ERROR" not in out and "BAD" not in out
    assert " x1.00 " in rows[1] and "n16 k" in rows[2] and "n32 k" in rows[3]
