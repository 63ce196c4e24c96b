"""Run 26 call 2 (ad hoc, not a loopjax probe): can a Mosaic GPU GEMM beat XLA's at the
prefill MLP's first product? jax's own example kernel (jax.experimental.pallas.ops.gpu.
hopper_matmul_mgpu, imported from the installed jax, not copied) at Ouro-1.4B's [2048, 2048] x
[2048, 11264], over 8 weights per call as tiled_silu_probe does, against XLA's dot (bf16 out)."""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm

from loopjax import layers
from loopjax.bench.common import pipelined_us

W = 8
for name, (m, k, n) in {"ouro": (2048, 2048, 11264)}.items():
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    ws = [(jax.random.normal(jax.random.key(i + 1), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
          for i in range(W)]
    flops = 2 * m * k * n
    xla = jax.jit(lambda x, ws: [layers.linear_in_dtype(x, w) for w in ws])
    want = xla(x, ws)[0]
    us = pipelined_us(functools.partial(xla, x, ws), iters=10) / W
    print(f"{name} xla {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s", flush=True)
    for tm_, tn, tk, steps, minor, width, wg in itertools.product(
            (128,), (128, 64), (64,), (4, 5), (hm.MatmulDimension.M, hm.MatmulDimension.N), (4, 8, 16),
            (hm.MatmulDimension.M, hm.MatmulDimension.N)):
        cfg = hm.TuningConfig(tile_m=tm_, tile_n=tn, tile_k=tk, max_concurrent_steps=steps,
                              grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
        try:
            f = jax.jit(lambda x, ws, cfg=cfg: [hm.matmul(x, w, None, cfg) for w in ws])
            got = f(x, ws)[0]
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
            us = pipelined_us(functools.partial(f, x, ws), iters=10) / W
            print(f"{name} mgpu {tm_}/{tn}/{tk} steps {steps} minor {minor} width {width} wg {wg}: "
                  f"{us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s max|diff| {err:.3g}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{name} mgpu {tm_}/{tn}/{tk} {steps} {minor} {width} {wg}: "
                  f"FAILED {str(e).splitlines()[0][:120]}")
