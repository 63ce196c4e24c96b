"""Ouro's qkv product + RoPE on Mosaic GPU (kernels/streaming_matmul_rope_mgpu.py): the
interpreted kernel bitwise against the twin (exact products, so any summation order gives
the twin's product), ring slots fewer than K steps and x loaded once or per tile, the shapes
it refuses, the CUDA lowering on this CPU host at Ouro-1.4B's shapes (one kernel), the
matmul_ops dispatch (MOSAIC_ROPE_ROWS) and the probe's --smoke run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import use_abstract_mesh
from test_streaming_matmul_rope import _inputs, _same, _twin

from loopjax import matmul_ops as mo
from loopjax.kernels import streaming_matmul_rope_mgpu as smrm

BF16, F32 = jnp.bfloat16, jnp.float32
H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))


@pytest.mark.parametrize("m, k, block_k, stages", [
    (8, 128, 64, None),  # x's K range loaded once; 2 K steps in 2 slots
    (32, 384, 128, 2),  # x per tile; 3 K steps through 2 slots (a slot refilled)
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
    assert "M in" in smrm.shape_problem(x[:3], w, 2, 1)
    assert "bfloat16/float16" in smrm.shape_problem(x.astype(F32), w.astype(F32), 2, 1)
    x64, w64, cos64, sin64 = _inputs(8, 128, 2, 1, 64, BF16, exact=True)
    assert "head_dim 128" in smrm.shape_problem(x64, w64, 2, 1)
    assert "block_k" in smrm.shape_problem(x, w, 2, 1, block_k=32)
    with pytest.raises(ValueError, match="head_dim 128"):
        smrm.streaming_matmul_rope_qkv_mgpu(x64, w64, cos64, sin64, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="cos must be"):
        smrm.streaming_matmul_rope_qkv_mgpu(x, w, cos[:, :32], sin, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("m, block_k", [(8, 64), (32, 128)])
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


def test_matmul_ops_dispatch(monkeypatch):
    """streaming_linear_rope_qkv takes the Mosaic kernel at MOSAIC_ROPE_ROWS where it takes
    the shapes (the same numbers), the Triton kernel elsewhere."""
    heads = dict(num_heads=2, num_kv_heads=1)
    x, w, cos, sin = _inputs(8, 128, 2, 1, 128, BF16, exact=True)

    def kernels(x, cos, sin):
        text = str(jax.make_jaxpr(functools.partial(mo.streaming_linear_rope_qkv, **heads))(x, w, cos, sin))
        return "loopjax_streaming_matmul_rope_mgpu" in text, "loopjax_streaming_matmul_rope" in text

    assert 8 in mo.MOSAIC_ROPE_ROWS
    assert kernels(x, cos, sin) == (True, True)  # NOTE: the Triton name is a prefix of the Mosaic one
    _same(mo.streaming_linear_rope_qkv(x, w, cos, sin, **heads),
          _twin(smrm.ref_streaming_matmul_rope_qkv, **heads)(x, w, cos, sin))
    assert kernels(x[:3], cos[:3], sin[:3]) == (False, True)  # 3 rows: not a Mosaic row count
    monkeypatch.setattr(mo, "MOSAIC_ROPE_ROWS", frozenset())
    assert kernels(x, cos, sin) == (False, True)


def test_probe_smoke():
    from loopjax.bench.probes import rope_qkv_chain

    assert rope_qkv_chain.main(["--smoke", "--rows", "8", "--arms", "triton,mgpu@k64t2"]) == 0
