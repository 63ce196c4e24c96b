"""Ouro-1.4B's qkv product with its RoPE on the GPU: the weight-streaming kernel with the
RoPE in its epilogue (kernels/streaming_matmul_rope.py, one kernel writing q, k, v), per
block_n, against what a step ran before it (the plain kernel, then XLA's RoPE:
layers.rope_rotate_half_qkv) and against XLA alone (layers.linear_rope_rotate_half_qkv).

    python -m loopjax.bench.matmul_rope                  # rows 1, 8, 32; block_n 16, 32, 64
    python -m loopjax.bench.matmul_rope --smoke          # tiny shapes, CPU, interpret mode (CI)

Timed as bench/matmul.py times products (`time_products`: B weight buffers per call, so the
L2 never serves a weight; median over rounds). % = (weight + activation bytes) / time of
the measured copy rate; x = the plain kernel + XLA RoPE's time / the row's time (> 1: the
fused epilogue wins); rel_err vs XLA's q, k, v.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax
import jax.numpy as jnp

from loopjax import layers

from .matmul import (
    _num_buffers,
    _random,
    _rel_err,
    _short,
    _weights,
    log,
    measure_copy_rate,
    print_row,
    time_products,
)

try:
    from loopjax.kernels import streaming_matmul as sm
    from loopjax.kernels import streaming_matmul_rope as smr
except ImportError:  # NOTE: run from a checkout with PYTHONPATH=. (kernels/ not installed)
    from kernels import streaming_matmul as sm
    from kernels import streaming_matmul_rope as smr

# name -> (K, Hq, Hkv, D): the qkv product [K, (Hq + 2*Hkv) * D]
SHAPES = {"ouro.wqkv+rope": (2048, 16, 16, 128)}
SMOKE_SHAPES = {"smoke.wqkv+rope": (64, 2, 1, 64)}  # D/2 = 32: block_n 16 and 32


# --wide: the fused kernel's other block sizes, per block_n (block_k, num_stages, num_warps)
WIDE = [dict(block_k=bk, num_stages=st, num_warps=w) for bk in (64, 128, 256) for st in (3, 4, 6)
        for w in (4, 8)]


def rope_case(name, k, hq, hkv, d, m, *, block_ns, dtype, copy_rate, smoke, rounds, calls, wide=False):
    """Rows for one (product, M): XLA, the plain kernel then XLA's RoPE, the fused kernel for
    each block_n that divides D/2."""
    n = (hq + 2 * hkv) * d
    key = jax.random.PRNGKey(k + n + m)
    wbytes = k * n * jnp.dtype(dtype).itemsize
    num = _num_buffers(wbytes, copy_rate, smoke)
    ws = _weights(key, k, n, num, dtype)
    xs = [_random(jax.random.fold_in(key, 1000 + i), (m, k), dtype) for i in range(num)]
    cos, sin = layers.rope_angles(jnp.arange(m) * 7 + 100, d, 10000.0)
    moved = wbytes + (m * k + m * n) * jnp.dtype(dtype).itemsize
    rows, base = [], {}  # base: XLA's q, k, v ("want"), the plain kernel + XLA RoPE's time

    def timed(impl, op, cfg):
        """A row for op(x, w, cos, sin) over every buffer; a failure gives an error row."""
        try:
            t, out = time_products(lambda x, w: op(x, w, cos, sin), xs, ws, rounds=rounds, calls=calls)
            out = jnp.concatenate([a.reshape(m, -1) for a in out], axis=1)
            base.setdefault("want", out)
            if impl == "pallas+xla_rope":
                base["t_plain"] = t
            x = {"speedup": base["t_plain"] / t} if "t_plain" in base else {}
            rows.append(dict(name=name, k=k, n=n, m=m, impl=impl, us=t * 1e6, cfg=cfg,
                             pct=100 * moved / t / copy_rate, err=_rel_err(out, base["want"]), **x))
        except Exception as e:  # noqa: BLE001 - one failing case prints a row
            rows.append(dict(name=name, k=k, n=n, m=m, impl=impl, error=_short(e), cfg=cfg))

    heads = dict(num_heads=hq, num_kv_heads=hkv)
    timed("xla", functools.partial(layers.linear_rope_rotate_half_qkv, **heads), None)
    plain = functools.partial(sm.streaming_matmul, interpret=smoke)
    timed("pallas+xla_rope", lambda x, w, c, s: layers.rope_rotate_half_qkv(plain(x, w), c, s, hq, hkv),
          sm.pick_config(m, k, n, dtype))
    for bn in block_ns:
        if (d // 2) % bn:
            continue
        for extra in [{}] + (WIDE if wide else []):
            fused = functools.partial(smr.streaming_matmul_rope_qkv, block_n=bn, interpret=smoke, **heads,
                                      **extra)
            cfg = sm.pick_config(m, k, n, dtype, block_n=bn, split_k=1, **extra)  # before fewer stages fit
            timed(f"rope n{bn}", fused, cfg)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32", help="comma-separated row counts M")
    p.add_argument("--block-n", default="16,32,64", help="the fused kernel's block_n values")
    p.add_argument("--wide", action="store_true",
                   help="also each block_n with the block_k x num_stages x num_warps grid WIDE")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, interpret mode")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rows, block_ns = [int(r) for r in args.rows.split(",")], [int(b) for b in args.block_n.split(",")]
    dtype = jnp.bfloat16
    if args.smoke:
        rows, rounds, calls, shapes = [r for r in rows if r <= 3] or [1], 1, 1, SMOKE_SHAPES
        copy_rate = measure_copy_rate(1 << 20, rounds)
    else:
        rounds, calls, shapes = 10, 5, SHAPES
        copy_rate = measure_copy_rate(1 << 30, rounds)
    log(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16; copy rate "
        f"{copy_rate / 1e12:.3f} TB/s; x = (plain kernel + XLA RoPE) time / row time")
    for name, (k, hq, hkv, d) in shapes.items():
        for m in rows:
            for r in rope_case(name, k, hq, hkv, d, m, block_ns=block_ns, dtype=dtype,
                               copy_rate=copy_rate, smoke=args.smoke, rounds=rounds, calls=calls,
                               wide=args.wide):
                print_row(r)
    log(f"\n# done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
