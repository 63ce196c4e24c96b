"""Probe: one Ouro loop (every layer, dense causal attention over the rows) at the real
shapes with random bf16 weights, on each layers.Ops a step can use, against XLA's ops:
the pointwise kernels must be bitwise (as on CPU, tests/test_pointwise_ops.py), the
weight-streaming products (matmul 'auto', 'streaming', 'persistent'; 'mosaic': 'streaming'
with every matmul_ops.MOSAIC_ROWS op at 8-64 rows) within bf16 rounding of a different f32
summation order. Prints per rows: differing elements and the largest |difference| relative
to the output's largest |value|; a variant that fails prints its error and the others still
run (exit status 1 if any failed).

    python -m loopjax.bench.probes.ops_check [--preset ouro-1.4b] [--rows 1,8,32] [--variants ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from loopjax import matmul_ops as mo
from loopjax.bench.common import patched
from loopjax.config import preset
from loopjax.layers import IDENTITY_COMPILER_OPTIONS, XLA_OPS, DenseCausal, rope_angles
from loopjax.matmul_ops import matmul_ops
from loopjax.models import ouro
from loopjax.pointwise_ops import with_pointwise


def _loop(params, x, *, cfg, ops):
    cos, sin = rope_angles(jnp.arange(x.shape[0]), cfg.head_dim, cfg.rope_theta)
    return ouro.loop(params, cfg, x, cos, sin, DenseCausal(), None, 0, ops)[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ouro-1.4b")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--variants", default=None,
                        help="comma-separated variant names to run (default: all), e.g. 'pointwise pallas'")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="run only the first N layers (where a difference first appears)")
    args = parser.parse_args(argv)
    cfg = preset(args.preset)
    if args.num_layers:
        cfg = dataclasses.replace(cfg, num_layers=args.num_layers)
    params = ouro.init_params(cfg, jax.random.key(0), jnp.bfloat16)
    variants = {"matmul auto": matmul_ops("auto"), "matmul streaming": matmul_ops("streaming"),
                "matmul persistent": matmul_ops("persistent"),
                "matmul mosaic": matmul_ops("streaming"),
                "pointwise pallas": with_pointwise(XLA_OPS, "pallas")}
    if args.variants:
        chosen = [v.strip() for v in args.variants.split(",")]
        unknown = sorted(set(chosen) - set(variants))
        if unknown:
            parser.error(f"unknown variants {unknown}; choose from {sorted(variants)}")
        variants = {name: variants[name] for name in chosen}
    run = {name: jax.jit(functools.partial(_loop, cfg=cfg, ops=ops),
                         compiler_options=IDENTITY_COMPILER_OPTIONS)
           for name, ops in {"xla": XLA_OPS, **variants}.items()}
    failures = []
    for rows in map(int, args.rows.split(",")):
        x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size), jnp.bfloat16)
        want = run["xla"](params, x).astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(want)))
        for name in variants:
            head = f"{args.preset} rows {rows:4d} {name:<18}"
            try:  # NOTE: a variant that fails (e.g. a kernel refusing a shape) does not stop the others
                with _every_mosaic_op() if name == "matmul mosaic" else contextlib.nullcontext():
                    got = run[name](params, x).astype(jnp.float32)
            except Exception as error:  # noqa: BLE001  (reported, then the next variant)
                failures.append(f"{head} FAILED: {type(error).__name__}: {str(error).splitlines()[0]}")
                print(failures[-1], flush=True)
                continue
            diff = int(jnp.sum(got != want))
            rel = float(jnp.max(jnp.abs(got - want))) / scale
            print(f"{head} differing {diff:7d}/{want.size}  max |diff| / max |out| {rel:.2e}", flush=True)
    return 1 if failures else 0


def _every_mosaic_op():
    """matmul_ops.MOSAIC_ROWS with every op at 8-64 rows while a variant traces (restored after)."""
    return patched(mo, MOSAIC_ROWS=dict.fromkeys(mo.MOSAIC_OPS, frozenset({8, 16, 32, 64})))


if __name__ == "__main__":
    raise SystemExit(main())
