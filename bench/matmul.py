"""Weight-streaming products on the GPU: the Pallas kernel (kernels/streaming_matmul.py) vs
XLA (`layers.linear`), per product and for a whole Ouro-1.4B weights-only decode step.

    python -m loopjax.bench.matmul                 # products + decode step, < 4 min on an H200
    python -m loopjax.bench.matmul --sweep         # block-size sweep; prints a TUNED table
    python -m loopjax.bench.matmul --smoke         # tiny shapes, CPU, interpret mode (CI)

Products: for each (K, N) of Ouro-1.4B and Huginn-0125 and each row count, one executable
runs B products, each over its own activation and its own weight buffer, so that at least
~150 MB of other weights pass between two reads of a buffer (the 50 MB L2 never serves them).
Time per product = median over rounds of (wall time of `calls` asynchronous calls) /
(calls * B); with >= ~300 us of GPU work per call, Python dispatch hides behind the GPU.
% = (weight + activation bytes) / time over the copy rate measured at the start of the run
(device-to-device copy of 1 GiB, read + write counted). rel_err = max|kernel - XLA| / max|XLA|.
Products fed by an RMSNorm (wqkv, w_gate_up) add a `pallas+norm` row: the kernel with the
norm fused into its prologue, checked against XLA's rms_norm + linear; its x = the plain
kernel's time / its time (1.00: the fused norm costs the product nothing).

Decode step: 4 loops x 24 layers in a `lax.fori_loop` over loops, the 24 layers unrolled
over per-layer buffers (docs/design.md), Ouro's sandwich norms and SiLU, no attention (the q
columns stand in for its output). Variants: XLA products; kernel products; kernel products
with the SiLU*up epilogue fused; Mosaic GPU kernel products. The "+ fused norm" columns run
the same kernel variant with the RMSNorms before wqkv and w_gate_up fused into the kernel's
prologue (layers.Ops.norm_linear*), in the same run, side by side.
% of roofline = weight bytes x loops / time / copy rate.
wcopies = weight-shaped slices/copies inside loop bodies of the compiled HLO (must be 0 on
the GPU; --smoke's interpret mode slices weight tiles, which can match a tiny weight).
Every case runs in its own try/except: a failure prints an error row and the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from loopjax import layers
from loopjax.config import preset

from .matmul_sweep import add_totals, sweep_configs, wide_configs
from .weight_copies import weight_copies_in_loops, weight_shapes

try:
    from loopjax.kernels import streaming_matmul as sm
    from loopjax.kernels import streaming_matmul_mgpu as smg
    from loopjax.kernels import streaming_matmul_norms as smn
except ImportError:  # NOTE: run from a checkout with PYTHONPATH=. (kernels/ not installed)
    from kernels import streaming_matmul as sm
    from kernels import streaming_matmul_mgpu as smg
    from kernels import streaming_matmul_norms as smn

SHAPES = {  # name -> [(product, K, N)]
    "ouro": [("ouro.wqkv", 2048, 6144), ("ouro.wo", 2048, 2048), ("ouro.w_gate_up", 2048, 11264),
             ("ouro.w_down", 5632, 2048), ("ouro.lm_head", 2048, 49152)],
    "huginn": [("huginn.wqkv", 5280, 15840), ("huginn.wo", 5280, 5280),
               ("huginn.w_gate_up", 5280, 35840), ("huginn.w_down", 17920, 5280),
               ("huginn.lm_head", 5280, 65536)],
}
SMOKE_SHAPES = [("smoke.wqkv", 64, 64), ("smoke.w_gate_up", 96, 128)]  # NOTE: whole tiles for Mosaic GPU
NORM_FED = (".wqkv", ".w_gate_up")  # products whose input is an RMSNorm's output
# The kernel entry a product runs as in the decode step ('auto'), which --sweep times: the
# SiLU*up epilogue, or split-K partials into the norm_add_norm kernel (Ouro's sandwich norms) or
# the add_norm_norm kernel (Huginn's).
IN_STEP = {"ouro.w_gate_up": "silu", "ouro.wo": "norm_add_norm", "ouro.w_down": "norm_add_norm",
           "huginn.wo": "add_norm_norm", "huginn.w_down": "add_norm_norm"}
NORM_EPS = 1e-6
L2_BYTES = 50e6
COPY_RATE_REF = 4.08e12  # B/s, docs h200.md; the run measures its own


def log(*parts):
    print(*parts, flush=True)


def _median_time(fn, args, *, rounds: int, calls: int, warm: bool = True) -> float:
    """Seconds per call: median over rounds of (calls asynchronous calls, one sync)."""
    jax.block_until_ready(fn(*args))  # compile
    if warm:
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure_copy_rate(num_bytes: int, rounds: int) -> float:
    """Device-to-device copy rate in B/s (read + write)."""
    a = jnp.zeros((num_bytes // 4,), jnp.float32)
    t = _median_time(jax.jit(lambda a: a + 1.0), (a,), rounds=rounds, calls=5)
    return 2 * num_bytes / t


def _random(key, shape, dtype, scale=1.0):
    """Normal(0, scale^2) values. NOTE: small arrays come from numpy (seeded by the key):
    jax.random would compile once per shape, which dominates a --smoke run."""
    if math.prod(shape) <= 1 << 22:
        seed = int(jax.random.randint(key, (), 0, 2**31 - 1))
        values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        return jnp.asarray(values * scale).astype(dtype)
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def _weights(key, k, n, count, dtype):
    return [_random(jax.random.fold_in(key, i), (k, n), dtype, k**-0.5) for i in range(count)]


def _num_buffers(weight_bytes: int, copy_rate: float, smoke: bool) -> int:
    """Weight buffers = products per call: >= 150 MB between two reads of one buffer, and
    >= ~300 us of GPU work per call; at most 64 products and 4 GB."""
    if smoke:
        return 2
    est = weight_bytes / copy_rate  # seconds per product at the copy rate
    b = max(math.ceil(3 * L2_BYTES / weight_bytes), math.ceil(300e-6 / est), 2)
    return max(1, min(b, 64, int(4e9 // weight_bytes)))


def time_products(fn, xs, ws, *, rounds: int, calls: int):
    """(seconds per product, first output) of fn(x_i, w_i). NOTE: every product of a call
    reads its own weight buffer, so XLA cannot merge dots that share one (DotMerger)."""

    def run(xs, ws):
        return [fn(x, w) for x, w in zip(xs, ws, strict=True)]

    step = jax.jit(run)
    t = _median_time(step, (xs, ws), rounds=rounds, calls=calls, warm=rounds > 1)
    return t / len(xs), step(xs, ws)[0]


def _rel_err(a, b) -> float:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def product_case(name, k, n, m, *, dtype, copy_rate, smoke, rounds, calls, configs=None, norm=True):
    """Rows for one (product, M): XLA first, then the kernel with each config (default:
    the one pick_config chooses; then Mosaic GPU, and with `norm` the fused norm where a norm
    feeds it)."""
    key = jax.random.PRNGKey(k * 7 + n + m)
    wbytes = k * n * jnp.dtype(dtype).itemsize
    num = _num_buffers(wbytes, copy_rate, smoke)
    ws = _weights(key, k, n, num, dtype)
    xs = [_random(jax.random.fold_in(key, 1000 + i), (m, k), dtype) for i in range(num)]
    moved = wbytes + (m * k + m * n) * jnp.dtype(dtype).itemsize
    t_xla, ref = time_products(layers.linear, xs, ws, rounds=rounds, calls=calls)
    rows = [dict(name=name, k=k, n=n, m=m, impl="xla", us=t_xla * 1e6,
                 pct=100 * moved / t_xla / copy_rate, err=0.0, cfg="")]

    def timed(impl, fn, cfg, want, t_base):
        """A row for fn over every buffer: time, % of the copy rate, rel_err vs `want` (the
        first product), x = t_base / time; a failure gives an error row."""
        try:
            t, out = time_products(fn, xs, ws, rounds=rounds, calls=calls)
            rows.append(dict(name=name, k=k, n=n, m=m, impl=impl, us=t * 1e6,
                             pct=100 * moved / t / copy_rate, err=_rel_err(out, want), cfg=cfg,
                             speedup=t_base / t))
        except Exception as e:  # noqa: BLE001 - one failing case prints a row
            rows.append(dict(name=name, k=k, n=n, m=m, impl=impl, error=_short(e), cfg=cfg))

    if configs:
        kernel, ref_fn = _in_step(name, key, m, n, dtype)
        t_xla, ref = time_products(ref_fn, xs, ws, rounds=rounds, calls=calls)
        rows[0].update(us=t_xla * 1e6, pct=100 * moved / t_xla / copy_rate)
        for cfg in configs:
            timed("pallas", functools.partial(kernel, interpret=smoke, **cfg._asdict()), cfg, ref, t_xla)
        return rows
    for cfg in [sm.pick_config(m, k, n, dtype)]:
        fn = functools.partial(sm.streaming_matmul, interpret=smoke, **cfg._asdict())
        timed("pallas", fn, cfg, ref, t_xla)
    plain = rows[1]  # NOTE: the Mosaic GPU variant and the fused norm use default tiles
    timed("mgpu", functools.partial(smg.streaming_matmul_mgpu, interpret=smoke),
          smg.mgpu_config(m, k, n), ref, t_xla)
    if norm and name.endswith(NORM_FED) and "us" in plain:
        nw = _random(jax.random.PRNGKey(k), (k,), dtype, 0.1) + 1
        fn = functools.partial(sm.streaming_matmul, norm_weight=nw, norm_eps=NORM_EPS,
                               interpret=smoke)
        timed("pallas+norm", fn, plain["cfg"], layers.norm_linear(xs[0], nw, NORM_EPS, ws[0]),
              plain["us"] * 1e-6)
    return rows


def _in_step(name, key, m, n, dtype):
    """(kernel(x, w, **blocks), its XLA twin(x, w)) of the product as the decode step runs it
    (IN_STEP; the first output where the op has two)."""
    variant = IN_STEP.get(name)
    if variant == "silu":
        return sm.streaming_matmul_silu_mul, sm.ref_streaming_matmul_silu_mul
    if variant in ("norm_add_norm", "add_norm_norm"):
        res = _random(jax.random.fold_in(key, 1), (m, n), dtype)
        nw1, nw2 = (_random(jax.random.fold_in(key, i), (n,), dtype, 0.1) + 1 for i in (2, 3))
        fused = getattr(smn, f"streaming_matmul_{variant}")
        ref = getattr(smn, f"ref_streaming_matmul_{variant}")
        return (lambda x, w, **kw: fused(x, w, res, nw1, nw2, NORM_EPS, **kw)[0],
                lambda x, w: ref(x, w, res, nw1, nw2, NORM_EPS)[0])
    return sm.streaming_matmul, layers.linear


def _short(e: Exception) -> str:
    lines = [s for s in str(e).strip().splitlines() if s.strip()]
    return f"{type(e).__name__}: {(lines[0] if lines else '')[:150]}"


def _cfg_str(cfg) -> str:
    if not cfg:
        return ""
    return f"n{cfg.block_n} k{cfg.block_k} s{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def print_row(r):
    head = f"{r['name']:<18} {r['k']:>6}->{r['n']:<6} {r['m']:>4} {r['impl']:<11}"
    if "error" in r:
        log(f"{head} ERROR {r['error']}  [{_cfg_str(r['cfg'])}]")
        return
    ok = "ok" if r["err"] <= 2e-2 else "BAD"
    extra = f" x{r['speedup']:.2f}" if "speedup" in r else ""
    log(f"{head} {r['us']:>9.1f} us {r['pct']:>5.1f}%  rel_err {r['err']:.1e} {ok}{extra}"
        f"  {_cfg_str(r['cfg'])}")


# ------------------------------------------------------------------------------ decode step


def _ouro_layers(cfg, key, dtype):
    """Per-layer weight buffers (a list of dicts, never a stacked array)."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = []
    for i in range(cfg.num_layers):
        kk = jax.random.split(jax.random.fold_in(key, i), 4)
        ones = jnp.ones((h,), dtype)
        out.append({"wqkv": _random(kk[0], (h, q + 2 * kv), dtype, h**-0.5),
                    "wo": _random(kk[1], (q, h), dtype, q**-0.5),
                    "w_gate_up": _random(kk[2], (h, 2 * f), dtype, h**-0.5),
                    "w_down": _random(kk[3], (f, h), dtype, f**-0.5),
                    **{n: ones + 0 for n in ("attn_norm", "attn_norm_2", "mlp_norm", "mlp_norm_2")}})
    return out


def step_ops(variant: str, fuse_norm: bool, interpret: bool) -> layers.Ops:
    """The products of a decode-step variant; fuse_norm: the norms before wqkv and w_gate_up
    in the kernel's prologue (Triton kernel variants only), else XLA's rms_norm before it."""
    if variant == "xla":
        return layers.XLA_OPS
    if variant == "mgpu":
        mm = functools.partial(smg.streaming_matmul_mgpu, interpret=interpret)
    else:
        mm = functools.partial(sm.streaming_matmul, interpret=interpret)
    if variant == "pallas+silu":
        act = functools.partial(sm.streaming_matmul_silu_mul, interpret=interpret)
    else:
        act = lambda x, w, **norm: layers.silu_mul(*jnp.split(mm(x, w, **norm), 2, axis=-1))  # noqa: E731

    def normed(product):  # product(x, w, **norm) -> op(x, norm_weight, eps, w)
        if fuse_norm:
            return lambda x, nw, eps, w: product(x, w, norm_weight=nw, norm_eps=eps)
        return lambda x, nw, eps, w: product(layers.rms_norm(x, nw, eps), w)

    return layers.Ops(linear=mm, norm_linear=normed(mm), norm_linear_silu_mul=normed(act))


def decode_step_fn(cfg, num_loops: int, ops: layers.Ops):
    """jit((layers, x [M, H]) -> x): num_loops x every layer, products by `ops`."""
    eps, q_dim = cfg.rms_norm_eps, cfg.num_heads * cfg.head_dim

    def step(lps, x):
        def one_loop(_, x):
            for lp in lps:  # NOTE: unrolled over per-layer buffers; closed over, not sliced
                qkv = ops.norm_linear(x, lp["attn_norm"], eps, lp["wqkv"])
                o = ops.linear(qkv[:, :q_dim], lp["wo"])  # NOTE: no attention; q stands in for it
                x = x + layers.rms_norm(o, lp["attn_norm_2"], eps)
                a = ops.norm_linear_silu_mul(x, lp["mlp_norm"], eps, lp["w_gate_up"])
                x = x + layers.rms_norm(ops.linear(a, lp["w_down"]), lp["mlp_norm_2"], eps)
            return x

        return jax.lax.fori_loop(0, num_loops, one_loop, x)

    return jax.jit(step)


def decode_step_cases(cfg, num_loops, rows, *, dtype, copy_rate, smoke, rounds, deadline):
    key = jax.random.PRNGKey(1)
    lps = _ouro_layers(cfg, key, dtype)
    wbytes = sum(v.size * v.dtype.itemsize for lp in lps for v in lp.values() if v.ndim == 2)
    roofline = wbytes * num_loops / copy_rate
    log(f"\n# decode step, {cfg.num_layers} layers x {num_loops} loops, weights "
        f"{wbytes / 1e9:.2f} GB/loop, roofline {roofline * 1e3:.3f} ms")
    shapes = weight_shapes(lps)
    cols = f"{'ms':>9} {'%roof':>6} {'wcopies':>7} {'rel_err':>8}"
    log(f"{'variant':<12} {'M':>4} {cols} | + fused norm: {cols}")
    log("# wcopies: weight-shaped slices/copies in loop bodies of the compiled HLO; rel_err vs xla")

    def run(variant, m, x, fuse_norm, ref):
        """(columns, output) of one variant; the columns say ERROR on a failure."""
        try:
            fn = decode_step_fn(cfg, num_loops, step_ops(variant, fuse_norm, smoke))
            fn = fn.lower(lps, x).compile()
            copies = len(weight_copies_in_loops(fn.as_text(), shapes))
            t = _median_time(fn, (lps, x), rounds=rounds, calls=1 if smoke else 3, warm=not smoke)
            out = fn(lps, x)
            err = "" if ref is None else f"{_rel_err(out, ref):.1e}"
            return f"{t * 1e3:>9.3f} {100 * roofline / t:>5.1f}% {copies:>7} {err:>8}", out
        except Exception as e:  # noqa: BLE001
            return f"ERROR {_short(e)}", None

    for m in rows:
        x = _random(jax.random.fold_in(key, 99), (m, cfg.hidden_size), dtype)
        ref = None
        # NOTE: --smoke leaves out mgpu here (its CPU interpreter is slow); products cover it.
        for variant in ("xla", "pallas", "pallas+silu") + (() if smoke else ("mgpu",)):
            if time.perf_counter() > deadline:
                log(f"{variant:<12} {m:>4} skipped (time budget)")
                continue
            plain, out = run(variant, m, x, False, ref)
            ref = out if variant == "xla" else ref
            fused = run(variant, m, x, True, ref)[0] if variant.startswith("pallas") else "-"
            log(f"{variant:<12} {m:>4} {plain} | {fused}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,128", help="comma-separated row counts M")
    p.add_argument("--shapes", default="ouro,huginn", help="ouro, huginn or both")
    p.add_argument("--no-step", action="store_true", help="skip the decode step")
    p.add_argument("--step-only", action="store_true", help="only the decode step")
    p.add_argument("--sweep", action="store_true", help="try several block sizes per case")
    p.add_argument("--wide", action="store_true", help="--sweep over wide_configs (~30 per case)")
    p.add_argument("--products", default="", help="comma-separated product names (default: all)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, interpret mode")
    p.add_argument("--no-norm", action="store_true",
                   help="products without the fused-norm rows (they lose; run 10 measured them)")
    p.add_argument("--max-seconds", type=float, default=200.0, help="time budget, seconds")
    args = p.parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.max_seconds
    rows = [int(r) for r in args.rows.split(",")]
    dtype = jnp.bfloat16
    if args.smoke:
        rows, rounds, calls = [r for r in rows if r <= 3] or [1], 1, 1
        shapes = SMOKE_SHAPES
        copy_rate = measure_copy_rate(1 << 20, rounds)
    else:
        rounds, calls = 10, 5
        shapes = [s for fam in args.shapes.split(",") for s in SHAPES[fam]
                  if not args.products or s[0] in args.products.split(",")]
        copy_rate = measure_copy_rate(1 << 30, rounds)
    log(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16; copy rate "
        f"{copy_rate / 1e12:.3f} TB/s (ref {COPY_RATE_REF / 1e12:.2f}); % below = of that rate")
    log(f"{'product':<18} {'K->N':>13} {'M':>4} {'impl':<11} {'time':>12} {'%copy':>6}")
    # NOTE: products get ~60% of the budget (all of it with --sweep or --no-step).
    product_deadline = deadline if (args.sweep or args.no_step) else start + 0.6 * args.max_seconds
    totals: dict = {}  # (K, N, block_m) -> {config: summed us over the bucket's row counts}
    skipped = 0
    for name, k, n in [] if args.step_only else shapes:
        for m in rows:
            if time.perf_counter() > product_deadline:
                log(f"{name:<18} {k:>6}->{n:<6} {m:>4} skipped (time budget)")
                skipped += 1
                continue
            configs = ((wide_configs if args.wide else sweep_configs)(m, k, n, dtype)
                       if args.sweep else None)
            try:
                case = product_case(name, k, n, m, dtype=dtype, copy_rate=copy_rate,
                                    smoke=args.smoke, rounds=rounds, calls=calls, configs=configs,
                                    norm=not args.no_norm)
            except Exception as e:  # noqa: BLE001
                case = [dict(name=name, k=k, n=n, m=m, impl="xla", error=_short(e), cfg=None)]
            for r in case:
                print_row(r)
            add_totals(totals, (k, n, sm.block_rows(m)), case)
    if args.sweep:
        log("\n# fastest config per (K, N, block_m): paste into kernels/streaming_matmul.py TUNED")
        for key, by_cfg in sorted(totals.items()):
            if by_cfg:
                log(f"    {key}: {min(by_cfg, key=by_cfg.get)!r},")
    if not (args.no_step or args.sweep):
        cfg = preset("ouro-tiny" if args.smoke else "ouro-1.4b")
        decode_step_cases(cfg, 2 if args.smoke else 4, rows, dtype=dtype, copy_rate=copy_rate,
                          smoke=args.smoke, rounds=1 if args.smoke else 10, deadline=deadline)
    if skipped:
        log(f"# {skipped} product cases skipped for time: rerun with --shapes huginn --no-step")
    log(f"\n# done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
