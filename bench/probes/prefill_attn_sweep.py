"""Probe: the Triton prefill attention's block sizes at the real prompt shapes (4 x 512 new
tokens, page size 16), each checked against the XLA twin; µs per call and TFLOP/s (causal).

    python -m loopjax.bench.probes.prefill_attn_sweep [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools

import jax
import jax.numpy as jnp

from loopjax.bench.kernels import MODELS, SMOKE_MODELS, _pool_case, device_time

pa = importlib.import_module("loopjax.kernels.prefill_attention")
CONFIGS = [dict(block_q=bq, block_k=bk, num_warps=w, num_stages=st)
           for bq, bk, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    interpret = args.smoke
    models = SMOKE_MODELS if args.smoke else MODELS
    rows, new = (2, 32) if args.smoke else (4, 512)
    configs = [dict(block_q=16, block_k=16, num_warps=4, num_stages=2)] if args.smoke else CONFIGS
    for model, (hq, hkv, d, *_) in models.items():
        key = jax.random.key(7)
        kc, vc, pt = _pool_case(key, hkv, d, rows, new, 16, jnp.bfloat16)
        q = jax.random.normal(jax.random.fold_in(key, 1), (rows * new, hq, d), jnp.bfloat16)
        row_of_token = jnp.repeat(jnp.arange(rows, dtype=jnp.int32), new)
        pos = jnp.tile(jnp.arange(new, dtype=jnp.int32), rows)
        call = (q, kc, vc, jnp.int32(1), pt, row_of_token, pos)
        want = jax.jit(pa.ref_prefill_attention)(*call).astype(jnp.float32)
        flops = 4 * rows * hq * d * new * (new + 1) / 2
        for cfg in configs:
            kern = functools.partial(pa.prefill_attention, interpret=interpret, **cfg)
            try:
                err = float(jnp.max(jnp.abs(jax.jit(kern)(*call).astype(jnp.float32) - want)))
                sec = device_time(kern, call, 3 if args.smoke else 50)
                print(f"{model:<12} {rows}x{new} {cfg}  {sec * 1e6:8.1f} us  "
                      f"{flops / sec / 1e12:6.1f} TFLOP/s  max_err {err:.2e}", flush=True)
            except Exception as e:  # noqa: BLE001 - one failing config must not end the sweep
                print(f"{model:<12} {cfg}  ERROR {type(e).__name__}: {str(e).splitlines()[0][:150]}",
                      flush=True)


if __name__ == "__main__":
    main()
