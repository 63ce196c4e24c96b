"""Device benchmark of adaptive exits in decode: `python -m loopjax.bench.adaptive`.

    python -m loopjax.bench.adaptive --preset huginn-0125,ouro-1.4b --rows 1,8,32 --context 512 \\
        --out adaptive.json
    python -m loopjax.bench.adaptive --smoke             # tiny presets on CPU

Random bf16 weights exit arbitrarily, so this measures what a skipped loop saves rather than
quality. For each (preset, rows) at one context: a KV pool whose page tables cover `context`
positions per row (rows wrap around a pool capped at --kv-gb), one decode token per row at
position context - 1, and these decode steps, each timed as the median of --iters
submissions after a warm-up call (block_until_ready each; every step is ONE submission):

  fixed      the fixed-depth fused step at the model's depth (fori_loop, static trip count)
  skip       the adaptive step (one `lax.while_loop` that ends once every real row exited),
             rows in skip mode:
             - trace E:  every row's token runs E loops, as the engine plans an `exit_trace`
                         (row loops = E, skip; Huginn rows carry no criterion)
             - steps E:  (Huginn) the `steps` criterion at E (exits.py: replays a trace and
                         marks the row exited, so the while_loop can end)
             - q T:      (Ouro) Q-exit threshold T (the exits random weights give: mean loops)
             - CRIT auto (Huginn) a criterion at its default threshold (mean loops reported)
  select     the adaptive step with rows in select mode (run every loop, pick by the rule):
             Huginn: each --select-criteria (the logit ones run the coda on every checked
             loop); Ouro: the Q-exit threshold on the fixed step (its exit gate is always on)
  depth E    (--baseline-rows) the fixed-depth fused step at E loops, the floor for skip E

Reported per case: mean loops per token run (skip / fixed: the step's exit loops; select:
the depth, with the rule's pick in `selected_loops`), step time (µs),
tokens/s, and against `fixed`: µs saved and µs saved per loop skipped
(= (fixed - this) / (depth - mean loops)). `fixed_us_per_loop` = fixed / depth for scale.
Every step shape of a preset compiles ahead (`Runner.precompile`: XLA compiles in parallel
threads; `presets[].precompile_s` in the JSON). Stops starting cases once --max-seconds is
spent (estimating each case from the longest one so far).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time

import jax
import numpy as np

from loopjax.bench.common import (
    Budget,
    decode_pool,
    decode_rows,
    default_dtype,
    error_text,
    ints,
    make_cli,
    names,
    run_interruptible,
    time_calls,
    write_json,
)

SMOKE = dict(preset="huginn-tiny,ouro-tiny", rows="2", context=32, iters=2, kv_gb=0.01, page_size=8,
             huginn_exits="4,8", ouro_exits="2,4", baseline_rows="2", max_seconds=120.0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="huginn-0125,ouro-1.4b", help="comma-separated presets")
    parser.add_argument("--rows", default="1,8,32", help="comma-separated decode rows")
    parser.add_argument("--context", type=int, default=512, help="context length of every row")
    parser.add_argument("--huginn-exits", default="8,16,32",
                        help="Huginn loops per token of the trace / steps exits (capped at the depth)")
    parser.add_argument("--ouro-exits", default="1,2,3,4", help="Ouro loops per token of the trace exits")
    parser.add_argument("--ouro-threshold", type=float, default=0.5, help="Ouro Q-exit threshold")
    parser.add_argument("--skip-criteria", default="kl",
                        help="Huginn criteria timed in skip mode at their default threshold")
    parser.add_argument("--select-criteria", default="kl,latent-diff",
                        help="Huginn criteria timed in select mode (all loops)")
    parser.add_argument("--baseline-rows", default="8",
                        help="rows for which the fixed-depth step at each exit depth is timed too")
    parser.add_argument("--backend", default="xla", choices=("xla", "pallas"))
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-gb", type=float, default=40.0, help="KV pool cap in GB")
    parser.add_argument("--dtype", default=None, help="default: bf16 (fp32 for tiny presets)")
    parser.add_argument("--max-seconds", type=float, default=150.0,
                        help="start no new case once this much time is spent (or would be)")
    parser.add_argument("--smoke", action="store_true", help="tiny presets, small sizes (CPU)")
    parser.add_argument("--out", default=None, help="write the records as JSON here")


RECORD_FIELDS = ("preset", "backend", "rows", "context", "depth", "variant", "exit_mode",
                 "exit_rule", "mean_loops", "selected_loops", "median_us", "min_us", "max_us", "tokens_per_s",
                 "fixed_us", "fixed_us_per_loop", "saved_us", "us_saved_per_loop_skipped",
                 "kv_pages_wrapped", "compiled", "case_s")


def cases(family: str, depth: int, args) -> list[tuple]:
    """(variant, exit_mode, exit_rule, row_change, fixed_count or None) of one rows setting,
    in the order run: the fixed step first (the others are compared with it)."""
    from loopjax.exits import ExitSpec
    out = [("fixed", "fixed", f"depth {depth}", {}, depth)]
    if family == "huginn":
        exits = sorted({e for e in ints(args.huginn_exits) if 1 <= e <= depth})
        for e in exits:
            out.append((f"trace{e}", "skip", f"trace {e}", dict(loops=e, exit_skip=True), None))
        for e in exits:
            out.append((f"steps{e}", "skip", f"steps {e}",
                        dict(exit_skip=True, exit_spec=ExitSpec("steps", e)), None))
        for c in names(args.skip_criteria):
            out.append((f"skip-{c}", "skip", f"{c} auto", dict(exit_skip=True, exit_spec=ExitSpec(c)), None))
        for c in names(args.select_criteria):
            out.append((f"select-{c}", "select", f"{c} auto",
                        dict(exit_skip=False, exit_spec=ExitSpec(c)), None))
    else:
        q = args.ouro_threshold
        out.append((f"skip-q{q}", "skip", f"q {q}", dict(exit_skip=True, exit_threshold=q), None))
        out.append((f"select-q{q}", "select", f"q {q}", dict(exit_threshold=q), depth))
        for e in sorted({e for e in ints(args.ouro_exits) if 1 <= e <= depth}):
            out.append((f"trace{e}", "skip", f"trace {e}", dict(loops=e, exit_skip=True), None))
    return out


def baseline_depths(family: str, depth: int, args) -> list[int]:
    exits = ints(args.huginn_exits if family == "huginn" else args.ouro_exits)
    return sorted({e for e in exits if 1 <= e < depth})


def bench_preset(model, preset: str, args, budget: Budget, records: list, save=lambda: None,
                 setup_start: float | None = None) -> dict:
    """Every case of one preset; `save()` after each record; the set-up time (from
    `setup_start`: load + pool + compiles) feeds the budget's estimate for the next preset."""
    from loopjax.runner import Runner
    from loopjax.steps import fused_kind

    cfg, context = model.cfg, args.context
    depth = cfg.default_loops
    rows_list = ints(args.rows)
    layout, pages_per_row, num_pages = decode_pool(model, "per_loop", args.page_size, depth,
                                                   max(rows_list), context, args.kv_gb)
    runner = Runner(model, layout, decode_rows=tuple(rows_list), prefill_buckets=(),
                    max_pages=pages_per_row, max_loops=depth, backend=args.backend)
    plans = {}  # rows -> [(variant, mode, rule, batch, kind)]
    for rows in rows_list:
        base_rows = decode_rows(rows, pages_per_row, num_pages, context, depth)
        todo = cases(cfg.family, depth, args)
        if rows in ints(args.baseline_rows):
            todo += [(f"depth{e}", "fixed", f"depth {e}", dict(loops=e), e)
                     for e in baseline_depths(cfg.family, depth, args)]
        plans[rows] = []
        for variant, mode, rule, change, count in todo:
            row_inputs = [dataclasses.replace(r, **change) for r in base_rows]
            adaptive = count is None
            batch = runner.make_batch(row_inputs, decode=True, loop_begin=0,
                                      loop_end=max(r.loops for r in row_inputs), adaptive=adaptive)
            # NOTE: the kind the engine would dispatch (the greedy sampler for all-greedy rows)
            kind = fused_kind(depth if adaptive else count, decode=True, adaptive=adaptive,
                              all_greedy=all(r.params.is_plain_greedy for r in row_inputs))
            plans[rows].append((variant, mode, rule, batch, kind))
    # Every (rows, kind) compiles ahead, the XLA compiles in parallel threads (Runner.precompile).
    compiled: set = set()
    start = time.perf_counter()
    try:
        steps = {(rows, kind): (batch, kind) for rows, plan in plans.items() for *_, batch, kind in plan}
        runner.precompile(list(steps.values()))
        compiled = set(steps)
    except Exception as e:  # noqa: BLE001  (older runners: compile on first use)
        print(f"precompile failed ({error_text(e, 200)}); compiling per case", flush=True)
    info = {"preset": preset, "precompile_s": time.perf_counter() - start,
            "compilations": runner.compilations, "pool_pages": num_pages}
    print(f"{preset}: {info['compilations']} step shapes compiled in {info['precompile_s']:.1f} s",
          flush=True)
    if setup_start is not None:
        info["setup_s"] = time.perf_counter() - setup_start
        budget.spent("preset", info["setup_s"])
    for rows in rows_list:
        base = dict(preset=preset, backend=args.backend, rows=rows, context=context, depth=depth,
                    kv_pages_wrapped=rows * pages_per_row > num_pages)
        fixed_us = None
        for variant, mode, rule, batch, kind in plans[rows]:
            compiles = (rows, kind) not in compiled
            if not budget.allows(f"{preset} rows {rows} {variant}", compiles):
                continue
            start = time.perf_counter()
            try:
                outs: list = []
                times = time_calls(lambda b=batch, k=kind, o=outs: o.append(runner.submit(b, k)) or o[-1],
                                   args.iters)
                compiled.add((rows, kind))
                loops = np.asarray(jax.device_get(outs[-1].exit_loops))[:rows]
                median = statistics.median(times) * 1e6
                selected = float(np.mean(loops))  # select mode: every loop ran
                rec = {**base, "variant": variant, "exit_mode": mode, "exit_rule": rule,
                       "mean_loops": float(depth) if mode == "select" else selected,
                       "selected_loops": selected, "median_us": median,
                       "min_us": min(times) * 1e6, "max_us": max(times) * 1e6,
                       "tokens_per_s": rows / (median * 1e-6)}
            except Exception as e:  # noqa: BLE001  (one failed case must not end the run)
                rec = {**base, "variant": variant, "exit_mode": mode, "exit_rule": rule,
                       "error": error_text(e), "median_us": math.nan}
            took = time.perf_counter() - start
            budget.spent(compiles, took)
            if variant == "fixed" and "error" not in rec:
                fixed_us = rec["median_us"]
            _compare(rec, fixed_us, depth)
            rec.update(compiled=compiles, case_s=took)
            records.append(rec)
            _print([rec])
            save()
        gc.collect()
    info["compilations_after"] = runner.compilations
    runner = None
    gc.collect()
    return info


def _compare(rec: dict, fixed_us: float | None, depth: int) -> None:
    """The saving against the fixed-depth step of the same rows."""
    rec["fixed_us"] = fixed_us
    rec["fixed_us_per_loop"] = None if fixed_us is None else fixed_us / depth
    ok = fixed_us is not None and "error" not in rec
    rec["saved_us"] = fixed_us - rec["median_us"] if ok else None
    skipped = depth - rec["mean_loops"] if ok else 0.0
    rec["us_saved_per_loop_skipped"] = rec["saved_us"] / skipped if ok and skipped > 0.05 else None


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{spec}}".rjust(width) if value is not None else "-".rjust(width)


def _print(records: list[dict]) -> None:
    for r in records:
        if "error" in r:
            print(f"{r['preset']:>12} rows {r['rows']:>3} {r['variant']:>16}: FAILED {r['error']}",
                  flush=True)
            continue
        print(f"{r['preset']:>12} rows {r['rows']:>3} {r['variant']:>16} {r['exit_mode']:>6}: "
              f"loops {r['mean_loops']:6.2f} {r['median_us']:>10.1f} us {r['tokens_per_s']:>9.1f} tok/s"
              f"  saved {_fmt(r['saved_us'], '.1f', 9)} us"
              f"  per loop skipped {_fmt(r['us_saved_per_loop_skipped'], '.1f', 8)} us", flush=True)


def _table(records: list[dict]) -> None:
    print("\n| preset | rows | case | mode | mean loops | step µs | tok/s | µs saved / loop skipped "
          "| fixed µs / loop |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if "error" in r:
            print(f"| {r['preset']} | {r['rows']} | {r['exit_rule']} | {r['exit_mode']} | failed "
                  "|  |  |  |  |")
            continue
        print(f"| {r['preset']} | {r['rows']} | {r['exit_rule']} | {r['exit_mode']} | {r['mean_loops']:.2f} "
              f"| {r['median_us']:,.0f} | {r['tokens_per_s']:,.0f} "
              f"| {_fmt(r['us_saved_per_loop_skipped'], ',.1f', 1)} "
              f"| {_fmt(r['fixed_us_per_loop'], ',.1f', 1)} |")


def run(args: argparse.Namespace) -> int:
    from loopjax.model import load

    device = jax.devices()[0].device_kind
    print(f"loopjax adaptive-exit benchmark on {device}", flush=True)
    records: list[dict] = []
    presets: list[dict] = []  # per preset: precompile time and compile counts
    budget = Budget(args.max_seconds)
    state = {"interrupted": False}

    def save() -> None:  # after every case: a run cut short still leaves its JSON
        write_json(args.out, {"device": device, "args": vars(args), "seconds": budget.elapsed(),
                              "skipped": budget.skipped, "interrupted": state["interrupted"],
                              "presets": presets, "records": records})

    def bench_presets() -> None:
        for preset in names(args.preset):
            # A later preset starts only if the previous one's set-up time still fits.
            if not budget.allows(f"{preset} (load)", "preset"):
                continue
            setup_start = time.perf_counter()
            try:
                model = load(preset, default_dtype(preset, args.dtype))
                presets.append(bench_preset(model, preset, args, budget, records, save, setup_start))
            except Exception as e:  # noqa: BLE001
                records.append({"preset": preset, "variant": "load", "exit_mode": "", "exit_rule": "",
                                "rows": 0, "error": error_text(e), "median_us": math.nan})
                _print(records[-1:])
            model = None
            gc.collect()

    run_interruptible(bench_presets, state)
    budget.report_done()
    save()
    _table(records)
    return 1 if any("error" in r for r in records) or not records or state["interrupted"] else 0


_PARSER, main = make_cli("python -m loopjax.bench.adaptive", __doc__, add_arguments, run, SMOKE)


if __name__ == "__main__":
    sys.exit(main())
