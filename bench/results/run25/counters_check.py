"""Run 25 call 3: the persistent MLP kernel synchronizing through one counters Ref for many
calls (kernels/persistent_mlp.py) on the H200, at Ouro-1.4B's shapes, 1 / 8 / 32 rows.

- One call against the XLA twin (layers.mlp_norm_add_norm): max |difference| / max |value|.
- 4 loops x 24 calls in a jitted fori_loop, as ouro.loop runs them (one new_counters() Ref per
  loop, shared by its 24 calls), against the same chain with a new Ref per call: the outputs
  must be bitwise equal, the counters zero after every loop, and the chain repeat-identical.
- µs per call of both chains (the per-call Ref is a zero-fill per call, as Pallas's own
  global semaphores were).

    python3 bench/results/run25/counters_check.py [ROWS ...]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import layers
from loopjax.kernels import persistent_mlp as pm

H, F, LAYERS, LOOPS, EPS = 2048, 5632, 24, 4, 1e-6
BF16 = jnp.bfloat16


def chain_fn(weights, norms, shared: bool):
    def run(x, residual):
        def one_loop(_, carry):
            x, residual, counts = carry
            counters = pm.new_counters() if shared else None
            for w_gate_up, w_down in weights:
                residual, x = pm.persistent_mlp_norm_add_norm(x, w_gate_up, w_down, residual, *norms, EPS,
                                                              counters)
            left = jnp.sum(jnp.abs(counters[...])) if shared else jnp.int32(0)
            return x, residual, counts + left
        return jax.lax.fori_loop(0, LOOPS, one_loop, (x, residual, jnp.int32(0)))
    return jax.jit(run)


def main() -> int:
    print(f"counters check on {jax.devices()[0].device_kind}", flush=True)
    keys = jax.random.split(jax.random.key(0), 2 * LAYERS + 2)
    weights = [((jax.random.normal(keys[2 * i], (H, 2 * F)) * H**-0.5).astype(BF16),
                (jax.random.normal(keys[2 * i + 1], (F, H)) * F**-0.5).astype(BF16)) for i in range(LAYERS)]
    norms = [(1 + 0.1 * jax.random.normal(keys[-1 - i], (H,))).astype(BF16) for i in range(2)]
    status = 0
    for rows in [int(r) for r in sys.argv[1:]] or (1, 8, 32):
        x = jax.random.normal(jax.random.key(rows), (rows, H)).astype(BF16)
        residual = jax.random.normal(jax.random.key(100 + rows), (rows, H)).astype(BF16)
        one = jax.jit(lambda x, r: pm.persistent_mlp_norm_add_norm(x, *weights[0], r, *norms, EPS))(
            x, residual)
        twin = jax.jit(lambda x, r: layers.mlp_norm_add_norm(x, *weights[0], r, *norms, EPS))(x, residual)
        rel = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
                     jnp.max(jnp.abs(b.astype(jnp.float32)))) for a, b in zip(one, twin)]
        arms = {name: chain_fn(weights, norms, shared)
                for name, shared in (("shared", True), ("per_call", False))}
        outs = {name: [jax.device_get(fn(x, residual)) for _ in range(3)] for name, fn in arms.items()}
        same = all(np.array_equal(a, b) for a, b in zip(outs["shared"][0][:2], outs["per_call"][0][:2]))
        repeat = all(np.array_equal(o[0], outs["shared"][0][0]) for o in outs["shared"])
        left = [int(o[2]) for o in outs["shared"]]
        times = {}
        for name, fn in arms.items():
            jax.block_until_ready(fn(x, residual))
            start = time.perf_counter()
            for _ in range(10):
                out = fn(x, residual)
            jax.block_until_ready(out)
            times[name] = (time.perf_counter() - start) / 10 / (LAYERS * LOOPS) * 1e6
        ok = max(rel) < 2e-2 and same and repeat and not any(left)
        status |= 0 if ok else 1
        print(f"rows {rows:2d}: one call vs twin max|diff|/max|out| h {rel[0]:.2e} normed {rel[1]:.2e}; "
              f"shared Ref vs a Ref per call bitwise {same}; repeat-identical {repeat}; counters left "
              f"{left}; us per call shared {times['shared']:.2f} per-call Ref {times['per_call']:.2f}: "
              f"{'ok' if ok else 'MISMATCH'}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
