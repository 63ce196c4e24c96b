"""Probe: what the step's sampler costs at decode rows, and what a 16-bit sort would save.
µs per call (jitted loop): `sample` as the step runs it (bf16 logits cast to f32), its greedy
part alone (argmax + logsumexp), `sort_descending` of f32, and a descending sort of the bf16
logits' 16-bit order keys (whether XLA hands each to CUB is printed).

    python -m loopjax.bench.probes.sampler_probe [--smoke]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from loopjax.bench.kernels import device_time
from loopjax.sampling import SamplingBatch, sample, sort_descending
from loopjax.sampling_params import SamplingParams


def sort16_descending(x):  # x [R, V] bf16
    bits = jax.lax.bitcast_convert_type(-x, jnp.int16)
    keys = bits ^ ((bits >> 15) & 0x7FFF)
    out = jnp.sort(keys, axis=-1)
    return -jax.lax.bitcast_convert_type(out ^ ((out >> 15) & 0x7FFF), jnp.bfloat16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    vocab, rows_list, iters = (1000, (2,), 2) if args.smoke else (49152, (1, 8, 32, 128), 100)
    for rows in rows_list:
        logits = jax.random.normal(jax.random.key(rows), (rows, vocab), jnp.float32) * 3
        logits = logits.astype(jnp.bfloat16)
        greedy = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * rows, rows, [0] * rows)
        full = lambda x, b=greedy: sample(x.astype(jnp.float32), b, num_top_logprobs=0)[0]  # noqa: E731

        def greedy_only(x):
            xf = x.astype(jnp.float32)
            return jnp.argmax(xf, axis=-1), jax.nn.logsumexp(xf, axis=-1)

        sort32 = lambda x: sort_descending(x.astype(jnp.float32))  # noqa: E731
        same = bool(jnp.array_equal(sort32(logits), sort16_descending(logits).astype(jnp.float32)))
        cub = {name: "cub" in jax.jit(fn).lower(logits).compile().as_text().lower()
               for name, fn in (("sort32", sort32), ("sort16", sort16_descending))}
        cases = (("sample", full), ("greedy_only", greedy_only), ("sort32", sort32),
                 ("sort16", sort16_descending))
        times = {name: device_time(fn, (logits,), iters) * 1e6 for name, fn in cases}
        print(f"rows {rows:>4} V {vocab}: " + "  ".join(f"{k} {v:7.1f} us" for k, v in times.items())
              + f"  cub {cub}  sorts equal {same}", flush=True)


if __name__ == "__main__":
    main()
