"""Device benchmark of packed prefill against the FLOP roofline: `python -m loopjax.bench.prefill`.

    python -m loopjax.bench.prefill --preset ouro-1.4b,huginn-0125 --backend xla,pallas \\
        --out prefill.json
    python -m loopjax.bench.prefill --smoke              # tiny presets on CPU

Throughput: for each (preset, attention backend, shape R x T: R prompts of T tokens packed
into one step from position 0), a `Runner` (the engine's device half) compiled for exactly
that prefill bucket (R rows, R*T tokens; page tables T tokens wide), timed with `Runner.run`
(the jitted step plus its one host read of the sampled tokens, as every engine step does):
median of --iters after a warm-up call. Every case of a preset compiles ahead, the runners
in parallel threads (`Runner.precompile`; `presets[].precompile_s` in the JSON), each case's
KV pool allocated up front and freed after its timing. `compiles_during` counts compilations
during the timed calls (must be 0).

Start-up (--startup-backends): `Engine(model, config)` with the strict compile guard on, timed
from construction to the end of its warm-up (pool allocation + compiling every bucket), with
its compile count; then --steady-requests requests run through `engine.step()` (prefill, then
decode): the compile counter must not move (the guard would raise `CompileAfterWarmup`).
--startup-config default = `EngineConfig()` (every default bucket: the serving start-up);
small = one decode and one prefill bucket.

Shapes: --shapes for Ouro, --huginn-shapes for Huginn ('none': no throughput cases).
XLA's prefill attention scores every key of every row of the step (ref_paged_attention), so
its memory grows as tokens x rows x T: a case that runs out of memory is reported as failed.

FLOPs of a step (dense products + causal attention, nothing counted twice; P = weights of
the 2-D matrices of a part, L = loops, Hq x D = query heads x head dim):
  Ouro:   2·P_layers·L per token + 2·H·V per row (lm_head of the row's last token only)
  Huginn: 2·(P_prelude + P_coda + P_adapter_input + (P_core + P_adapter_state)·L) per token
          (e's half of the adapter once: huginn.inject; the coda runs over every token, for
          its KV) + 2·H·V per row (the tied lm_head over the rows' last tokens: steps.huginn_step)
  attention, per row of T tokens from position 0: 4·Hq·D·T(T+1)/2 per attention pass,
          passes = layers·L (Ouro) or prelude + coda + core·L (Huginn)
`pct_peak` = FLOPs / step time / --peak-tflops (790 TFLOP/s, the H200's dense bf16 the lead
uses). Stops starting cases once --max-seconds is spent (estimating from the longest so far).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import numpy as np

from loopjax.bench.common import (
    Budget,
    default_dtype,
    error_text,
    make_cli,
    names,
    run_interruptible,
    write_json,
)
from loopjax.bench.trace_summary import trace_runs

SMOKE = dict(preset="ouro-tiny,huginn-tiny", shapes="1x32,2x16", huginn_shapes="2x16", iters=2,
             page_size=8, startup_config="small", steady_requests=2, steady_prompt_len=20,
             max_seconds=120.0)

RECORD_FIELDS = ("preset", "backend", "rows", "prompt_len", "tokens", "bucket", "loops",
                 "gflop_per_token", "step_gflop", "median_ms", "min_ms", "max_ms", "tokens_per_s",
                 "tflops", "pct_peak", "compiles_during", "case_s")
ENGINE_FIELDS = ("preset", "backend", "config", "warmup_s", "compilations", "prefill_buckets",
                 "decode_rows", "steady_state_compiles", "steady_state_steps", "steady_state_ok")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="ouro-1.4b,huginn-0125", help="comma-separated presets")
    parser.add_argument("--shapes", default="1x2048,8x256,4x512,32x512",
                        help="packed prefill shapes ROWSxTOKENS (Ouro and others; 'none')")
    parser.add_argument("--huginn-shapes", default="1x2048,8x256,4x512",
                        help="shapes for Huginn presets (32 loops: fewer tokens per step)")
    parser.add_argument("--backend", default="xla,pallas", help="comma-separated: xla, pallas")
    parser.add_argument("--matmul", default="auto",
                        help="products (loopjax.matmul_ops): auto (the engine default), xla, streaming")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak, TFLOP/s")
    parser.add_argument("--dtype", default=None, help="default: bf16 (fp32 for tiny presets)")
    parser.add_argument("--startup-config", default="default", choices=("default", "small"),
                        help="EngineConfig whose start-up is timed: the defaults (every default "
                             "bucket) or a small one")
    parser.add_argument("--startup-backends", default="xla",
                        help="backends whose engine start-up is timed (comma-separated; 'none')")
    parser.add_argument("--steady-requests", type=int, default=4,
                        help="requests of the steady-state run (4 output tokens each)")
    parser.add_argument("--steady-prompt-len", type=int, default=200)
    parser.add_argument("--max-seconds", type=float, default=150.0,
                        help="start no new case once this much time is spent (or would be)")
    parser.add_argument("--trace", default=None,
                        help="also trace 2 steps of each shape under this folder and print their kernels")
    parser.add_argument("--smoke", action="store_true", help="tiny presets, small sizes (CPU)")
    parser.add_argument("--out", default=None, help="write the records as JSON here")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in str(text).split(","):
        if item.strip() and item.strip() != "none":
            rows, tokens = item.lower().split("x")
            shapes.append((int(rows), int(tokens)))
    return shapes


def _matrix_params(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree) if x.ndim == 2)


def step_flops(model, rows: int, prompt_len: int, loops: int) -> float:
    """FLOPs of one prefill step of `rows` prompts of `prompt_len` tokens (module docstring)."""
    cfg, p = model.cfg, model.params
    tokens = rows * prompt_len
    head = 2 * cfg.hidden_size * cfg.vocab_size
    if cfg.family == "ouro":
        dense = 2 * _matrix_params(p["layers"]) * loops * tokens + head * rows
        passes, heads_dim = cfg.num_layers * loops, cfg.num_heads * cfg.head_dim
    else:
        per_token = 2 * (_matrix_params(p["prelude"]) + _matrix_params(p["coda"])
                         + _matrix_params(p["adapter_input"])
                         + (_matrix_params(p["core"]) + _matrix_params(p["adapter_state"])) * loops)
        dense = per_token * tokens + head * rows
        passes = cfg.num_prelude_layers + cfg.num_coda_layers + cfg.num_core_layers * loops
        heads_dim = cfg.hidden_size  # num_heads x head_dim
    attention = rows * 4 * heads_dim * prompt_len * (prompt_len + 1) / 2 * passes
    return float(dense + attention)


@dataclass
class ShapeCase:
    preset: str
    backend: str
    rows: int
    prompt_len: int
    runner: object = None
    row_inputs: list = field(default_factory=list)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.rows * self.prompt_len


def prepare_shape(model, preset: str, rows: int, prompt_len: int, backend: str, args) -> ShapeCase:
    """A Runner (own KV pool) compiled for exactly this prefill bucket, and its rows."""
    from loopjax import kv_cache
    from loopjax.batch import greedy_row
    from loopjax.matmul_ops import matmul_ops
    from loopjax.runner import Runner

    case = ShapeCase(preset, backend, rows, prompt_len)
    cfg, loops = model.cfg, model.cfg.default_loops
    pages_per_row = -(-prompt_len // args.page_size)
    try:
        layout = kv_cache.make_layout(cfg, "per_loop", page_size=args.page_size, dtype=model.dtype,
                                      num_pages=rows * pages_per_row, max_loops=loops)
        case.runner = Runner(model, layout, decode_rows=(rows,), prefill_buckets=((rows, case.tokens),),
                             max_pages=pages_per_row, max_loops=loops, backend=backend,
                             ops=matmul_ops(args.matmul))
        rng = np.random.default_rng(0)
        case.row_inputs = [greedy_row(rng.integers(3, cfg.vocab_size, prompt_len).tolist(), 0,
                                      list(range(r * pages_per_row, (r + 1) * pages_per_row)),
                                      loops=loops) for r in range(rows)]
    except Exception as e:  # noqa: BLE001  (e.g. out of memory for the pool)
        case.error = error_text(e)
    return case


def precompile(cases: list[ShapeCase], loops: int) -> None:
    """Compile every case's prefill step ahead, the runners in parallel threads (each traces,
    then XLA compiles). A case that fails here compiles on its first run instead."""
    import dataclasses as dc

    from loopjax.steps import fused

    def one(case: ShapeCase) -> None:
        runner = case.runner
        kind = fused(loops)
        if getattr(runner, "unroll", 1) != 1:
            kind = dc.replace(kind, unroll=runner.unroll)
        batch = runner.make_batch(case.row_inputs, decode=False, loop_begin=0, loop_end=loops)
        runner.precompile([(batch, kind)])

    live = [c for c in cases if c.error is None and hasattr(c.runner, "precompile")]
    with ThreadPoolExecutor(max(1, len(live))) as pool:
        for case, error in zip(live, pool.map(lambda c: _try(one, c), live)):
            if error:
                print(f"{case.preset} {case.backend} {case.rows}x{case.prompt_len}: precompile "
                      f"failed ({error}); compiling on first run", flush=True)


def _try(fn, *a) -> str | None:
    try:
        fn(*a)
    except Exception as e:  # noqa: BLE001
        return error_text(e, 200)
    return None


def time_shape(model, case: ShapeCase, args, budget: Budget, records: list) -> None:
    """Times one prepared case: runner.run (the step plus its one host read)."""
    what = f"{case.preset} {case.backend} {case.rows}x{case.prompt_len}"
    loops = model.cfg.default_loops
    base = dict(preset=case.preset, backend=case.backend, rows=case.rows, prompt_len=case.prompt_len,
                tokens=case.tokens, loops=loops)
    # Estimate: the longest case so far of this preset, scaled by tokens.
    if not budget.allows(what, f"case-{case.preset}", factor=case.tokens / 2048):
        return
    start = time.perf_counter()
    runner = case.runner
    try:
        if case.error:
            raise RuntimeError(case.error)
        run = lambda: runner.run(case.row_inputs, decode=False)  # noqa: E731  (one host read each)
        run()  # warm-up (compiles here if the precompile missed)
        compiled = runner.compilations
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        flops = step_flops(model, case.rows, case.prompt_len, loops)
        median = statistics.median(times)
        rec = {**base, "bucket": [case.rows, case.tokens],
               "gflop_per_token": flops / case.tokens / 1e9, "step_gflop": flops / 1e9,
               "median_ms": median * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
               "tokens_per_s": case.tokens / median, "tflops": flops / median / 1e12,
               "pct_peak": 100.0 * flops / median / (args.peak_tflops * 1e12),
               "compiles_during": runner.compilations - compiled}
        if args.trace:
            tag = f"{case.preset}_{case.backend}_{case.rows}x{case.prompt_len}"
            rec["trace"] = trace_runs(run, f"{args.trace}/{tag}", 2)
    except Exception as e:  # noqa: BLE001  (one failed case, e.g. out of memory, must not end the run)
        rec = {**base, "error": error_text(e), "median_ms": math.nan}
    took = time.perf_counter() - start
    budget.spent(f"case-{case.preset}", took * 2048 / case.tokens)
    rec["case_s"] = took
    records.append(rec)
    _print([rec])


def startup_config(name: str, backend: str):
    """The EngineConfig whose start-up is timed: 'default' (every default bucket) or 'small'."""
    from loopjax.engine import EngineConfig
    common = dict(attention_backend=backend, strict_compile=True, verbose=False)
    if name == "default":
        return EngineConfig(**common)
    if name == "small":
        return EngineConfig(max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=64,
                            prefill_token_buckets=(64,), max_prefill_rows=4, max_context_len=128,
                            **common)
    raise ValueError(f"unknown start-up config {name!r}; choose 'default' or 'small'")


def bench_startup(model, preset: str, backend: str, args, budget: Budget, engines: list) -> None:
    """Engine(model, config) start-up (pool + warm-up of every bucket), its compile count, and
    a steady-state run through engine.step() that must compile nothing."""
    from loopjax.engine import Engine
    config = startup_config(args.startup_config, backend)
    num_buckets = len(config.decode_row_buckets) + len(config.prefill_token_buckets)
    what = f"{preset} {backend} engine start-up ({args.startup_config})"
    if not budget.allows(what, "compile", factor=num_buckets):
        return
    info = {"preset": preset, "backend": backend, "config": args.startup_config}
    start = time.perf_counter()
    try:
        engine = Engine(model, config)
        info.update(warmup_s=time.perf_counter() - start, compilations=engine.runner.compilations,
                    prefill_buckets=[list(b) for b in engine.runner.buckets.prefill],
                    decode_rows=list(engine.runner.buckets.decode_rows))
        info.update(_steady_state(engine, args.steady_requests, args.steady_prompt_len))
        del engine
    except Exception as e:  # noqa: BLE001
        info.update(error=error_text(e), steady_state_ok=False)
    engines.append(info)
    print(f"{preset:>12} {backend:>6}: engine start-up ({args.startup_config}) "
          + (f"{info['warmup_s']:.1f} s, {info['compilations']} compilations; steady state "
             f"{info['steady_state_steps']} steps, {info['steady_state_compiles']} compilations"
             if "warmup_s" in info and "steady_state_steps" in info else "")
          + (f" FAILED {info['error']}" if "error" in info else ""), flush=True)
    gc.collect()


def _steady_state(engine, num_requests: int, prompt_len: int) -> dict:
    """Requests through engine.step() (prefill, then decode): the compile counter must not
    move after warm-up (the strict guard raises CompileAfterWarmup if it would)."""
    from loopjax.sampling_params import SamplingParams
    before, steps = engine.runner.compilations, 0
    out = {}
    try:
        for r in range(num_requests):
            engine.add_request([3 + (r + i) % 50 for i in range(prompt_len)],
                               SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=r))
        while engine.has_unfinished():
            engine.step()
            steps += 1
    except Exception as e:  # noqa: BLE001
        out["error"] = error_text(e)
    compiles = engine.runner.compilations - before
    return {**out, "steady_state_compiles": compiles, "steady_state_steps": steps,
            "steady_state_ok": compiles == 0 and "error" not in out}


def _print(records: list[dict]) -> None:
    for r in records:
        head = f"{r['preset']:>12} {r['backend']:>6} {r['rows']:>3} x {r['prompt_len']:>5}"
        if "error" in r:
            print(f"{head}: FAILED {r['error']}", flush=True)
            continue
        print(f"{head}: {r['median_ms']:9.2f} ms {r['tokens_per_s']:>10.0f} tok/s "
              f"{r['gflop_per_token']:7.2f} GFLOP/tok {r['tflops']:7.1f} TFLOP/s "
              f"{r['pct_peak']:5.1f}% of peak  (bucket {r['bucket']}, compiles {r['compiles_during']})",
              flush=True)


def _table(records: list[dict], engines: list[dict]) -> None:
    print("\n| preset | backend | rows × tokens | ms / step | tok/s | GFLOP / tok | TFLOP/s | % of peak |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            print(f"| {r['preset']} | {r['backend']} | {r['rows']} × {r['prompt_len']} | failed "
                  "|  |  |  |  |")
            continue
        print(f"| {r['preset']} | {r['backend']} | {r['rows']} × {r['prompt_len']} | {r['median_ms']:,.2f} "
              f"| {r['tokens_per_s']:,.0f} | {r['gflop_per_token']:.2f} | {r['tflops']:.1f} "
              f"| {r['pct_peak']:.1f}% |")
    print("\n| preset | backend | config | start-up s | compilations | steady-state compilations |")
    print("|---|---|---|---|---|---|")
    for e in engines:
        if "warmup_s" not in e:
            print(f"| {e['preset']} | {e['backend']} | {e.get('config', 'bench')} | failed |  |  |")
            continue
        print(f"| {e['preset']} | {e['backend']} | {e.get('config', 'bench')} | {e['warmup_s']:.1f} "
              f"| {e['compilations']} | {e.get('steady_state_compiles', '-')} |")


def run(args: argparse.Namespace) -> int:
    from loopjax.model import load

    device = jax.devices()[0].device_kind
    print(f"loopjax prefill benchmark on {device}", flush=True)
    records: list[dict] = []
    engines: list[dict] = []
    presets: list[dict] = []  # per preset: the ahead-of-time compile of its cases
    budget = Budget(args.max_seconds)
    state = {"interrupted": False}

    def save() -> None:  # after every case: a run cut short still leaves its JSON
        write_json(args.out, {"device": device, "args": vars(args), "peak_tflops": args.peak_tflops,
                              "seconds": budget.elapsed(), "skipped": budget.skipped,
                              "interrupted": state["interrupted"], "presets": presets,
                              "engines": engines, "records": records})

    def bench_presets() -> None:
        for preset in names(args.preset, none=True):
            # A later preset starts only if the previous one's set-up time still fits.
            if not budget.allows(f"{preset} (load)", "preset"):
                continue
            start = time.perf_counter()
            try:
                model = load(preset, default_dtype(preset, args.dtype))
            except Exception as e:  # noqa: BLE001
                engines.append({"preset": preset, "backend": "",
                                "error": error_text(e)})
                continue
            shapes = parse_shapes(args.huginn_shapes if model.cfg.family == "huginn" else args.shapes)
            cases = [prepare_shape(model, preset, rows, prompt_len, backend, args)
                     for backend in names(args.backend, none=True) for rows, prompt_len in shapes]
            before = sum(c.runner.compilations for c in cases if c.runner is not None)
            compile_start = time.perf_counter()
            precompile(cases, model.cfg.default_loops)
            compile_s = time.perf_counter() - compile_start
            budget.spent("compile", compile_s / max(1, len(cases)))
            budget.spent("preset", time.perf_counter() - start)
            compiles = sum(c.runner.compilations for c in cases if c.runner is not None) - before
            presets.append({"preset": preset, "setup_s": time.perf_counter() - start,
                            "precompile_s": compile_s, "compilations": compiles, "cases": len(cases)})
            print(f"{preset}: {compiles} prefill steps compiled in {compile_s:.1f} s", flush=True)
            for i, case in enumerate(cases):
                time_shape(model, case, args, budget, records)
                cases[i] = None  # frees its KV pool
                gc.collect()
                save()
            for backend in names(args.startup_backends, none=True):
                bench_startup(model, preset, backend, args, budget, engines)
                save()
            model = None
            gc.collect()

    run_interruptible(bench_presets, state)
    budget.report_done()
    save()
    _table(records, engines)
    bad = any("error" in r for r in records + engines) or not (records or engines)
    bad = bad or any(r.get("compiles_during") for r in records)
    bad = bad or any(not e.get("steady_state_ok", False) for e in engines) or state["interrupted"]
    return 1 if bad else 0


_PARSER, main = make_cli("python -m loopjax.bench.prefill", __doc__, add_arguments, run, SMOKE)


if __name__ == "__main__":
    sys.exit(main())
