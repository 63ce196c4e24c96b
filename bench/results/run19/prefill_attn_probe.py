"""Run 19 probe: how fast could Ouro-1.4B's prefill attention be? jax's shipped Mosaic GPU
flash attention (`pallas.ops.gpu.attention_mgpu`, dense [B, T, H, D], causal) and cuDNN's
(`jax.nn.dot_product_attention(implementation='cudnn')`) at 4 x 512 tokens, 16 heads, D 128,
against the engine's Triton prefill kernel (bench/RESULTS.md run 16: 60.7 us standalone)."""
import functools

import jax
import jax.numpy as jnp

from loopjax.bench.kernels import device_time

B, T, H, D = 4, 512, 16, 128
flops = 4 * B * T * T * H * D // 2  # causal
for dtype in (jnp.bfloat16, jnp.float16):
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (B, T, H, D), dtype) for kk in ks)
    ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    arms = {"cudnn": functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")}
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am
        for bq, bkv in ((64, 64), (64, 128), (128, 128)):
            cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=2, causal=True)
            arms[f"mgpu q{bq} kv{bkv}"] = functools.partial(am.attention, config=cfg)
    except Exception as e:  # noqa: BLE001
        print("attention_mgpu import:", type(e).__name__, e)
    for name, fn in arms.items():
        try:
            out = jax.jit(fn)(q, k, v)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            sec = device_time(jax.jit(fn), (q, k, v), 50)
            print(f"{jnp.dtype(dtype).name:9} {name:18} {sec * 1e6:8.1f} us "
                  f"{flops / sec / 1e12:6.1f} TFLOP/s max_err {err:.3g}")
        except Exception as e:  # noqa: BLE001
            print(f"{jnp.dtype(dtype).name:9} {name:18} ERROR {type(e).__name__}: "
                  f"{str(e).splitlines()[0][:150]}")
