"""Probe: the sampler's descending sort of [R, V] f32 logits, as `-jnp.sort(-x)` (jax's
NaN-canonicalizing comparator) vs a sort of order-preserving int32 keys (a plain integer
comparator, which XLA:GPU may hand to CUB's radix sort). Prints µs per sort, whether the
compiled HLO calls CUB, and whether the two agree (as float values).

    python -m loopjax.bench.probes.sort_probe
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.bench.common import pipelined_us
from loopjax.sampling import sort_descending

SHAPES = ((8, 49152), (32, 49152), (128, 49152), (32, 65536), (128, 65536))


def sort_desc_float(x):
    return -jnp.sort(-x, axis=-1)


def main():
    print(f"sort probe on {jax.devices()[0].device_kind}")
    for r, v in SHAPES:
        x = jax.random.normal(jax.random.key(r + v), (r, v), jnp.float32) * 4
        fns = {name: jax.jit(fn) for name, fn in (("float", sort_desc_float), ("int_keys", sort_descending))}
        hlo = fns["int_keys"].lower(x).compile().as_text()
        same = bool(np.array_equal(np.asarray(fns["float"](x)), np.asarray(fns["int_keys"](x))))
        times = {name: pipelined_us(functools.partial(fn, x)) for name, fn in fns.items()}
        print(f"[{r:>4}, {v}]  float {times['float']:8.1f} us   int keys {times['int_keys']:8.1f} us   "
              f"cub {'cub' in hlo.lower()}   equal {same}", flush=True)


if __name__ == "__main__":
    main()
