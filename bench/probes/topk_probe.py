"""Probe: what the top logprobs cost the full sampler, `jax.lax.top_k(x, k)` over [R, V] f32
logits for the k a server allows (EngineConfig.max_logprobs), against the sampler's two-stage
`sampling.top_k` (forced for every k here: the top k of each 1,024-wide chunk, then of those
candidates). Prints µs per call, whether the compiled HLO sorts, and whether the two agree
(values and ids, ties to the lower id).

    python -m loopjax.bench.probes.topk_probe
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import sampling
from loopjax.bench.common import patched, pipelined_us

SHAPES = ((1, 49152), (32, 49152), (128, 49152), (8, 65536), (32, 65536))
KS = (1, 5, 16, 20)


def two_stage_top_k(x, k: int):
    with patched(sampling, TWO_STAGE_MIN_K=0):
        return sampling.top_k(x, k)


def main():
    print(f"top-k probe on {jax.devices()[0].device_kind}")
    for r, v in SHAPES:
        x = jnp.round(jax.random.normal(jax.random.key(r + v), (r, v), jnp.float32) * 64) / 16  # with ties
        for k in KS:
            fns = {"lax": jax.jit(lambda a, k=k: jax.lax.top_k(a, k)),
                   "two_stage": jax.jit(lambda a, k=k: two_stage_top_k(a, k))}
            sorts = {name: "sort(" in fn.lower(x).compile().as_text() for name, fn in fns.items()}
            got = {name: jax.device_get(fn(x)) for name, fn in fns.items()}
            same = all(np.array_equal(a, b) for a, b in zip(got["lax"], got["two_stage"]))
            times = {name: pipelined_us(functools.partial(fn, x)) for name, fn in fns.items()}
            print(f"[{r:>4}, {v}] k {k:>2}  lax {times['lax']:8.1f} us (sort {sorts['lax']})   "
                  f"two-stage {times['two_stage']:8.1f} us (sort {sorts['two_stage']})   equal {same}",
                  flush=True)


if __name__ == "__main__":
    main()
