"""The decode products on Mosaic GPU kernels (matmul_ops.MOSAIC_ROWS). Ouro's qkv product +
RoPE (kernels/streaming_matmul_rope_mgpu.py): the interpreted kernel bitwise against the twin
(exact products, so any summation order gives the twin's product), ring slots fewer than K
steps and x loaded once or per tile, the shapes it refuses, the CUDA lowering on this CPU host
at Ouro-1.4B's shapes (one kernel), the matmul_ops dispatch and the probe's --smoke run. An
Ouro loop with all three Mosaic ops (qkv + RoPE, SiLU*up, the norms' partials) against XLA's."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import use_abstract_mesh
from test_streaming_matmul_rope import _inputs, _same, _twin

from loopjax import layers
from loopjax import matmul_ops as mo
from loopjax.config import preset
from loopjax.kernels import streaming_matmul_rope_mgpu as smrm
from loopjax.layers import IDENTITY_COMPILER_OPTIONS, DenseCausal, rope_angles
from loopjax.models import ouro

BF16, F32 = jnp.bfloat16, jnp.float32
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))


@pytest.mark.parametrize("m, k, block_k, stages", [
    (8, 128, 64, None),  # x's K range loaded once; 2 K steps in 2 slots
    (32, 384, 128, 2),  # x per tile; 3 K steps through 2 slots (a slot refilled)
    (3, 256, 128, None),  # 3 rows padded to 8: cos, sin and the outputs through shared memory
])
def test_matches_twin_bitwise(m, k, block_k, stages):
    heads = dict(num_heads=2, num_kv_heads=1)  # GQA: 2 q heads, 1 k, 1 v -> 4 programs
    x, w, cos, sin = _inputs(m, k, 2, 1, 128, BF16, exact=True)
    got = smrm.streaming_matmul_rope_qkv_mgpu(x, w, cos, sin, **heads, block_k=block_k,
                                              num_stages=stages, interpret=True)
    _same(got, _twin(smrm.ref_streaming_matmul_rope_qkv, **heads)(x, w, cos, sin))
    assert not np.array_equal(np.asarray(got[1], F32), np.asarray(got[2], F32))  # k was rotated


def test_shape_problems():
    x, w, cos, sin = _inputs(8, 128, 2, 1, 128, BF16, exact=True)
    assert smrm.shape_problem(x, w, 2, 1) is None
    x20 = jnp.zeros((20, 128), BF16)
    assert smrm.shape_problem(x[:3], w, 2, 1) is None
    assert "1-8 rows or a multiple of 8" in smrm.shape_problem(x20, w, 2, 1)
    assert "1-8 rows or a multiple of 8" in smrm.shape_problem(jnp.zeros((72, 128), BF16), w, 2, 1)
    assert "bfloat16/float16" in smrm.shape_problem(x.astype(F32), w.astype(F32), 2, 1)
    x64, w64, cos64, sin64 = _inputs(8, 128, 2, 1, 64, BF16, exact=True)
    assert "head_dim 128" in smrm.shape_problem(x64, w64, 2, 1)
    assert "block_k" in smrm.shape_problem(x, w, 2, 1, block_k=32)
    x192, w192 = _inputs(8, 192, 2, 1, 128, BF16, exact=True)[:2]  # K = 192: not the default's 128s
    assert "block_k" in smrm.shape_problem(x192, w192, 2, 1)
    assert smrm.shape_problem(x192, w192, 2, 1, block_k=64) is None
    with pytest.raises(ValueError, match="head_dim 128"):
        smrm.streaming_matmul_rope_qkv_mgpu(x64, w64, cos64, sin64, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="cos must be"):
        smrm.streaming_matmul_rope_qkv_mgpu(x, w, cos[:, :32], sin, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("m, block_k", [(1, 128), (8, 64), (32, 128)])
def test_lowers_for_cuda(m, block_k):
    """Ouro-1.4B's wqkv: one Mosaic GPU kernel (its layouts are checked when it lowers)."""
    from loopjax.bench.warmup_probe import mosaic_kernels

    args = [jax.ShapeDtypeStruct(s, dt) for s, dt in
            (((m, 2048), BF16), ((2048, 6144), BF16), ((m, 64), F32), ((m, 64), F32))]
    fn = functools.partial(smrm.streaming_matmul_rope_qkv_mgpu, num_heads=16, num_kv_heads=16,
                           block_k=block_k, interpret=False)
    with use_abstract_mesh(H200):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert mosaic_kernels(text)[0] == 1 and "loopjax_streaming_matmul_rope_mgpu" in text


@pytest.mark.parametrize("m", [8, 64])
def test_silu_mul_and_partials_lower_for_cuda(m):
    """Ouro-1.4B's w_gate_up on persistent_mlp's phase 1 alone and wo / w_down's swapped
    partials: one Mosaic GPU kernel each, no semaphores (nothing for XLA to zero-fill)."""
    from loopjax.bench.warmup_probe import mosaic_kernels
    from loopjax.kernels import persistent_mlp as pm
    from loopjax.kernels import streaming_matmul_swapped as sms

    partials = functools.partial(sms.swapped_partials, interpret=False)
    cases = [(functools.partial(pm.silu_mul_product, interpret=False), (2048, 11264)),
             (partials, (2048, 2048)), (partials, (5632, 2048))]
    for fn, w_shape in cases:
        args = [jax.ShapeDtypeStruct((m, w_shape[0]), BF16), jax.ShapeDtypeStruct(w_shape, BF16)]
        with use_abstract_mesh(H200):
            text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        # x and w are the kernel's only operands: no zero-filled semaphore buffer beside them
        assert mosaic_kernels(text)[0] == 1 and "@mosaic_gpu_v2(%arg0, %arg1)" in text, w_shape


def test_matmul_ops_dispatch(monkeypatch):
    """streaming_linear_rope_qkv takes the Mosaic kernel at MOSAIC_ROWS' rows where it takes
    the shapes (the same numbers), the Triton kernel elsewhere."""
    heads = dict(num_heads=2, num_kv_heads=1)
    x, w, cos, sin = _inputs(8, 128, 2, 1, 128, BF16, exact=True)

    def kernels(x, cos, sin):
        text = str(jax.make_jaxpr(functools.partial(mo.streaming_linear_rope_qkv, **heads))(x, w, cos, sin))
        return "loopjax_streaming_matmul_rope_mgpu" in text, "loopjax_streaming_matmul_rope" in text

    assert 8 in mo.MOSAIC_ROWS["linear_rope_rotate_half_qkv"]
    assert kernels(x, cos, sin) == (True, True)  # NOTE: the Triton name is a prefix of the Mosaic one
    _same(mo.streaming_linear_rope_qkv(x, w, cos, sin, **heads),
          _twin(smrm.ref_streaming_matmul_rope_qkv, **heads)(x, w, cos, sin))
    assert kernels(x[:3], cos[:3], sin[:3]) == (False, True)  # 3 rows: not in the table
    monkeypatch.setattr(mo, "MOSAIC_ROWS", {})
    assert kernels(x, cos, sin) == (False, True)


def test_probe_smoke(capsys):
    """bench/probes/rope_qkv_chain.py --smoke in the interpreter: both RoPE kernels equal the
    twin, and the plain product arm (no RoPE) runs with its tiling from the arm's name, at 2:1
    heads (--heads)."""
    from loopjax.bench.probes import rope_qkv_chain

    arms = ["triton", "mgpu@k64t2", "mm@n64k64t2s1"]
    assert rope_qkv_chain.main(["--smoke", "--rows", "8", "--heads", "2:1", "--arms", ",".join(arms)]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("rows")]
    assert [(words[3], words[4]) for words in lines] == [("2:1", arm) for arm in arms]
    diffs = [float(words[-1]) for words in lines]
    assert diffs[0] < 1e-2 and diffs[1] < 1e-2 and diffs[2] > 0.1  # mm: q, k not rotated
    assert rope_qkv_chain.arm_op("mm@n64k64t2s1").keywords == dict(block_n=64, block_k=64, num_stages=2,
                                                                   split_k=1)


def test_l2_prefetch_probe_lowers_for_cuda():
    """bench/probes/l2_prefetch_probe.py's chains lower for an H200 on this host: in the prefetch
    arm one Mosaic kernel (a lowering shared by every site) before each product, none in the
    plain arm (a kernel with no output must not be dropped as dead code)."""
    import re

    from loopjax.bench.probes import l2_prefetch_probe as probe

    x = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16)
    ws = [jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)] * 3

    def lowered(mode):
        fn = functools.partial(probe.chain, mode=mode, num_programs=4)
        with use_abstract_mesh(H200):
            return jax.jit(fn).trace(x, ws).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered("prefetch")
    assert len(set(re.findall(r'kernel_hash = "([^"]*)"', text))) == 1
    assert text.count("call @l2_prefetch") == 3 and text.count("dot_general") == 3
    assert "mosaic_gpu" not in lowered("plain")


def test_ouro_loop_on_the_mosaic_ops(monkeypatch):
    """One Ouro loop at 8 rows, bf16, D = 128, on matmul 'streaming' with every Mosaic op
    (interpret mode): each layer runs the qkv + RoPE kernel, the SiLU*up kernel and two
    swapped-product partials (wo, w_down) into the norms kernel, and the loop matches XLA's
    products up to bf16 rounding of different summation orders."""
    cfg = dataclasses.replace(preset("ouro-tiny"), hidden_size=128, head_dim=128, num_heads=2,
                              num_kv_heads=2)
    params = ouro.init_params(cfg, jax.random.key(0), BF16)
    x = jax.random.normal(jax.random.key(1), (8, cfg.hidden_size), F32).astype(BF16)
    cos, sin = rope_angles(jnp.arange(8) + 3, cfg.head_dim, cfg.rope_theta)

    def loop(params, x, ops):
        return ouro.loop(params, cfg, x, cos, sin, DenseCausal(), None, 0, ops)[0]

    rows = frozenset({8})
    monkeypatch.setattr(mo, "MOSAIC_ROWS", dict.fromkeys(mo.MOSAIC_OPS, rows))
    ops = mo.matmul_ops("streaming")
    jaxpr = jax.make_jaxpr(functools.partial(loop, ops=ops))(params, x).jaxpr
    counts = {}
    _count_kernels(jaxpr, counts)
    assert counts == {"loopjax_streaming_matmul_rope_mgpu": cfg.num_layers,
                      "loopjax_persistent_mlp": cfg.num_layers,
                      "loopjax_streaming_matmul_swapped": 2 * cfg.num_layers,
                      "loopjax_norm_add_norm": 2 * cfg.num_layers}, counts
    got = jax.jit(functools.partial(loop, ops=ops), compiler_options=IDENTITY_COMPILER_OPTIONS)(params, x)
    want = jax.jit(functools.partial(loop, ops=layers.XLA_OPS),
                   compiler_options=IDENTITY_COMPILER_OPTIONS)(params, x)
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want, F32), rtol=0.05, atol=0.05)


def _count_kernels(jaxpr, counts: dict) -> None:
    """counts[kernel name] += each Pallas kernel call a jaxpr makes (each call of a nested jit)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("pallas_call", "mpmd_map"):  # Triton / Mosaic GPU kernels
            name = str(eqn.params["name"])
            counts[name] = counts.get(name, 0) + 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _count_kernels(sub, counts)
