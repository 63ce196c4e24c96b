"""Probe: a product kernel's cost in a chain of products, ramps and tails included.
Chains of Ouro-1.4B's products over 24 layers of distinct weights x --loops loops (4; one jitted
`fori_loop`, layers unrolled, as the decode step runs them), with each product backend:
'xla' (layers.linear), 'triton' (streaming_matmul), 'mgpu' (streaming_matmul_mgpu),
'swapped' / 'unswapped' (streaming_matmul_swapped with / without swap_ab). Its PDL arms
(runs 17, 29, 30: the early launch does nothing under XLA) went with the kernel's PDL path.
Chains: 'wo' (x <- x @ wo, [2048, 2048]) and 'mlp' (x <- SiLU(x @ wg) * (x @ wu) @ wd).
Prints µs per layer application and % of the copy rate; each arm's result against the first
arm's (max |diff| / max |ref|).

    python -m loopjax.bench.probes.product_chain --rows 1,8,32 [--trace DIR]
    python -m loopjax.bench.probes.product_chain --smoke
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import layers
from loopjax.bench.common import error_text, ints, names, tile_spec, time_calls, write_json
from loopjax.bench.matmul import COPY_RATE_REF
from loopjax.bench.trace_summary import trace_runs
from loopjax.kernels.streaming_matmul import streaming_matmul
from loopjax.kernels.streaming_matmul_mgpu import streaming_matmul_mgpu
from loopjax.kernels.streaming_matmul_swapped import streaming_matmul_swapped

ARMS = {"xla": layers.linear, "triton": streaming_matmul, "mgpu": streaming_matmul_mgpu,
        "swapped": streaming_matmul_swapped,
        "unswapped": functools.partial(streaming_matmul_swapped, swap_ab=False)}


def arm_product(arm: str):
    """An ARMS name; 'unswapped@n128k64s2t6' (block_n 128, block_k 64, split_k 2, 6 stages;
    any subset) for a configuration of the Mosaic ring kernel ('swapped@...' takes block_n 64)."""
    name, _, spec = arm.partition("@")
    return functools.partial(ARMS[name], **tile_spec(spec)) if spec else ARMS[name]


def chain_fn(product, chain: str, num_loops: int):
    """(x [M, H], weights: per layer (w,) or (w_gate_up, w_down)) -> x after num_loops passes."""
    def run(x, weights):
        def one_loop(_, x):
            for ws in weights:
                if chain == "wo":
                    x = product(x, ws[0])
                else:
                    gate, up = jnp.split(product(x, ws[0]), 2, axis=-1)
                    x = product((jax.nn.silu(gate.astype(jnp.float32)) * up).astype(x.dtype), ws[1])
            return x
        return jax.lax.fori_loop(0, num_loops, one_loop, x)
    return jax.jit(run)


def make_weights(chain: str, hidden: int, inter: int, num_layers: int, dtype, seed: int = 0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 2 * num_layers)
    def w(key, k, n):
        return (jax.random.normal(key, (k, n), jnp.float32) * k**-0.5).astype(dtype)
    if chain == "wo":
        return [(w(keys[i], hidden, hidden),) for i in range(num_layers)]
    return [(w(keys[2 * i], hidden, 2 * inter), w(keys[2 * i + 1], inter, hidden))
            for i in range(num_layers)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=ints, default=[1, 8, 32])
    parser.add_argument("--arms", type=names, default=list(ARMS))
    parser.add_argument("--chains", type=names, default=["wo", "mlp"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--loops", type=int, default=4, help="passes over the 24 layers per call")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None, help="also trace 2 runs per case under this folder")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    args = parser.parse_args(argv)
    hidden, inter, num_layers, num_loops = (256, 512, 1, 1) if args.smoke else (2048, 5632, 24, args.loops)
    iters = 1 if args.smoke else args.iters
    records, status = [], 0
    for chain in args.chains:
        weights = make_weights(chain, hidden, inter, num_layers, jnp.bfloat16)
        layer_bytes = sum(int(np.prod(w.shape)) * 2 for w in weights[0])
        for rows in args.rows:
            x = (jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)) * 0.5).astype(jnp.bfloat16)
            reference = None
            for arm in args.arms:
                fn = chain_fn(arm_product(arm), chain, num_loops)
                try:
                    out = np.asarray(fn(x, weights), np.float32)
                    if reference is None:
                        reference = out
                    diff = float(np.max(np.abs(out - reference)) / (np.max(np.abs(reference)) or 1.0))
                    seconds = float(np.median(time_calls(functools.partial(fn, x, weights), iters)))
                except Exception as e:  # noqa: BLE001 - one failing arm must not hide the others
                    print(f"{chain:4s} rows {rows:3d} {arm:16s} FAILED {error_text(e)}", flush=True)
                    status = 1
                    continue
                if args.trace:
                    run = functools.partial(fn, x, weights)
                    trace_runs(lambda run=run: jax.block_until_ready(run()),
                               f"{args.trace}/{chain}_{rows}_{arm}", 2)
                per_layer = seconds / (num_layers * num_loops)
                pct = 100 * layer_bytes / per_layer / COPY_RATE_REF
                records.append(dict(chain=chain, rows=rows, arm=arm, us_per_layer=per_layer * 1e6,
                                    pct_copy=pct, max_diff_vs_first=diff))
                print(f"{chain:4s} rows {rows:3d} {arm:16s} {per_layer * 1e6:8.2f} µs/layer "
                      f"{pct:5.1f}% copy  max|diff|/max|ref| vs {args.arms[0]} {diff:.3g}", flush=True)
    write_json(args.out, dict(backend=jax.default_backend(), records=records))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
