"""Probe: kernels/persistent_mlp.py on the device. First its results against the XLA twin
(act and the summed partials, several calls at each row count: a race would show as a
changing or wrong result), then Ouro-1.4B's MLP half over 24 layers of distinct weights x 4
loops in one jitted `fori_loop` (x <- sum of the down partials), µs per layer application:
'triton' (today's streaming_matmul_silu_mul + streaming_matmul with its split-K sum),
'two_kernels' (the persistent kernel's two phases as two launches), 'fused' (one launch).

    python -m loopjax.bench.probes.persistent_mlp_check --rows 1,8,32
    python -m loopjax.bench.probes.persistent_mlp_check --smoke
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from loopjax.bench.common import error_text, ints, names, time_calls, write_json
from loopjax.bench.matmul import COPY_RATE_REF
from loopjax.bench.trace_summary import trace_runs
from loopjax.kernels import streaming_matmul as sm
from loopjax.kernels.persistent_mlp import persistent_mlp, ref_persistent_mlp


def mlp_fn(arm: str, split_k: int, interpret: bool):
    """x [M, H] -> (x @ MLP) [M, H] in x's dtype, as the arm computes it."""
    def run(x, w_gate_up, w_down):
        if arm == "triton":
            return sm.streaming_matmul(sm.streaming_matmul_silu_mul(x, w_gate_up, interpret=interpret),
                                       w_down, interpret=interpret)
        phases = ((1,), (2,)) if arm == "two_kernels" else ((1, 2),)
        _, partials = persistent_mlp(x, w_gate_up, w_down, split_k=split_k, phases=phases,
                                     interpret=interpret)
        return jnp.sum(partials, axis=0).astype(x.dtype)
    return run


def chain_fn(arm: str, split_k: int, num_loops: int, interpret: bool):
    step = mlp_fn(arm, split_k, interpret)

    def run(x, weights):
        def one_loop(_, x):
            for w_gate_up, w_down in weights:
                x = step(x, w_gate_up, w_down)
            return x
        return jax.lax.fori_loop(0, num_loops, one_loop, x)
    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=ints, default=[1, 8, 32])
    parser.add_argument("--arms", type=names, default=["triton", "two_kernels", "fused"])
    parser.add_argument("--split-k", type=int, default=4)
    parser.add_argument("--checks", type=int, default=5, help="fused calls compared per row count")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    args = parser.parse_args(argv)
    interpret = args.smoke
    hidden, inter, num_layers, num_loops = (128, 256, 1, 1) if args.smoke else (2048, 5632, 24, 4)
    split_k = 2 if args.smoke else args.split_k
    arms = [a for a in args.arms if not (args.smoke and a == "fused")]  # no semaphores on CPU
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * num_layers)
    weights = [((jax.random.normal(keys[2 * i], (hidden, 2 * inter)) * hidden**-0.5).astype(jnp.bfloat16),
                (jax.random.normal(keys[2 * i + 1], (inter, hidden)) * inter**-0.5).astype(jnp.bfloat16))
               for i in range(num_layers)]
    layer_bytes = 2 * (hidden * 2 * inter + inter * hidden)
    records, status = [], 0
    for rows in args.rows:
        x = jax.random.normal(jax.random.PRNGKey(rows), (rows, hidden)).astype(jnp.bfloat16)
        ref_act, ref_y = ref_persistent_mlp(x, *weights[0])
        check_arm = "two_kernels" if args.smoke else "fused"
        fn = jax.jit(functools.partial(persistent_mlp, split_k=split_k, interpret=interpret,
                                       phases=((1,), (2,)) if check_arm == "two_kernels" else ((1, 2),)))
        try:
            results = [fn(x, *weights[0]) for _ in range(1 if args.smoke else args.checks)]
            act_diffs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - ref_act.astype(jnp.float32))))
                         for a, _ in results]
            y_diffs = [float(jnp.max(jnp.abs(p.sum(0) - ref_y))) for _, p in results]
            same = all(bool(jnp.array_equal(p, results[0][1])) for _, p in results)
        except Exception as e:  # noqa: BLE001
            print(f"rows {rows:3d} check FAILED {error_text(e)}", flush=True)
            return 1
        scale = float(jnp.max(jnp.abs(ref_y)))
        ok = max(y_diffs) <= 2e-2 * scale and max(act_diffs) <= 0.05 and same
        status |= 0 if ok else 1
        print(f"rows {rows:3d} {check_arm} vs twin: act max|diff| {max(act_diffs):.3g}, sum of "
              f"partials max|diff| {max(y_diffs):.3g} (max|y| {scale:.3g}), repeat-identical "
              f"{same}: {'ok' if ok else 'MISMATCH'}", flush=True)
        for arm in arms:
            chain = chain_fn(arm, split_k, num_loops, interpret)
            try:
                seconds = float(np.median(time_calls(functools.partial(chain, x, weights),
                                                     1 if args.smoke else args.iters)))
                out = chain(x, weights)
            except Exception as e:  # noqa: BLE001
                print(f"rows {rows:3d} {arm:12s} FAILED {error_text(e)}", flush=True)
                status = 1
                continue
            if args.trace:
                run = functools.partial(chain, x, weights)
                trace_runs(lambda run=run: jax.block_until_ready(run()), f"{args.trace}/{rows}_{arm}", 2)
            per_layer = seconds / (num_layers * num_loops)
            pct = 100 * layer_bytes / per_layer / COPY_RATE_REF
            records.append(dict(rows=rows, arm=arm, us_per_layer=per_layer * 1e6, pct_copy=pct,
                                out_abs_max=float(jnp.max(jnp.abs(out.astype(jnp.float32))))))
            print(f"rows {rows:3d} {arm:12s} {per_layer * 1e6:8.2f} µs/layer {pct:5.1f}% copy", flush=True)
    write_json(args.out, dict(backend=jax.default_backend(), records=records))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
