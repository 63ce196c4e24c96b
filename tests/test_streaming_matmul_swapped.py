"""The Mosaic ring matmul (kernels/streaming_matmul_swapped.py): its Mosaic GPU CPU interpreter
vs the XLA twin (rows past M, K splits, more tiles than ring slots, swapped or not), bad inputs,
its default configurations at the real shapes, the kernel lowered for CUDA on this CPU host
(an ordinary launch: no `uses_pdl`), and the chain probe's --smoke run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.mesh import AbstractDevice, AbstractMesh
from jax.sharding import use_abstract_mesh

from loopjax import layers
from loopjax.kernels import streaming_matmul_swapped as sms

BF16, F32 = jnp.bfloat16, jnp.float32
REAL_SHAPES = [(2048, 6144), (2048, 2048), (2048, 11264), (5632, 2048), (5280, 5280), (17920, 5280)]


def _inputs(m, k, n, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), F32).astype(BF16)
    w = (jax.random.normal(kw, (k, n), F32) / np.sqrt(k)).astype(BF16)
    return x, w


@pytest.mark.parametrize("m, k, n, blocks", [
    (1, 512, 128, dict(swap_ab=False, split_k=2, num_stages=2)),  # 4 tiles per program, 2 slots
    (8, 256, 256, dict(swap_ab=False, block_n=128, num_stages=3)),  # 128-column tiles; 4 tiles, 3 slots
    (64, 256, 128, dict(swap_ab=False)),  # a full row block, default configuration
    (8, 1024, 64, dict(swap_ab=False, num_stages=3)),  # x per tile (its K range exceeds X_ONCE_BYTES)
    (1, 512, 128, dict(swap_ab=True, split_k=2, num_stages=2)),  # swapped: x in 8 rows
    (20, 256, 192, dict(swap_ab=True, split_k=2)),  # swapped: 20 rows padded to 32
    (32, 2048, 64, dict(swap_ab=True, num_stages=4)),  # swapped, x per tile
])
def test_matches_ref(m, k, n, blocks):
    x, w = _inputs(m, k, n)
    out = sms.streaming_matmul_swapped(x, w, interpret=True, **blocks)
    ref = layers.linear(x, w)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    # fp32 accumulation rounded once on both sides; the summation order may flip a last bit
    np.testing.assert_allclose(np.asarray(out, F32), np.asarray(ref, F32), rtol=2 ** -7, atol=1e-3)
    assert np.mean(np.asarray(out, F32) == np.asarray(ref, F32)) > 0.9


def test_bad_inputs_and_default_configs():
    x, w = _inputs(3, 96, 64)
    for args, kw, match in [((x.astype(F32), w.astype(F32)), {}, "bfloat16/float16"),
                            ((x, w), dict(block_k=64), "must divide"),  # 96 = 1.5 tiles of 64
                            ((x, w[:64]), {}, "disagree on K"),
                            ((jnp.zeros((65, 128), BF16), jnp.zeros((128, 64), BF16)), {},
                             "at most 64 rows"),
                            ((x, jnp.zeros((96, 128), BF16)), dict(block_n=128), "swap_ab takes")]:
        with pytest.raises(ValueError, match=match):
            sms.streaming_matmul_swapped(*args, interpret=True, **kw)
    for k, n in REAL_SHAPES:
        for m in (1, 32, 64):
            cfg = sms.default_config(m, k, n)
            assert k % (cfg.block_k * cfg.split_k) == 0 and n % cfg.block_n == 0, (k, n, cfg)
            tiles = k // cfg.block_k
            assert (n // cfg.block_n) * cfg.split_k >= 128 or cfg.split_k == max(
                d for d in range(1, 17) if tiles % d == 0)
            stage_bytes = 2 * (cfg.block_k * cfg.block_n + sms.ROWS * cfg.block_k)
            assert 2 * cfg.num_stages * stage_bytes <= sms.SMEM_BUDGET  # two programs per SM


H200 = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice("NVIDIA H200", 132, "gpu"))


@pytest.mark.parametrize("swap_ab", [True, False])
def test_lowers_for_cuda(swap_ab):
    """Ouro-1.4B's w_down at 1 row (4 K splits), lowered for the H200; an ordinary launch (the
    PDL path is gone: no `uses_pdl`, which would launch it with programmatic serialization)."""
    args = [jax.ShapeDtypeStruct(s, BF16) for s in ((1, 5632), (5632, 2048))]
    fn = functools.partial(sms.streaming_matmul_swapped, swap_ab=swap_ab, interpret=False)
    with use_abstract_mesh(H200):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "loopjax_streaming_matmul_swapped" in text
    assert "uses_pdl" not in text


def test_probe_smoke(tmp_path):
    from loopjax.bench.probes import product_chain

    out = tmp_path / "chain.json"
    assert product_chain.main(["--smoke", "--rows", "1", "--chains", "wo", "--arms", "xla,swapped",
                               "--out", str(out)]) == 0
    import json
    records = json.loads(out.read_text())["records"]
    assert [r["arm"] for r in records] == ["xla", "swapped"]
    assert records[1]["max_diff_vs_first"] < 0.05
