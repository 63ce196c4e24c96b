"""Device probe (issue 4): can the Pallas add_rms_norm be bitwise to the XLA path at Huginn's
non-power-of-two row (H=5280)? Compares reduction orders for the sum of squares:
  xla_mean  : the model's jnp.mean (XLA's own row-reduction order)          vs kernel 'tile'
  xla_pad   : jnp.sum over the row zero-padded to the next power of two       vs kernel 'tile'
  xla_tree  : an explicit halving tree of elementwise adds (slices)           vs kernel 'tree'
Kernel 'recip' / 'fma' divide by H as XLA does after its algebraic simplifier (x * f32(1/H));
the others divide. Prints mismatching elements per pair and the XLA variants' times
(bench/RESULTS.md run 10). Usage:
  python -m loopjax.bench.probes.rms_order [--interpret]"""
import argparse
import functools
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from loopjax.kernels._common import compiler_params, div_rn, load_tile, load_vec, next_pow2, store_tile

F32 = jnp.float32
EPS = 1e-6


def rnd(x, dt):
    return x.astype(dt).astype(F32)


def tree_sum_slices(sq):  # [N, W] (W a power of two) -> [N, 1], halving with elementwise adds
    while sq.shape[-1] > 1:
        half = sq.shape[-1] // 2
        sq = sq[:, :half] + sq[:, half:]
    return sq


def tree_sum_reshape(sq):  # the same tree spelled for Triton: sums over axes of size 2
    n, w = sq.shape
    while w > 1:
        w //= 2
        sq = jnp.sum(sq.reshape(n, 2, w), axis=1)
    return sq


def xla_norm(x, r, w, how):
    dt = x.dtype
    s = (x + r).astype(F32)
    h = s.shape[-1]
    sq = s * s
    if how == "mean":
        mean = jnp.mean(sq, axis=-1, keepdims=True)
    elif how == "pad":
        mean = jnp.sum(jnp.pad(sq, ((0, 0), (0, next_pow2(h) - h))), axis=-1, keepdims=True) / h
    else:
        mean = tree_sum_slices(jnp.pad(sq, ((0, 0), (0, next_pow2(h) - h)))) / h
    return w * (s * jax.lax.rsqrt(mean + EPS)).astype(dt)


def kern(x_ref, res_ref, w_ref, o_ref, *, how, interpret):
    n, h = x_ref.shape
    dt = x_ref.dtype
    width = next_pow2(h)
    r0 = pl.program_id(0)
    s = rnd(load_tile(x_ref, r0, 1, 0, width, n, h).astype(F32)
            + load_tile(res_ref, r0, 1, 0, width, n, h).astype(F32), dt)
    sq = s * s
    total = tree_sum_reshape(sq) if how == "tree" else jnp.sum(sq, axis=-1, keepdims=True)
    inv_h = jnp.float32(1.0 / h)  # XLA's algebraic simplifier turns x / c into x * (1/c)
    if how == "recip":
        mean_eps = total * inv_h + EPS
    elif how == "fma":
        mean_eps = fma(total, jnp.full_like(total, inv_h), jnp.full_like(total, EPS), interpret)
    else:
        mean_eps = div_rn(total, jnp.float32(h), interpret) + EPS
    normed = s * jax.lax.rsqrt(mean_eps)
    w = load_vec(w_ref, 0, width, h)[None, :].astype(F32)
    store_tile(o_ref, r0, 0, rnd(w * rnd(normed, dt), dt).astype(dt), n, h)


def fma(a, b, c, interpret):
    if interpret:
        return a * b + c
    from jax.experimental.pallas import triton as plgpu
    [out] = plgpu.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=[a, b, c],
                                         constraints="=f,f,f,f", pack=1,
                                         result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, F32)])
    return out


def kernel_norm(x, r, w, how, interpret=False):
    return pl.pallas_call(functools.partial(kern, how=how, interpret=interpret),
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(x.shape[0],),
                          compiler_params=compiler_params(4), interpret=interpret)(x, r, w)


def timed(fn, *args, reps=50):
    fn(*args).block_until_ready()
    t = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t) / reps * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--interpret", action="store_true")
    args = ap.parse_args()
    cases = [(5280, 64, 0), (64, 32, 0)] if args.interpret else \
        [(5280, 2048, s) for s in range(6)] + [(2048, 2048, 0), (64, 2048, 0), (5280, 7, 0)]
    for h, n, seed in cases:
        ks = jax.random.split(jax.random.key(1000 * seed + h + n), 3)
        x = jax.random.normal(ks[0], (n, h), jnp.bfloat16)
        r = jax.random.normal(ks[1], (n, h), jnp.bfloat16)
        w = 1 + 0.1 * jax.random.normal(ks[2], (h,), jnp.bfloat16)
        xla = {how: jax.jit(functools.partial(xla_norm, how=how)) for how in ("mean", "pad", "tree")}
        got = {how: jax.jit(functools.partial(kernel_norm, how=how, interpret=args.interpret))(x, r, w)
               for how in ("tile", "tree", "recip", "fma")}
        want = {how: f(x, r, w) for how, f in xla.items()}
        pairs = [("recip", "mean"), ("fma", "mean"), ("tile", "mean"), ("tile", "pad"), ("tree", "tree")]
        counts = [f"{k} vs {x} {int(jnp.sum(got[k] != want[x])):4d}" for k, x in pairs]
        counts += [f"xla {a} vs mean {int(jnp.sum(want[a] != want['mean'])):4d}" for a in ("pad", "tree")]
        print(f"H={h:5d} N={n:5d} seed={seed}: " + " | ".join(counts) + f" of {x.size}", flush=True)
        if seed == 0 and not args.interpret and h == 5280:
            for rows in (32, n):
                t = {how: timed(f, x[:rows], r[:rows], w) for how, f in xla.items()}
                print(f"    XLA time rows={rows}: " + "  ".join(f"{k} {v:.1f} us" for k, v in t.items()))


if __name__ == "__main__":
    main()
