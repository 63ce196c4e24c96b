"""Device probe (issue 4): XLA runs the model's RMSNorm as a Triton block-level fusion (its
optimized HLO names `output_tiles` and `num_warps`); Triton's row-reduction order follows
the tile's layout, so the Pallas kernel is bitwise to XLA when it uses the same tile.
Prints, per (H, N), XLA's chosen tile and warps, then mismatching elements of the Pallas
norms vs the jitted XLA twins for each (block_rows, num_warps). Usage:
  python -m loopjax.bench.probes.rms_tiling
  python -m loopjax.bench.probes.rms_tiling --cases 2048:128,2048:32 --names add_rms_norm
(with --cases: mismatches only, add_rms_norm in both roundings of x + residual)"""
import argparse
import functools
import json
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from loopjax import layers
from loopjax.kernels import add_rms_norm, rms_norm, rms_norm_add
from loopjax.kernels._common import compiler_params, load_tile, load_vec, next_pow2, store_tile

EPS = 1e-6
TWINS = {
    "rms_norm": (lambda x, r, w: layers.rms_norm(x, w, EPS),
                 lambda x, r, w, **kw: rms_norm(x, w, EPS, **kw)),
    "add_rms_norm": (lambda x, r, w: layers.rms_norm(x + r, w, EPS),
                     lambda x, r, w, **kw: add_rms_norm(x, r, w, EPS, **kw)),
    "rms_norm_add": (lambda x, r, w: r + layers.rms_norm(x, w, EPS),
                     lambda x, r, w, **kw: rms_norm_add(x, r, w, EPS, **kw)),
}


def xla_tiling(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    tiles = re.findall(r'"output_tiles":(\[\{.*?\}\])', text)
    warps = re.findall(r'"num_warps":"(\d+)"', text)
    kinds = re.findall(r'kind=(k\w+)', text)
    return {"tiles": tiles, "warps": warps, "fusion_kinds": kinds}


def inputs(h, n, seed):
    ks = jax.random.split(jax.random.key(1000 * seed + h + n), 3)
    x = jax.random.normal(ks[0], (n, h), jnp.bfloat16)
    r = jax.random.normal(ks[1], (n, h), jnp.bfloat16)
    w = 1 + 0.1 * jax.random.normal(ks[2], (h,), jnp.bfloat16)
    return x, r, w


def _native_add_kernel(x_ref, r_ref, w_ref, o_ref, *, block_rows):
    """add_rms_norm with x + residual added in the dtype (Triton's bf16 add, one rounding)
    rather than in f32 then rounded (two roundings)."""
    n, h = x_ref.shape
    width, r0 = next_pow2(h), pl.program_id(0) * block_rows
    s = (load_tile(x_ref, r0, block_rows, 0, width, n, h)
         + load_tile(r_ref, r0, block_rows, 0, width, n, h)).astype(jnp.float32)
    mean = jnp.sum(s * s, axis=-1, keepdims=True) * jnp.float32(1.0 / h)
    normed = (s * jax.lax.rsqrt(mean + EPS)).astype(x_ref.dtype).astype(jnp.float32)
    w = load_vec(w_ref, 0, width, h)[None, :].astype(jnp.float32)
    store_tile(o_ref, r0, 0, (w * normed).astype(x_ref.dtype), n, h)


def native_add_rms_norm(x, r, w, *, block_rows, num_warps):
    return pl.pallas_call(functools.partial(_native_add_kernel, block_rows=block_rows),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(pl.cdiv(x.shape[0], block_rows),),
                          compiler_params=compiler_params(num_warps))(x, r, w)


def mismatches(cases, names, seeds=6):
    configs = [(1, 4), (2, 4), (4, 4), (1, 8), (2, 8), (1, 2)]
    for h, n in cases:
        for name in names:
            if name == "add_rms_norm_native":
                xla_fn, kern_fn, rounds = TWINS["add_rms_norm"][0], native_add_rms_norm, (None,)
            else:
                xla_fn, kern_fn = TWINS[name]
                rounds = (None, True, False) if name == "add_rms_norm" else (None,)
            for rnd in rounds:
                extra = {} if rnd is None else {"round_each_op": rnd}
                counts = {c: 0 for c in configs}
                for seed in range(seeds):
                    x, r, w = inputs(h, n, seed)
                    want = jax.jit(xla_fn)(x, r, w)
                    for br, nw in configs:
                        fn = functools.partial(kern_fn, block_rows=br, num_warps=nw, **extra)
                        counts[(br, nw)] += int(jnp.sum(jax.jit(fn)(x, r, w) != want))
                line = "  ".join(f"{br}x{nw}:{c}" for (br, nw), c in counts.items())
                print(f"mismatch {name:13s} round={rnd} H={h} N={n:5d} (rows x warps): {line}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="", help="H:N pairs; only the mismatch counts")
    ap.add_argument("--names", default=",".join(TWINS))
    args = ap.parse_args()
    if args.cases:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")]
        mismatches(cases, args.names.split(","))
        return
    records = []
    for h in (5280, 2048):
        for n in (1, 2, 8, 32, 128, 512, 2048):
            x, r, w = inputs(h, n, 0)
            for name, (xla_fn, _) in TWINS.items():
                t = xla_tiling(xla_fn, x, r, w)
                print(f"XLA {name:13s} H={h} N={n:5d}: tiles {t['tiles']} warps {t['warps']} "
                      f"kinds {sorted(set(t['fusion_kinds']))}", flush=True)
                records.append(dict(kind="xla_tiling", name=name, h=h, n=n, **t))
    configs = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 8), (1, 16), (2, 16), (4, 4), (8, 8)]
    for h, ns in ((5280, (2048, 128, 32, 1)), (2048, (2048, 32))):
        for n in ns:
            for name, (xla_fn, kern_fn) in TWINS.items():
                counts = {c: 0 for c in configs}
                for seed in range(6 if n >= 128 else 3):
                    x, r, w = inputs(h, n, seed)
                    want = jax.jit(xla_fn)(x, r, w)
                    for br, nw in configs:
                        got = jax.jit(functools.partial(kern_fn, block_rows=br, num_warps=nw))(x, r, w)
                        counts[(br, nw)] += int(jnp.sum(got != want))
                line = "  ".join(f"{br}x{nw}:{c}" for (br, nw), c in counts.items())
                print(f"mismatch {name:13s} H={h} N={n:5d} (rows x warps): {line}", flush=True)
                records.append(dict(kind="mismatch", name=name, h=h, n=n,
                                    counts={f"{br}x{nw}": c for (br, nw), c in counts.items()}))
    print("JSON " + json.dumps(records))


if __name__ == "__main__":
    main()
