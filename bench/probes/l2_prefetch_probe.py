"""Probe: does prefetching the next product's weight into L2 hide a decode product's fixed cost?

Every decode product pays a ramp (its first weight tiles in flight) and a tail per kernel
(docs/persistent_kernel.md). Weights do not depend on activations, so a kernel could issue
L2 prefetches (`cp.async.bulk.prefetch.tensor`, TMA) of the NEXT product's weight and exit;
the copy engine fills L2 while the current product and the launch gap run. This times a chain
of `--chain` dependent products x <- x @ W_i on distinct weights (Ouro-1.4B's wo shape, the
'auto' product for the rows) in one executable, three ways:
  plain     the products alone;
  empty     a Mosaic kernel launched before each product that issues nothing (launch cost);
  prefetch  that kernel issuing L2 prefetches of W_{i+1} before product i.
The small kernel is ordered by a Ref it takes (the chain's x), so XLA cannot move it.

    python -m loopjax.bench.probes.l2_prefetch_probe [--rows 1,8,32] [--programs 32]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu

from loopjax.bench.common import pipelined_us
from loopjax.bench.trace_summary import trace_runs
from loopjax.matmul_ops import matmul_ops

BOX = (256, 64)  # TMA prefetch box [rows, columns] of the weight (32 KB in bf16)


@functools.partial(jax.jit, static_argnames=("num_programs", "issue"))  # one lowering for all sites
def l2_prefetch(w, anchor, *, num_programs: int, issue: bool = True):
    """A Mosaic kernel of num_programs programs that prefetches all of w [K, N] into L2 in
    BOX tiles (issue=False: the same launch, no prefetch); anchor: a Ref it orders against."""
    k, n = w.shape
    rows, cols = min(BOX[0], k), min(BOX[1], n)
    col_tiles = n // cols
    num_tiles = (k // rows) * col_tiles
    per_program = -(-num_tiles // num_programs)

    def body(w_gmem, anchor_gmem):
        _touch(anchor_gmem)  # NOTE: a kernel with no output and no effect would be removed
        if not issue:
            return
        def tile(t):
            @pl.when(t < num_tiles)
            def _():
                r, c = jax.lax.div(t, col_tiles), jax.lax.rem(t, col_tiles)
                plmgpu.async_prefetch(w_gmem.at[pl.ds(r * rows, rows), pl.ds(c * cols, cols)])

        p = jax.lax.axis_index("p")
        for i in range(per_program):
            tile(p * per_program + i)

    plmgpu.kernel(body, out_type=(), grid=(num_programs,), grid_names=("p",),
                  kernel_name="loopjax_l2_prefetch")(w, anchor)


def _touch(ref):
    """Hand `ref` to inline code that emits nothing: the kernel then counts as writing it."""
    @plmgpu.inline_mgpu(arg_types=(plmgpu.RefType(),))
    def touch(ctx, ref):
        del ctx, ref

    touch(ref)


def chain(x, ws, *, mode: str, num_programs: int):
    linear = matmul_ops("auto").linear
    ref = jax.new_ref(x)
    for i, w in enumerate(ws):
        if mode != "plain":
            target = ws[i + 1] if i + 1 < len(ws) else ws[0]
            l2_prefetch(target, ref, num_programs=num_programs, issue=mode == "prefetch")
        ref[...] = linear(ref[...], w)
    return ref[...]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--programs", default="16,64")
    parser.add_argument("--chain", type=int, default=48)
    parser.add_argument("--shape", default="2048x2048")
    parser.add_argument("--trace", default=None, help="also trace 2 chains of each arm under this folder")
    args = parser.parse_args(argv)
    k, n = map(int, args.shape.split("x"))
    assert k == n, "the chain feeds each product's output to the next: a square weight"
    ws = [(jax.random.normal(jax.random.key(i), (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
          for i in range(args.chain)]
    mb = k * n * 2 / 1e6
    print(f"L2 prefetch probe on {jax.devices()[0].device_kind}: chain of {args.chain} products "
          f"[R, {k}] x [{k}, {n}] ({mb:.1f} MB each)")
    for rows in map(int, args.rows.split(",")):
        x = jax.random.normal(jax.random.key(99), (rows, k), jnp.float32).astype(jnp.bfloat16)
        arms = {"plain": dict(mode="plain", num_programs=1)}
        for p in map(int, args.programs.split(",")):
            arms[f"empty p{p}"] = dict(mode="empty", num_programs=p)
            arms[f"prefetch p{p}"] = dict(mode="prefetch", num_programs=p)
        want = None
        for name, kw in arms.items():
            fn = jax.jit(functools.partial(chain, **kw))
            out = np.asarray(fn(x, ws), np.float32)
            want = out if want is None else want
            same = np.array_equal(out, want)
            us = pipelined_us(functools.partial(fn, x, ws), iters=20) / args.chain
            print(f"rows {rows:3d}  {name:14s} {us:7.2f} us per product  {mb / us:6.2f} TB/s"
                  f"  same result {same}", flush=True)
            if args.trace:
                trace_runs(functools.partial(lambda f, *a: jax.block_until_ready(f(*a)), fn, x, ws),
                           f"{args.trace}/r{rows}_{name.replace(' ', '_')}", 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
