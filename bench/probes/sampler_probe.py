"""Probe: what the step's sampler costs at decode rows, and what a 16-bit sort saves.
µs per call (jitted loop): `sample` as the step runs it (bf16 logits; run 16 measured it with
them cast to f32, before the 16-bit sort), the greedy sampler (StepKind.greedy: argmax +
logsumexp), `sort_descending` of f32, and of the bf16 logits' 16-bit order keys (whether XLA
hands each to CUB is printed).

    python -m loopjax.bench.probes.sampler_probe [--smoke]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from loopjax.bench.kernels import device_time
from loopjax.sampling import SamplingBatch, sample, sort_descending
from loopjax.sampling_params import SamplingParams


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    vocab, rows_list, iters = (1000, (2,), 2) if args.smoke else (49152, (1, 8, 32, 128), 100)
    for rows in rows_list:
        normal = jax.random.normal(jax.random.key(rows), (rows, vocab), jnp.float32)
        logits = (normal * 3).astype(jnp.bfloat16)
        greedy = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * rows, rows, [0] * rows)
        full = lambda x, b=greedy: sample(x, b, num_top_logprobs=0)[0]  # noqa: E731
        greedy_only = lambda x, b=greedy: sample(x, b, num_top_logprobs=0, greedy=True)  # noqa: E731
        sort32 = lambda x: sort_descending(x.astype(jnp.float32))  # noqa: E731
        same = bool(jnp.array_equal(sort32(logits), sort_descending(logits).astype(jnp.float32)))
        fns = (("sample", full), ("greedy_only", greedy_only), ("sort32", sort32),
               ("sort16", sort_descending))
        cub = {name: "cub" in jax.jit(fn).lower(logits).compile().as_text().lower()
               for name, fn in fns[2:]}
        times = {name: device_time(fn, (logits,), iters) * 1e6 for name, fn in fns}
        print(f"rows {rows:>4} V {vocab}: " + "  ".join(f"{k} {v:7.1f} us" for k, v in times.items())
              + f"  cub {cub}  sorts equal {same}", flush=True)


if __name__ == "__main__":
    main()
