"""Probe: the attention branch's norms in w_gate_up's prologue (kernels/persistent_mlp.py
`norm_add_norm_silu_mul`, phases 0 + 1) against the norms kernel then SiLU*up (matmul 'auto'),
at Ouro-1.4B's shapes over 24 layers of distinct weights x 4 loops in one jitted fori_loop
(the layers chained through the residual h, as the step runs them). Arms: 'unfused'
(kernels.norm_add_norm, then 'auto''s linear_silu_mul), 'phase1' (x given: phase 1 alone,
the stream with no prologue), 'fused@tT' (T ring slots); to find where the prologue's time
goes, 'fused-nowork' (phase 0 only signals: the handoff alone) and 'fused-nowait' (phase 1
does not wait: phase 0's work beside the stream; x is then stale, its numbers not checked).
Prints µs per layer application and each arm's h and act against the first arm's (max |diff|
/ max |ref|).

    python -m loopjax.bench.probes.norms_prologue --rows 1,8,32 --arms unfused,phase1,fused@t6
    python -m loopjax.bench.probes.norms_prologue --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import kernels
from loopjax import matmul_ops as mo
from loopjax.bench.common import error_text, ints, names, patched, time_calls, write_json
from loopjax.kernels import persistent_mlp as pm


def arm_patches(arm: str):
    """The experiment's patches of kernels/persistent_mlp.py while the arm traces."""
    name = arm.partition("@")[0]
    if name == "fused-nowork":
        return patched(pm, _norm_add_norm_row=lambda *args: None)
    if name == "fused-nowait":
        return patched(pm, wait_counter=lambda *args: None)
    return contextlib.nullcontext()


def arm_op(arm: str, interpret: bool):
    """(y, residual, norm_weight, next_norm_weight, eps, w_gate_up, counters) -> (h, act)."""
    name, _, spec = arm.partition("@")
    if name == "unfused":
        def unfused(y, residual, nw, nnw, eps, w_gate_up, counters):
            h, x = kernels.norm_add_norm(y, residual, nw, nnw, eps, interpret=interpret)
            return h, mo.streaming_linear_silu_mul(x, w_gate_up)
        return unfused
    blocks = dict(num_stages=int(stages[0])) if (stages := re.findall(r"t(\d+)", spec)) else {}
    if name == "phase1":  # x = residual: the stream's time does not depend on x's values
        def phase1(y, residual, nw, nnw, eps, w_gate_up, counters):
            kw = dict(split_k=1, num_stages=blocks.get("num_stages", 6), eps=None, interpret=interpret)
            (act,) = pm._call(residual, w_gate_up, None, None, None, None, None, phases=(1,), **kw)
            return residual, act
        return phase1
    return functools.partial(_fused, interpret=interpret, **blocks)


def _fused(y, residual, nw, nnw, eps, w_gate_up, counters, **kw):
    return pm.norm_add_norm_silu_mul(y, residual, nw, nnw, eps, w_gate_up, counters, **kw)


def chain_fn(op, num_loops: int):
    def run(ys, residual, norms, weights):
        counters = pm.new_counters()

        def one_loop(_, carry):
            h, acts = carry
            acts = []
            for y, (nw, nnw), w in zip(ys, norms, weights, strict=True):
                h, act = op(y, h, nw, nnw, 1e-6, w, counters)
                acts.append(act)
            return h, jnp.stack(acts)
        acts0 = jnp.zeros((len(ys), residual.shape[0], weights[0].shape[1] // 2), residual.dtype)
        return jax.lax.fori_loop(0, num_loops, one_loop, (residual, acts0))
    return jax.jit(run)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=ints, default=[1, 8, 32])
    parser.add_argument("--arms", type=names, default=["unfused", "phase1", "fused@t6p0"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    args = parser.parse_args(argv)
    hidden, inter, num_layers, num_loops = (128, 256, 1, 1) if args.smoke else (2048, 5632, 24, 4)
    iters = 1 if args.smoke else args.iters
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 * num_layers + 1))
    weights = [(jax.random.normal(next(keys), (hidden, 2 * inter)) * hidden**-0.5).astype(jnp.bfloat16)
               for _ in range(num_layers)]
    def norm_weight():
        return (1 + 0.1 * jax.random.normal(next(keys), (hidden,))).astype(jnp.bfloat16)
    norms = [(norm_weight(), norm_weight()) for _ in range(num_layers)]
    records, status = [], 0
    for rows in args.rows:
        ys = [jax.random.normal(jax.random.PRNGKey(1000 * rows + i), (4, rows, hidden))
              for i in range(num_layers)]
        residual = jax.random.normal(jax.random.PRNGKey(100 + rows), (rows, hidden)).astype(jnp.bfloat16)
        reference = None
        for arm in args.arms:
            fn = chain_fn(arm_op(arm, interpret=args.smoke), num_loops)
            jax.clear_caches()  # NOTE: a patched arm must not reuse another arm's kernel lowering
            try:
                with arm_patches(arm):  # the first call traces
                    h, acts = (np.asarray(a, np.float32) for a in fn(ys, residual, norms, weights))
                if reference is None:
                    reference = (h, acts)
                diffs = [float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) or 1.0))
                         for a, b in zip((h, acts), reference, strict=True)]
                run = functools.partial(fn, ys, residual, norms, weights)
                seconds = float(np.median(time_calls(run, iters)))
            except Exception as e:  # noqa: BLE001 - one failing arm must not hide the others
                print(f"rows {rows:3d} {arm:14s} FAILED {error_text(e)}", flush=True)
                status = 1
                continue
            per_layer = seconds / (num_layers * num_loops) * 1e6
            records.append(dict(rows=rows, arm=arm, us_per_layer=per_layer, h_diff=diffs[0],
                                act_diff=diffs[1]))
            print(f"rows {rows:3d} {arm:14s} {per_layer:8.2f} µs/layer  vs {args.arms[0]}: "
                  f"h {diffs[0]:.3g} act {diffs[1]:.3g}", flush=True)
    write_json(args.out, dict(backend=jax.default_backend(), records=records))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
