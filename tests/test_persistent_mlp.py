"""The persistent MLP kernel (kernels/persistent_mlp.py): its phases in the Mosaic GPU CPU
interpreter vs the XLA twin (rows padded to 8 and 32, K splits, more tiles than ring slots;
with the norms, bitwise), bad shapes, the fused kernel lowered for CUDA on this CPU host at
Ouro-1.4B's shapes (one kernel, its phases synchronized through one counters Ref that a loop's
layers share); phases 0 and 1 (`norm_add_norm_silu_mul`: the attention branch's norms in the
MLP's first product, not used by a step: bench/RESULTS.md run 28) against their twin and
lowered for CUDA; the `mlp_norm_add_norm` op of every Ops (XLA, 'auto', 'streaming',
'persistent', pointwise 'pallas'): the two ops it replaces unless a kernel runs it; the device
probes' --smoke runs."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import use_abstract_mesh

from loopjax import layers
from loopjax import matmul_ops as mo
from loopjax.kernels import persistent_mlp as pm
from loopjax.pointwise_ops import with_pointwise

BF16, F32 = jnp.bfloat16, jnp.float32


def _inputs(m, h, f, seed=0):
    kx, kg, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (m, h), F32).astype(BF16)
    w_gate_up = (jax.random.normal(kg, (h, 2 * f), F32) * h**-0.5).astype(BF16)
    w_down = (jax.random.normal(kd, (f, h), F32) * f**-0.5).astype(BF16)
    return x, w_gate_up, w_down


def _specs(m, h, f):
    """Shapes only (shape_problem reads no values)."""
    return [jax.ShapeDtypeStruct(s, BF16) for s in ((m, h), (h, 2 * f), (f, h))]


@pytest.mark.parametrize("m, h, f, split_k, stages", [
    (1, 128, 256, 2, 1),  # 1 row in an 8-row tile; 2 K tiles per program through 1 slot
    (20, 192, 256, None, 2),  # 20 rows in 32; 3 K tiles through 2 slots; split_k 4 (default)
])
def test_phases_match_ref(m, h, f, split_k, stages):
    x, w_gate_up, w_down = _inputs(m, h, f)
    act, partials = pm.persistent_mlp(x, w_gate_up, w_down, split_k=split_k, num_stages=stages,
                                      interpret=True)
    ref_act, ref_y = pm.ref_persistent_mlp(x, w_gate_up, w_down)
    assert act.shape == ref_act.shape and act.dtype == BF16
    assert partials.shape == (split_k or pm.default_split_k(h, f), m, h) and partials.dtype == F32
    # silu's exp may round differently from XLA's in the last bit of bf16
    np.testing.assert_allclose(np.asarray(act, F32), np.asarray(ref_act, F32), rtol=2 ** -7, atol=1e-3)
    np.testing.assert_allclose(np.asarray(partials.sum(0)), np.asarray(ref_y), rtol=1e-2, atol=1e-2)


def test_shape_problems():
    x, w_gate_up, w_down = _inputs(3, 128, 256)
    assert pm.shape_problem(x, w_gate_up, w_down) is None and pm.default_split_k(128, 256) == 4
    assert "bfloat16/float16" in pm.shape_problem(x.astype(F32), w_gate_up, w_down)
    assert "w_gate_up [H, 2F]" in pm.shape_problem(x, w_gate_up[:, :256], w_down)
    assert "<= 64 rows" in pm.shape_problem(jnp.zeros((65, 128), BF16), w_gate_up, w_down)
    x96, gu96, d96 = _inputs(3, 96, 256)  # H = 96: not whole 64-column tiles
    assert "multiples of 64" in pm.shape_problem(x96, gu96, d96)
    assert "at most 132 programs" in pm.shape_problem(*_specs(1, 128, 64 * 133))
    with pytest.raises(ValueError, match="multiples of 64"):
        pm.persistent_mlp(x96, gu96, d96, interpret=True)
    assert pm.default_split_k(2048, 5632) == 4  # Ouro-1.4B: 128 down programs
    assert pm.shape_problem(*_specs(1, 5280, 17920)) is not None  # Huginn-0125: H % 64
    assert pm.shape_problem(*_specs(32, 2048, 5632)) is None  # Ouro-1.4B


H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))


@pytest.mark.parametrize("norms, m", [(False, 8), (True, 8), (True, 64)])
def test_fused_kernel_lowers_for_cuda(norms, m):
    """Ouro-1.4B's MLP at 8 and 64 rows: one Mosaic GPU kernel for both products (and the
    norms), its later phases waiting on global semaphores; at 64 rows the rings shrink to fit
    shared memory (6 + 6 slots asked for more than the H200 has, bench/RESULTS.md run 18)."""
    from loopjax.bench.warmup_probe import mosaic_kernels

    shapes = ((m, 2048), (2048, 11264), (5632, 2048)) + (((m, 2048), (2048,), (2048,)) if norms else ())
    args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]
    fn = (functools.partial(pm.persistent_mlp_norm_add_norm, eps=1e-6, interpret=False) if norms
          else functools.partial(pm.persistent_mlp, interpret=False))
    with use_abstract_mesh(H200):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert mosaic_kernels(text) == (1, 1) and "loopjax_persistent_mlp" in text


def test_fused_kernels_thread_one_counters_buffer():
    """Two fused calls in one step share one zeroed counters Ref (the kernel leaves it zero),
    updated in place (an aliased output), and nothing zero-fills a buffer per call: Pallas's
    own global semaphores would (bench/RESULTS.md run 17)."""
    shapes = ((8, 2048), (2048, 11264), (5632, 2048), (8, 2048), (2048,), (2048,))
    args = [jax.ShapeDtypeStruct(s, BF16) for s in shapes]

    def two_layers(x, w_gate_up, w_down, residual, norm_weight, next_norm_weight):
        counters = pm.new_counters()
        for _ in range(2):
            residual, x = pm.persistent_mlp_norm_add_norm(
                x, w_gate_up, w_down, residual, norm_weight, next_norm_weight, 1e-6, counters,
                interpret=False)
        return x

    with use_abstract_mesh(H200):
        text = jax.jit(two_layers).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2 and all("output_operand_alias" in line for line in calls)
    fills = _int32_fills(text)
    assert len(fills) == 1 and f"-> tensor<{pm.NUM_COUNTERS}xi32>" in fills[0]


def _int32_fills(text: str) -> list[str]:
    """The lines of lowered StableHLO that fill an int32 array with a scalar (zeros)."""
    return [line for line in text.splitlines()
            if "broadcast_in_dim" in line and "dims = [] :" in line and "xi32>" in line]


def _norms_args(m, h, f, num_partials=4, seed=3):
    """(y, residual, norm_weight, next_norm_weight, eps, w_gate_up): y as fp32 partials
    [num_partials, M, H], or a bf16 product [M, H] for num_partials 0."""
    ky, kr, kn, kg = jax.random.split(jax.random.PRNGKey(seed), 4)
    y = jax.random.normal(ky, (max(num_partials, 1), m, h), F32)
    y = y[0].astype(BF16) if num_partials == 0 else y
    residual = jax.random.normal(kr, (m, h), F32).astype(BF16)
    norms = [(1 + 0.1 * jax.random.normal(k, (h,), F32)).astype(BF16) for k in jax.random.split(kn)]
    w_gate_up = (jax.random.normal(kg, (h, 2 * f), F32) * h**-0.5).astype(BF16)
    return y, residual, *norms, 1e-6, w_gate_up


def _twin(*args):
    # NOTE: no excess precision (XLA on CPU would keep some bf16 roundings in f32)
    return jax.jit(pm.ref_norm_add_norm_silu_mul, static_argnums=4,
                   compiler_options=layers.IDENTITY_COMPILER_OPTIONS)(*args)


@pytest.mark.parametrize("m, num_partials, stages", [
    (1, 4, 6),  # the 1-row step: 4 fp32 partials, act through shared memory (TMA clips row 1-7)
    (3, 0, 2),  # a bf16 product (y unsplit); 2 K tiles through 2 slots
    (8, 2, 1),  # its own row padding: act stored straight from registers
])
def test_norm_add_norm_silu_mul_matches_twin(m, num_partials, stages):
    """Phases 0 and 1 (interpreted: two kernels): h bitwise, act within one bf16 rounding of the
    twin (silu's exp) and bitwise on most elements."""
    args = _norms_args(m, 128, 256, num_partials)
    h, act = pm.norm_add_norm_silu_mul(*args, num_stages=stages, interpret=True)
    want_h, want_act = _twin(*args)
    assert h.shape == (m, 128) and act.shape == (m, 256) and act.dtype == BF16
    assert jnp.array_equal(h, want_h)
    np.testing.assert_allclose(np.asarray(act, F32), np.asarray(want_act, F32), rtol=2 ** -7, atol=1e-6)
    assert np.mean(np.asarray(act == want_act)) > 0.99


def test_norm_add_norm_silu_mul_refuses():
    y, residual, nw, nnw, eps, w_gate_up = _norms_args(3, 128, 256)
    assert pm.norms_silu_mul_problem(y, residual, w_gate_up) is None
    assert "<= 64 rows" in pm.norms_silu_mul_problem(y, jnp.zeros((65, 128), BF16), w_gate_up)
    assert "bfloat16/float16" in pm.norms_silu_mul_problem(y, residual.astype(F32), w_gate_up)
    with pytest.raises(ValueError, match="H a multiple of 64"):
        pm.norm_add_norm_silu_mul(*_norms_args(3, 96, 256), interpret=True)
    with pytest.raises(ValueError, match="partials must be float32"):
        pm.norm_add_norm_silu_mul(y.astype(BF16), residual, nw, nnw, eps, w_gate_up, interpret=True)


@pytest.mark.parametrize("m", [1, 8, 32])
def test_norm_add_norm_silu_mul_lowers_for_cuda(m):
    """Ouro-1.4B's shapes: one Mosaic GPU kernel for phases 0 and 1, its counters an aliased
    operand (updated in place, no fill per call)."""
    from loopjax.bench.warmup_probe import mosaic_kernels

    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in (((4, m, 2048), F32), ((m, 2048), BF16),
                                                      ((2048,), BF16), ((2048,), BF16))]
    w_gate_up = jax.ShapeDtypeStruct((2048, 11264), BF16)

    def fn(y, residual, nw, nnw, w):
        return pm.norm_add_norm_silu_mul(y, residual, nw, nnw, 1e-6, w, pm.new_counters(), interpret=False)

    with use_abstract_mesh(H200):
        text = jax.jit(fn).trace(*args, w_gate_up).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert mosaic_kernels(text) == (1, 1) and len(calls) == 1 and "output_operand_alias" in calls[0]


def test_a_loop_shares_one_counters_ref(monkeypatch):
    """ouro.loop on 'persistent' (a GPU's Ops, lowered for CUDA): every layer's MLP runs the
    fused kernel, and the loop's layers share Ops.mlp_scratch's one counters Ref (a single
    zero fill for the loop, no fill per call)."""
    from loopjax.config import preset
    from loopjax.models import ouro

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = dataclasses.replace(preset("ouro-tiny"), hidden_size=256, intermediate_size=512)
    persistent = mo.matmul_ops("persistent")  # its MLP; XLA's other ops (Mosaic's qkv: D >= 64)
    ops = dataclasses.replace(layers.XLA_OPS, fused_mlp=persistent.fused_mlp,
                              fused_mlp_scratch=persistent.fused_mlp_scratch)
    params = jax.eval_shape(lambda: ouro.init_params(cfg, jax.random.key(0), BF16))

    def one_loop(params, x):
        cos, sin = layers.rope_angles(jnp.arange(x.shape[0]), cfg.head_dim, cfg.rope_theta)
        return ouro.loop(params, cfg, x, cos, sin, layers.DenseCausal(), None, 0, ops)[0]

    with use_abstract_mesh(H200):
        lowered = jax.jit(one_loop).trace(params, jax.ShapeDtypeStruct((8, cfg.hidden_size), BF16))
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    fills = _int32_fills(text)
    assert cfg.num_layers == 2 and "loopjax_persistent_mlp" in text
    assert len(fills) == 1 and f"-> tensor<{pm.NUM_COUNTERS}xi32>" in fills[0]


def _mlp_args(m, h, f):
    x, w_gate_up, w_down = _inputs(m, h, f)
    residual = jax.random.normal(jax.random.PRNGKey(9), (m, h), F32).astype(BF16)
    norms = [(1 + 0.1 * jax.random.normal(jax.random.PRNGKey(s), (h,), F32)).astype(BF16) for s in (1, 2)]
    return x, w_gate_up, w_down, residual, *norms, 1e-6


def _mlp(ops, args):
    # NOTE: no excess precision (XLA on CPU would keep some bf16 roundings in f32)
    return jax.jit(ops.mlp_norm_add_norm, static_argnums=6,
                   compiler_options=layers.IDENTITY_COMPILER_OPTIONS)(*args)


def test_mlp_op_composes_the_two_ops_it_replaces(monkeypatch):
    """Every Ops' mlp_norm_add_norm is its linear_silu_mul then its linear_norm_add_norm (the
    same numbers, bitwise), equal across calls (a static jit argument); 'persistent' on a GPU
    runs the persistent kernel up to 64 rows, here in its interpreter: bitwise the XLA ops."""
    args = _mlp_args(3, 128, 256)

    def composed(ops, *a):
        act = ops.linear_silu_mul(a[0], a[1])
        return ops.linear_norm_add_norm(act, *a[2:6], a[6])

    def same_ops(ops):  # the branch traces to exactly the two ops' jaxpr
        branch = jax.make_jaxpr(ops.mlp_norm_add_norm, static_argnums=6)(*args)
        return str(branch) == str(jax.make_jaxpr(functools.partial(composed, ops), static_argnums=6)(*args))

    assert layers.XLA_OPS.fused_mlp is None and same_ops(layers.XLA_OPS)
    want = jax.jit(functools.partial(composed, layers.XLA_OPS), static_argnums=6,
                   compiler_options=layers.IDENTITY_COMPILER_OPTIONS)(*args)
    for got, w in zip(_mlp(layers.XLA_OPS, args), want, strict=True):
        assert jnp.array_equal(got, w)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for name in ("auto", "streaming", "persistent"):
        ops = mo.matmul_ops(name)
        assert mo.matmul_ops(name) == ops and hash(ops) == hash(mo.matmul_ops(name)), name
        if name != "persistent":
            assert ops.fused_mlp is None and same_ops(ops), name
    for name in ("auto", "persistent"):  # pointwise 'pallas': plain products, kernel pointwise
        pallas = with_pointwise(mo.matmul_ops(name), "pallas")
        assert pallas.fused_mlp is None and same_ops(pallas), name
    persistent = mo.matmul_ops("persistent")
    jaxpr = str(jax.make_jaxpr(persistent.mlp_norm_add_norm, static_argnums=6)(*args))
    assert "loopjax_persistent_mlp" in jaxpr
    big = _mlp_args(65, 128, 256)  # past 64 rows: 'auto''s composition
    assert "loopjax_persistent_mlp" not in str(jax.make_jaxpr(persistent.mlp_norm_add_norm,
                                                              static_argnums=6)(*big))
    monkeypatch.undo()  # the interpreter runs the kernel's three phases on this CPU: bitwise
    args = _mlp_args(20, 192, 256)  # other shapes than traced above (jit's trace cache)
    for g, t in zip(_mlp(persistent, args), _mlp(layers.XLA_OPS, args), strict=True):
        assert g.shape == t.shape and jnp.array_equal(g, t)


def test_probe_smoke(tmp_path):
    from loopjax.bench.probes import persistent_mlp_check

    out = tmp_path / "pmlp.json"
    assert persistent_mlp_check.main(["--smoke", "--rows", "1", "--out", str(out)]) == 0
    import json
    arms = [r["arm"] for r in json.loads(out.read_text())["records"]]
    assert arms == ["triton", "two_kernels"]


def test_norms_prologue_probe_smoke(tmp_path):
    """bench/probes/norms_prologue.py in the interpreter: both arms run, the fused op's h and act
    match the unfused ops'."""
    import json

    from loopjax.bench.probes import norms_prologue

    out = tmp_path / "np.json"
    arms = "unfused,fused@t2"
    assert norms_prologue.main(["--smoke", "--rows", "1", "--arms", arms, "--out", str(out)]) == 0
    records = {r["arm"]: r for r in json.loads(out.read_text())["records"]}
    assert list(records) == arms.split(",")
    assert records["fused@t2"]["h_diff"] == 0 and records["fused@t2"]["act_diff"] < 1e-2
