"""Kernel checks and timings on the GPU: each Pallas kernel of loopjax.kernels against its
ref_ twin (bitwise for the pointwise kernels, fp32-accumulation tolerance for attention)
and timed against the XLA twin and, for decode attention, the Mosaic GPU kernel
(`paged_attention_mgpu`, impl "mgpu") and jax's shipped (deprecated)
`jax.experimental.pallas.ops.gpu.paged_attention` with the pool already in its layout
(one plane of our pool *is* its [Hkv, pages, page_size, D] layout).

    python -m loopjax.bench.kernels --out results/kernels.json     # H200, < 5 minutes
    python -m loopjax.bench.kernels --smoke                        # CPU, interpret mode
    python -m loopjax.bench.kernels --only sweep                   # decode kernel configs
                                                                   # (Triton and Mosaic GPU)

Times are device time per call: `iters` calls inside one jitted fori_loop (inputs behind
an optimization barrier so nothing is hoisted), divided by iters. Bandwidth counts the
bytes a call must move (attention: the K/V of every row's context; pointwise: inputs +
outputs) against the measured ~4.1 TB/s copy rate. Every case is wrapped: a failure
prints an error row and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import itertools
import json
import subprocess
import time
import traceback

import jax
import jax.numpy as jnp

from loopjax import layers

try:
    from loopjax import kernels as K
except ImportError:  # NOTE: a checkout run with PYTHONPATH=. (kernels/ not installed as loopjax.kernels)
    import kernels as K
# NOTE: not re-exported by the package (it imports the Mosaic GPU backend): loaded by path.
MGPU = importlib.import_module(f"{K.__name__}.paged_attention_mgpu")
KV_WRITE = importlib.import_module(f"{K.__name__}.kv_write")
ROPE_WRITE = importlib.import_module(f"{K.__name__}.rope_kv_write")

COPY_RATE = 4.1e12  # bytes/s, device-to-device copy on the H200 (docs/h200.md)
TIME_BUDGET_S = 280.0  # later cases print "skipped"; run sections apart with --only
# name: (Hq, Hkv, D, H, F, RoPE style)
MODELS = {
    "ouro-1.4b": (16, 16, 128, 2048, 5632, "rotate_half"),
    "huginn-0125": (55, 55, 96, 5280, 17920, "interleaved"),
}
SMOKE_MODELS = {"tiny-gqa": (4, 2, 16, 64, 96, "rotate_half"), "tiny-96": (2, 2, 96, 80, 40, "interleaved")}


def device_time(fn, args, iters: int) -> float:
    """Seconds per call of fn(*args), measured as iters calls in one jitted loop."""

    def loop(*args):
        def body(i, acc):
            a, _ = jax.lax.optimization_barrier((args, i))
            out = jax.tree.leaves(fn(*a))[0]
            return acc + out.reshape(-1)[0].astype(jnp.float32)

        return jax.lax.fori_loop(0, iters, body, jnp.float32(0))

    run = jax.jit(loop)
    run(*args).block_until_ready()  # compile + warm up
    t0 = time.perf_counter()
    run(*args).block_until_ready()
    return (time.perf_counter() - t0) / iters


class Bench:
    def __init__(self, smoke: bool, iters: int, budget_s: float = TIME_BUDGET_S):
        self.smoke, self.iters, self.rows, self.t0 = smoke, iters, [], time.perf_counter()
        self.budget_s = budget_s
        print(f"{'case':<44} {'impl':<10} {'us':>9} {'GB/s':>8} {'%4.1TB/s':>8}  check")

    def case(self, name: str, impl: str, fn, args, nbytes: float, check=None):
        row = dict(case=name, impl=impl, us=None, gbps=None, pct_copy=None, check=None, error=None)
        if time.perf_counter() - self.t0 > self.budget_s:
            row["error"] = "skipped: time budget"
        else:
            try:
                if check is not None:
                    row["check"] = check()
                sec = device_time(fn, args, self.iters)
                row.update(us=sec * 1e6, gbps=nbytes / sec / 1e9, pct_copy=100 * nbytes / sec / COPY_RATE)
            except Exception as e:  # noqa: BLE001 - one failing case must not end the run
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                if self.smoke:
                    traceback.print_exc()
        self.rows.append(row)
        check = row["check"] or ""
        if row["us"] is None:
            print(f"{name:<44} {impl:<10} {'-':>9} {'-':>8} {'-':>8}  {check} ERROR {row['error']}")
        else:
            print(
                f"{name:<44} {impl:<10} {row['us']:9.1f} {row['gbps']:8.0f} {row['pct_copy']:7.1f}%  {check}"
            )


def _attn_tol(dtype) -> float:
    """An attention kernel's max |diff| from the ref: fp32 accumulation in either order."""
    return 3e-2 if dtype == jnp.bfloat16 else 1e-4


def _attn_check(kernel, ref, args, tol):
    def check():
        out, want = jax.jit(kernel)(*args), jax.jit(ref)(*args)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
        return f"max_err={err:.2e} {'ok' if err <= tol else 'FAIL'}"

    return check


def _bitwise_check(kernel, ref, arg_sets):
    """Counts differing elements over every argument tuple of arg_sets (one per input draw)."""
    def check():
        # NOTE: the twin compiles as the models' steps do (no excess precision).
        kernel_jit = jax.jit(kernel)
        ref_jit = jax.jit(ref, compiler_options=layers.IDENTITY_COMPILER_OPTIONS)
        bad = total = 0
        for args in arg_sets:
            outs, wants = jax.tree.leaves(kernel_jit(*args)), jax.tree.leaves(ref_jit(*args))
            bad += sum(int(jnp.sum(o != w)) for o, w in zip(outs, wants, strict=True))
            total += sum(o.size for o in outs)
        return "bitwise ok" if bad == 0 else f"MISMATCH {bad}/{total}"

    return check


def _pool_case(key, hkv, d, rows, ctx, page_size, dtype, planes=2):
    """Random pool of rows * ctx / page_size pages (+1), scattered page table, plane 1."""
    m = -(-ctx // page_size)
    num_pages = rows * m + 1
    kk, kv, kp = jax.random.split(key, 3)
    shape = (planes, hkv, num_pages, page_size, d)
    kc, vc = jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype)
    pt = jax.random.permutation(kp, num_pages)[: rows * m].reshape(rows, m).astype(jnp.int32)
    return kc, vc, pt


def bench_decode(b: Bench, models, batches, contexts, dtype, interpret, page_size):
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except Exception:  # noqa: BLE001
        jax_paged = None
    tol = _attn_tol(dtype)
    for model, (hq, hkv, d, *_) in models.items():
        for rows in batches:
            for ctx in contexts:
                name = f"decode {model} B={rows} ctx={ctx}"
                try:
                    key = jax.random.key(rows * 7919 + ctx)
                    kc, vc, pt = _pool_case(key, hkv, d, rows, ctx, page_size, dtype)
                    q = jax.random.normal(jax.random.fold_in(key, 1), (rows, hq, d), dtype)
                    pos = jnp.full((rows,), ctx - 1, jnp.int32)
                    args = (q, kc, vc, jnp.int32(1), pt, jnp.arange(rows, dtype=jnp.int32), pos)
                except Exception as e:  # noqa: BLE001
                    print(f"{name:<44} setup ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                nbytes = 2 * rows * ctx * hkv * d * jnp.dtype(dtype).itemsize
                kern = functools.partial(K.paged_attention, interpret=interpret)
                b.case(
                    name, "pallas", kern, args, nbytes, _attn_check(kern, K.ref_paged_attention, args, tol)
                )
                mgpu = functools.partial(MGPU.paged_attention_mgpu, interpret=interpret)
                b.case(name, "mgpu", mgpu, args, nbytes, _attn_check(mgpu, K.ref_paged_attention, args, tol))
                b.case(name, "xla_ref", K.ref_paged_attention, args, nbytes)
                if jax_paged is not None:
                    k_pages, v_pages = kc[1], vc[1]  # pre-laid: [Hkv, pages, S, D]
                    shipped = functools.partial(
                        jax_paged.paged_attention,
                        k_splits=min(16, pt.shape[1]),
                        pages_per_compute_block=min(8, pt.shape[1]),
                        interpret=interpret,
                    )
                    jargs = (q, k_pages, v_pages, pt, pos + 1)
                    b.case(name, "jax_paged", shipped, jargs, nbytes)
                    del k_pages, v_pages
                del kc, vc


def bench_sweep(b: Bench, models, cases, dtype, interpret, page_size, configs, mgpu_configs):
    """Decode kernel configurations per case, to pick the defaults by measurement: the
    Triton kernel's (pages_per_block, num_warps, num_splits) as impl p{}w{}s{}, the Mosaic
    GPU kernel's (pages_per_block, num_stages, num_splits, heads_per_program) as
    m{}st{}s{}h{}; splits or heads d: the default."""
    impls = [(f"p{ppb}w{warps}s{splits or 'd'}", functools.partial(
        K.paged_attention, pages_per_block=ppb, num_warps=warps, num_splits=splits, interpret=interpret))
        for ppb, warps, splits in configs]
    impls += [(f"m{ppb}st{stages}s{splits or 'd'}h{heads or 'd'}", functools.partial(
        MGPU.paged_attention_mgpu, pages_per_block=ppb, num_stages=stages, num_splits=splits,
        heads_per_program=heads, interpret=interpret)) for ppb, stages, splits, heads in mgpu_configs]
    tol = _attn_tol(dtype)
    for model, (hq, hkv, d, *_) in models.items():
        for rows, ctx in cases:
            key = jax.random.key(rows * 7919 + ctx)
            kc, vc, pt = _pool_case(key, hkv, d, rows, ctx, page_size, dtype)
            q = jax.random.normal(jax.random.fold_in(key, 1), (rows, hq, d), dtype)
            pos = jnp.full((rows,), ctx - 1, jnp.int32)
            args = (q, kc, vc, jnp.int32(1), pt, jnp.arange(rows, dtype=jnp.int32), pos)
            nbytes = 2 * rows * ctx * hkv * d * jnp.dtype(dtype).itemsize
            for impl, kern in impls:
                check = _attn_check(kern, K.ref_paged_attention, args, tol) if impl[0] == "m" else None
                b.case(f"sweep decode {model} B={rows} ctx={ctx}", impl, kern, args, nbytes, check)
            del kc, vc


def bench_prefill(b: Bench, models, shapes, dtype, interpret, page_size):
    tol = _attn_tol(dtype)
    for model, (hq, hkv, d, *_) in models.items():
        for rows, new, cached in shapes:
            name = f"prefill {model} {rows}x{new} (+{cached} cached)"
            try:
                ctx = cached + new
                key = jax.random.key(rows * 31 + new)
                kc, vc, pt = _pool_case(key, hkv, d, rows, ctx, page_size, dtype)
                n = rows * new
                q = jax.random.normal(jax.random.fold_in(key, 1), (n, hq, d), dtype)
                row_of_token = jnp.repeat(jnp.arange(rows, dtype=jnp.int32), new)
                pos = jnp.tile(jnp.arange(cached, ctx, dtype=jnp.int32), rows)
                args = (q, kc, vc, jnp.int32(1), pt, row_of_token, pos)
            except Exception as e:  # noqa: BLE001
                print(f"{name:<44} setup ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                continue
            nbytes = 2 * rows * ctx * hkv * d * jnp.dtype(dtype).itemsize
            block = 16 if interpret else 64
            kern = functools.partial(K.prefill_attention, block_q=block, block_k=block, interpret=interpret)
            b.case(name, "pallas", kern, args, nbytes, _attn_check(kern, K.ref_prefill_attention, args, tol))
            b.case(name, "xla_ref", K.ref_prefill_attention, args, nbytes)
            del kc, vc


def check_kv_write(models, token_counts, dtype, interpret, page_size):
    """The Pallas KV write kernels against XLA on this device (bitwise): the write against
    XLA's scatter (both copy), and the RoPE + write from the projection's qkv against the
    model's RoPE, then the scatter. Prompts' tokens in consecutive slots of scattered pages,
    a few dropped. Not timed here: a timing loop would have to carry the pools, and XLA copies
    them there; the kernels' cost is measured inside prefill steps (`python -m
    loopjax.bench.prefill --trace`)."""
    for model, (hq, hkv, d, _, _, rope_style) in models.items():
        for n in token_counts:
            key = jax.random.key(n)
            pages = -(-n // page_size)
            shape = (4, hkv, pages + 1, page_size, d)
            page_of = jax.random.permutation(key, pages + 1)[:pages].astype(jnp.int32)
            t = jnp.arange(n, dtype=jnp.int32)
            slots = page_of[t // page_size] * page_size + t % page_size
            slots = jnp.where(t % 97 == 5, (pages + 1) * page_size, slots)  # the drop slot
            k, v, kc, vc, qkv, bias = (
                jax.random.normal(jax.random.fold_in(key, i), s, dtype) for i, s in enumerate(
                    ((n, hkv, d), (n, hkv, d), shape, shape, (n, (hq + 2 * hkv) * d), (2, hq, d))))
            kern = functools.partial(KV_WRITE.write_kv_kernel, interpret=interpret)
            check = _bitwise_check(kern, K.write_kv, [(kc, vc, jnp.int32(2), slots, k, v)])
            print(f"{f'kv_write {model} N={n}':<44} {'pallas':<10} {check()}")
            cos, sin = layers.rope_angles(t * 3 + 1, d, 10000.0)
            qk_bias = bias if rope_style == "interleaved" else None
            heads = dict(num_heads=hq, num_kv_heads=hkv, qk_bias=qk_bias)
            kern = functools.partial(ROPE_WRITE.rope_write_kv, interpret=interpret, **heads)
            ref = functools.partial(ROPE_WRITE.ref_rope_write_kv, **heads)
            check = _bitwise_check(kern, ref, [(qkv, cos, sin, kc, vc, jnp.int32(2), slots)])
            print(f"{f'rope_write_kv {model} N={n}':<44} {'pallas':<10} {check()}")


def _pointwise_inputs(seed, n, hq, hkv, d, h, f, dtype):
    ks = jax.random.split(jax.random.key(n + h + 1000 * seed), 8)
    cos, sin = layers.rope_angles(jnp.arange(n) * 3 + 1, d, 10000.0)
    return dict(
        x=jax.random.normal(ks[0], (n, h), dtype),
        res=jax.random.normal(ks[1], (n, h), dtype),
        w=1 + 0.1 * jax.random.normal(ks[2], (h,), dtype),
        w2=1 + 0.1 * jax.random.normal(ks[6], (h,), dtype),
        partials=jax.random.normal(ks[7], (8, n, h), jnp.float32),  # a split-K product's
        gate_up=3 * jax.random.normal(ks[3], (n, 2 * f), dtype),
        qkv=jax.random.normal(ks[4], (n, (hq + 2 * hkv) * d), dtype),
        bias=0.1 * jax.random.normal(ks[5], (2, hq, d), dtype),
        cos=cos,
        sin=sin,
    )


def bench_pointwise(b: Bench, models, token_counts, dtype, interpret, seeds=1):
    """Times each kernel and its XLA twin on the first input draw; the bitwise check covers
    `seeds` draws (a 1-ulp difference in a row sum shows in ~1 row in 200 at H = 5280)."""
    for model, (hq, hkv, d, h, f, rope_style) in models.items():
        for n in token_counts:
            draws = [_pointwise_inputs(s, n, hq, hkv, d, h, f, dtype) for s in range(seeds)]

            def arg_sets(*names, draws=draws):
                return [tuple(dr[k] for k in names) for dr in draws]

            item = jnp.dtype(dtype).itemsize
            norm_bytes = n * h * item
            for fn_name, names in (("rms_norm", ("x", "w")), ("add_rms_norm", ("x", "res", "w")),
                                   ("rms_norm_add", ("x", "res", "w"))):
                kern = functools.partial(getattr(K, fn_name), eps=1e-6, interpret=interpret)
                ref = functools.partial(getattr(K, "ref_" + fn_name), eps=1e-6)
                _pair(b, f"{fn_name} {model} N={n}", kern, ref, arg_sets(*names), len(names) * norm_bytes)
            # the product's output or its split-K partials, Ouro's order and Huginn's
            for y, order in itertools.product(("x", "partials"), ("norm_add_norm", "add_norm_norm")):
                kern = functools.partial(getattr(K, order), eps=1e-6, interpret=interpret)
                ref = functools.partial(getattr(K, "ref_" + order), eps=1e-6)
                nbytes = (4 if y == "x" else 3) * norm_bytes + (8 * n * h * 4 if y == "partials" else 0)
                _pair(b, f"{order}({y}) {model} N={n}", kern, ref, arg_sets(y, "res", "w", "w2"), nbytes)
            silu_bytes = 3 * n * f * item
            for fn_name in ("silu_mul", "silu_f32_mul"):
                kern = functools.partial(getattr(K, fn_name), interpret=interpret)
                ref = getattr(K, "ref_" + fn_name)
                _pair(b, f"{fn_name} {model} N={n}", kern, ref, arg_sets("gate_up"), silu_bytes)
            rope_bytes = 2 * n * (hq + hkv) * d * item
            # The other spellings: silu rounding each op, and the f32 (unrounded) residual sum and
            # bias add that XLA's default excess precision computes on CPU.
            literal = [
                ("silu_mul", K.silu_mul, K.ref_silu_mul, ("gate_up",), {}, silu_bytes),
                ("add_rms_norm", K.add_rms_norm, K.ref_add_rms_norm, ("x", "res", "w"), dict(eps=1e-6),
                 3 * norm_bytes),
            ]
            rope_interleaved_args = ("qkv", "bias", "cos", "sin")
            if rope_style == "interleaved":
                literal.append(("rope_interleaved", K.rope_interleaved_qk, K.ref_rope_interleaved_qk,
                                rope_interleaved_args, {}, rope_bytes))
            for fn_name, fn, ref, names, kw, nbytes in literal:
                alt = fn_name != "silu_mul"  # silu_mul's alternative is the rounded spelling
                kern = functools.partial(fn, round_each_op=not alt, interpret=interpret, **kw)
                sets = arg_sets(*names)
                check = _bitwise_check(kern, functools.partial(ref, **kw), sets)
                spelling = "f32_sum" if alt else "round_each_op"
                b.case(f"{fn_name} {spelling} {model} N={n}", "alt", kern, sets[0], nbytes, check)
            if rope_style == "interleaved":
                kern = functools.partial(K.rope_interleaved_qk, interpret=interpret)
                _pair(b, f"rope_interleaved {model} N={n}", kern, K.ref_rope_interleaved_qk,
                      arg_sets(*rope_interleaved_args), rope_bytes)
            else:
                heads = dict(num_heads=hq, num_kv_heads=hkv)
                kern = functools.partial(K.rope_rotate_half_qk, interpret=interpret, **heads)
                ref = functools.partial(K.ref_rope_rotate_half_qk, **heads)
                _pair(b, f"rope_rotate_half {model} N={n}", kern, ref, arg_sets("qkv", "cos", "sin"),
                      rope_bytes)


def _pair(b: Bench, name, kern, ref, arg_sets, nbytes):
    """Times kern and ref on arg_sets[0]; the kernel's bitwise check covers every set."""
    b.case(name, "pallas", kern, arg_sets[0], nbytes, _bitwise_check(kern, ref, arg_sets))
    b.case(name, "xla_ref", ref, arg_sets[0], nbytes)


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the rows as JSON to this path")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    parser.add_argument("--iters", type=int, default=None, help="calls per timing loop")
    parser.add_argument(
        "--budget", type=float, default=TIME_BUDGET_S, help="seconds before cases are skipped"
    )
    parser.add_argument("--seeds", type=int, default=1,
                        help="input draws the pointwise kernels' bitwise check covers")
    parser.add_argument("--models", default=None, help="comma list of the models to run (default: all)")
    parser.add_argument("--tokens", default=None,
                        help="pointwise: comma list of token counts (default: 128,2048)")
    parser.add_argument("--sweep-cases", default=None,
                        help="sweep: comma list of ROWSxCONTEXT (default: a fixed set)")
    parser.add_argument("--sweep-mgpu", default=None,
                        help="sweep: ';'-separated Mosaic configs PAGES,STAGES,SPLITS,HEADS (d: default); "
                             "given, the Triton configs are left out")
    parser.add_argument(
        "--only",
        default="pointwise,decode,prefill,kv_write",
        help="comma list of sections: pointwise,decode,prefill,kv_write,sweep",
    )
    args = parser.parse_args(argv)
    dtype = jnp.bfloat16
    if args.smoke:
        models, interpret, iters, page = SMOKE_MODELS, True, args.iters or 1, 8  # mgpu: 8-slot pages
        batches, contexts, prefill_shapes, tokens = (1, 3), (16, 40), [(2, 7, 5)], (5,)
    else:
        models, interpret, iters, page = MODELS, False, args.iters or 20, 16
        batches, contexts = (1, 8, 32, 128), (512, 2048, 4096)
        prefill_shapes, tokens = [(1, 2048, 0), (8, 256, 0), (4, 512, 512)], (128, 2048)
    if args.models:
        models = {name: models[name] for name in args.models.split(",")}
    if args.tokens:
        tokens = tuple(int(t) for t in args.tokens.split(","))
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device}; dtype {jnp.dtype(dtype).name}; iters {iters}")
    b = Bench(args.smoke, iters, args.budget)
    sections = args.only.split(",")
    if "pointwise" in sections:
        bench_pointwise(b, models, tokens, dtype, interpret, args.seeds)
    if "decode" in sections:
        bench_decode(b, models, batches, contexts, dtype, interpret, page)
    if "prefill" in sections:
        bench_prefill(b, models, prefill_shapes, dtype, interpret, page)
    if "kv_write" in sections:
        check_kv_write(models, (32, 2048) if not args.smoke else (5, 40), dtype, interpret, page)
    if "sweep" in sections:  # not in the default run: `--only sweep`
        if args.smoke:
            sweep_cases, configs = [(3, 40)], [(1, 4, None), (2, 2, 1)]
            mgpu_configs = [(8, 2, None, None), (8, 2, None, 2)]
        else:
            sweep_cases = [(1, 4096), (8, 2048), (32, 4096), (128, 1024)]
            configs = [(p, w, None) for p in (1, 2, 4, 8) for w in (4, 8)] + [(4, 4, 1), (8, 8, 1)]
            mgpu_configs = [(4, 2, None, None), (4, 3, None, None), (4, 4, None, None),
                            (8, 2, None, None), (8, 3, None, None), (4, 3, 1, None)]
        if args.sweep_cases:
            sweep_cases = [tuple(int(v) for v in case.split("x")) for case in args.sweep_cases.split(",")]
        if args.sweep_mgpu:
            configs = []
            mgpu_configs = [tuple(None if v == "d" else int(v) for v in c.split(","))
                            for c in args.sweep_mgpu.split(";")]
        bench_sweep(b, models, sweep_cases, dtype, interpret, page, configs, mgpu_configs)
    errors = sum(r["error"] is not None for r in b.rows)
    failed = sum(  # "alt" rows are alternative spellings: a mismatch there is information
        r["impl"] != "alt" and ("FAIL" in (r["check"] or "") or "MISMATCH" in (r["check"] or ""))
        for r in b.rows
    )
    print(f"{len(b.rows)} rows, {errors} errors, {failed} failed checks, {time.perf_counter() - b.t0:.0f} s")
    if args.out:
        meta = dict(
            jax=jax.__version__,
            device=jax.devices()[0].device_kind,
            commit=_commit(),
            smoke=args.smoke,
            date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            copy_rate=COPY_RATE,
        )
        with open(args.out, "w") as fh:
            json.dump(dict(meta=meta, rows=b.rows), fh, indent=1)
        print(f"wrote {args.out}")
    return b.rows


if __name__ == "__main__":
    main()
