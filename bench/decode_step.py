"""Device benchmark of one decode step: `python -m loopjax.bench.decode_step`.

    python -m loopjax.bench.decode_step --preset ouro-1.4b --rows 1,8,32,128 \\
        --context 512,2048 --out decode.json
    python -m loopjax.bench.decode_step --preset huginn-0125 --rows 1,8,32 --context 512,2048
    python -m loopjax.bench.decode_step --rows 32 --context 576 --page-width 576,1024 --backend xla,pallas
    python -m loopjax.bench.decode_step --smoke          # tiny presets on CPU

For each (preset, backend, context, rows): random bf16 weights of the preset, a KV pool whose
page tables cover `context` positions per row (rows wrap around the pool when it is smaller
than rows x context: `kv_pages_wrapped`), one decode token per row at position context - 1.
`--page-width W1,W2` times each context inside page tables W tokens wide (entries past the
row's own pages are 0, as the engine pads them): an engine compiled only at its max context
(`decode_context_buckets=()`) runs every decode step at that width whatever the rows'
contexts; the XLA path gathers the whole width, the Pallas kernel stops at each row's length.
Times (median of --iters after one warm-up call, block_until_ready each) the FUSED step (all
loops in one submission) and, for --per-loop-rows, the PER-LOOP baseline (one submission per
loop, waiting for each: a host round trip per loop). Each fused case runs the executable the
engine's dispatch picks for its rows (`steps.fused_kind`): for greedy rows (every case but
--sampled-case's) the greedy sampler's, with no sort or noise. The roofline is the bytes a
step must read, weights x loops + KV of every plane read (`kv_bytes`; `kv_table_bytes`: the whole
table width, what the XLA path gathers), at --bandwidth (4.1 TB/s, the H200's measured
copy rate); `roofline_pct` = roofline time / measured time.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import math
import statistics
import sys
import time

import jax
import numpy as np

from loopjax.bench.common import (
    decode_pool,
    decode_rows,
    default_dtype,
    ints,
    make_cli,
    patched,
    time_calls,
    write_json,
)
from loopjax.bench.trace_summary import trace_runs

SMOKE = dict(preset="ouro-tiny,huginn-tiny", rows="1,2", context="32", iters=3, per_loop_rows="2",
             kv_gb=0.01, page_size=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="ouro-1.4b", help="comma-separated presets")
    parser.add_argument("--rows", default="1,8,32,128", help="comma-separated decode rows")
    parser.add_argument("--context", default="512,2048", help="comma-separated context lengths")
    parser.add_argument("--backend", default="xla", help="comma-separated: xla, pallas, pallas_mgpu")
    parser.add_argument("--page-width", default="",
                        help="comma-separated page-table widths in tokens, each >= every context "
                             "(default: the context)")
    parser.add_argument("--matmul", default="xla", help="comma-separated: xla, streaming, auto")
    parser.add_argument("--pointwise", default="xla", help="comma-separated: xla, pallas")
    parser.add_argument("--attn-write", default="kernel",
                        help="comma-separated experiments: kernel (the engine's: the Mosaic decode "
                             "kernel writes the step's K/V), xla (XLA scatters, then attention)")
    parser.add_argument("--attn-stages", default="auto",
                        help="comma-separated Mosaic decode attention slots in flight (auto: the default)")
    parser.add_argument("--attn-splits", default="auto",
                        help="comma-separated experiments: auto (the kernel's heuristic) or a fixed "
                             "number of context splits of the Mosaic decode attention, each optionally "
                             "':M' with M the fewest blocks a split takes (e.g. auto,8:2)")
    parser.add_argument("--attn-heads", default="auto",
                        help="comma-separated experiments: auto (the kernel's rule) or a fixed "
                             "number of kv heads per program of the Mosaic decode attention")
    parser.add_argument("--streaming-rows", default="",
                        help="';'-separated experiments with matmul 'auto', each adding entries "
                             "KxN:rows to matmul_ops.STREAMING_MAX_ROWS (e.g. 'base;2048x2048:32'; "
                             "'base': the table as it is)")
    parser.add_argument("--mosaic-rows", default="",
                        help="';'-separated experiments with matmul 'auto': matmul_ops.MOSAIC_ROWS "
                             "replaced by '+'-separated OP=ROWS (OP: qkv, silu, norms or an op name; "
                             "ROWS comma-separated), e.g. 'base;none;qkv=8,32+silu=8,32' ('base': the "
                             "table as it is, 'none': empty)")
    parser.add_argument("--unroll", type=int, default=1, help="loops unrolled per fori_loop step")
    parser.add_argument("--loops", type=int, default=None, help="loops per token (default: the model's)")
    parser.add_argument("--layout", default="per_loop", choices=("per_loop", "shared"))
    parser.add_argument("--exit-threshold", type=float, default=None,
                        help="also time the adaptive step (skip mode): Ouro's Q-exit threshold, "
                             "or the Huginn criterion's threshold")
    parser.add_argument("--exit-criterion", default="kl", help="Huginn exit criterion (adaptive)")
    parser.add_argument("--per-loop-rows", default="1,32",
                        help="rows for which the per-loop baseline is timed too (first context only)")
    parser.add_argument("--sampled-case", action="store_true",
                        help="also time the fused step with every row sampling (top-p 0.9)")
    parser.add_argument("--max-logprobs", type=int, default=0,
                        help="the full sampler's top logprobs per row (EngineConfig.max_logprobs; "
                             "the greedy sampler computes none)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-gb", type=float, default=40.0, help="KV pool cap in GB")
    parser.add_argument("--bandwidth", type=float, default=4.1e12, help="bytes/s of the roofline")
    parser.add_argument("--dtype", default=None, help="default: bf16 (fp32 for tiny presets)")
    parser.add_argument("--smoke", action="store_true", help="tiny presets, small sizes (CPU)")
    parser.add_argument("--trace", default=None,
                        help="also trace 3 fused steps per case under this folder and print the "
                             "kernels (count and µs per step)")
    parser.add_argument("--out", default=None, help="write the records as JSON here")
    parser.add_argument("--plot", default=None,
                        help="write a PNG here: tokens/s and %% of roofline against rows (matplotlib)")


def weight_bytes(model, loops: int) -> int:
    """Bytes of weights one decode step reads: the looped stack x loops, the rest once
    (embedding: one row per token, negligible; the lm_head once; Huginn's adapter_input, e's
    half of the adapter, once per step: huginn.inject)."""
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
    p, cfg = model.params, model.cfg
    if cfg.family == "ouro":
        return size(p["layers"]) * loops + size(p["lm_head"]) + size(p["norm"]) + size(p["gate_w"])
    return (size(p["prelude"]) + size(p["coda"]) + (size(p["core"]) + size(p["adapter_state"])) * loops
            + size(p["adapter_input"]) + size(p["embed"]))  # the tied lm_head reads the whole embedding


def kv_read_bytes(cfg, layout, loops: int, rows: int, context: int) -> int:
    """KV bytes attention reads: every position of the row at one plane per (layer, loop run)."""
    itemsize = np.dtype(layout.dtype).itemsize
    if cfg.family == "ouro":
        plane_reads = cfg.num_layers * loops
    else:
        plane_reads = cfg.num_prelude_layers + cfg.num_coda_layers + cfg.num_core_layers * loops
    return rows * context * plane_reads * 2 * layout.num_kv_heads * layout.head_dim * itemsize


def bench_model(model, args, backend: str, records: list) -> None:
    for i, context in enumerate(ints(args.context)):
        for j, width in enumerate(ints(args.page_width) or [context]):
            _bench_context(model, args, backend, context, width, i == j == 0, records)
            gc.collect()  # free this pool before the next one is allocated


def _bench_context(model, args, backend: str, context: int, width: int, first: bool,
                   records: list) -> None:
    from loopjax.matmul_ops import matmul_ops
    from loopjax.pointwise_ops import with_pointwise
    from loopjax.runner import Runner

    cfg = model.cfg
    loops = args.loops or cfg.default_loops
    rows_list = ints(args.rows)
    per_loop_rows = set(ints(args.per_loop_rows)) if first else set()
    layout, pages_per_row, num_pages = decode_pool(model, args.layout, args.page_size, loops,
                                                   max(rows_list), context, args.kv_gb)
    table_pages = -(-width // args.page_size)  # the runner's only page-table width
    runner = Runner(model, layout, decode_rows=tuple(rows_list), prefill_buckets=(),
                    max_pages=table_pages, max_loops=loops, backend=backend,
                    num_top_logprobs=args.max_logprobs,
                    ops=with_pointwise(matmul_ops(args.current_matmul), args.current_pointwise))
    cases = {rows: _cases(runner, decode_rows(rows, pages_per_row, num_pages, context, loops), args, loops,
                          cfg.family, rows in per_loop_rows) for rows in rows_list}
    # Every shape compiles ahead, XLA compiles in parallel threads (the slow part on the GPU).
    runner.precompile([step for by_name in cases.values() for steps in by_name.values()
                       for step in steps])
    for rows in rows_list:
        base = dict(preset=args.current_preset, backend=backend, matmul=args.current_matmul,
                    pointwise=args.current_pointwise,
                    streaming_extra=args.current_streaming_extra,
                    mosaic=args.current_mosaic,
                    attn_write=args.current_attn[0], attn_splits=args.current_attn[1],
                    attn_stages=args.current_attn[2], attn_heads=args.current_attn[3],
                    layout=args.layout, rows=rows, max_logprobs=args.max_logprobs,
                    context=context, page_width=table_pages * args.page_size, loops=loops,
                    kv_pages_wrapped=rows * pages_per_row > num_pages,
                    pool_pages=num_pages, page_size=args.page_size,
                    weight_bytes=weight_bytes(model, loops),
                    kv_bytes=kv_read_bytes(cfg, layout, loops, rows, context),
                    kv_table_bytes=kv_read_bytes(cfg, layout, loops, rows, table_pages * args.page_size))
        base["roofline_us"] = (base["weight_bytes"] + base["kv_bytes"]) / args.bandwidth * 1e6
        for name, steps in cases[rows].items():
            outs = []
            # fused / adaptive: one asynchronous submission; per_loop: wait after every loop
            # (the host round trip per loop of an unfused engine).
            run = lambda steps=steps, outs=outs: [outs.append(runner.submit(b, k)) or  # noqa: E731
                                                  jax.block_until_ready(outs[-1]) for b, k in steps]
            record = _record(base, name, time_calls(run, args.iters), len(steps))
            record["sampler"] = "greedy" if steps[-1][1].greedy else "full"  # of the final step
            if name.startswith("fused"):  # back to back, as the engine's async scheduling submits
                record["pipelined_us"] = _pipelined_seconds(runner, steps, args.iters) * 1e6
                record["pipelined_roofline_pct"] = 100.0 * base["roofline_us"] / record["pipelined_us"]
            if args.trace and name == "fused":
                record["trace"] = trace_runs(run, f"{args.trace}/{_case_tag(record)}", TRACED_STEPS)
            if name == "adaptive":  # random weights exit arbitrarily: report the loops
                record["mean_loops"] = float(np.mean(np.asarray(outs[-1].exit_loops)[:rows]))
            records.append(record)
        _print(records[-len(cases[rows]):])


def _cases(runner, row_inputs, args, loops: int, family: str, per_loop_too: bool) -> dict:
    """name -> the (batch, kind) submissions of one token."""
    import dataclasses

    from loopjax.exits import ExitSpec
    from loopjax.sampling_params import SamplingParams
    from loopjax.steps import fused_kind, per_loop
    batch = lambda rows, **kw: runner.make_batch(rows, decode=True, **kw)  # noqa: E731
    # each case runs the kind the engine's dispatch picks for its rows (greedy or not)
    kind = lambda rows, adaptive=False: fused_kind(  # noqa: E731
        loops, decode=True, all_greedy=all(r.params.is_plain_greedy for r in rows), adaptive=adaptive,
        unroll=args.unroll if not adaptive else 1)
    cases = {"fused": [(batch(row_inputs, loop_begin=0, loop_end=loops), kind(row_inputs))]}
    if args.sampled_case:  # every row drawing (top-p), not greedy: the full sampler's executable
        drawing = [dataclasses.replace(r, params=SamplingParams(temperature=1.0, top_p=0.9, seed=i))
                   for i, r in enumerate(row_inputs)]
        cases["fused_top_p"] = [(batch(drawing, loop_begin=0, loop_end=loops), kind(drawing))]
    if args.exit_threshold is not None:  # the adaptive (skip) step: ends when every row exited
        spec = ExitSpec(args.exit_criterion, args.exit_threshold) if family == "huginn" else None
        rows = [dataclasses.replace(r, exit_skip=True, exit_threshold=args.exit_threshold,
                                    exit_spec=spec) for r in row_inputs]
        cases["adaptive"] = [(batch(rows, loop_begin=0, loop_end=loops, adaptive=True),
                              kind(rows, adaptive=True))]
    if per_loop_too:
        cases["per_loop"] = [(batch(row_inputs, loop_begin=t, loop_end=t + 1),
                              per_loop(first=t == 0, final=t == loops - 1)) for t in range(loops)]
    return cases


TRACED_STEPS = 3


def _pipelined_seconds(runner, steps, iters: int) -> float:
    """Seconds per token with `iters` tokens submitted back to back and one wait at the end:
    the device time of a step once the host's dispatch overlaps the step before (what the
    engine's async scheduling does), where the synchronous median also counts the dispatch."""
    jax.block_until_ready([runner.submit(b, k) for b, k in steps])
    start = time.perf_counter()
    outs = [runner.submit(b, k) for _ in range(iters) for b, k in steps]
    jax.block_until_ready(outs[-1])
    return (time.perf_counter() - start) / iters


def _case_tag(r: dict) -> str:
    return f"{r['preset']}_{r['backend']}_{r['matmul']}_{r['pointwise']}_r{r['rows']}_c{r['context']}"


def _record(base: dict, variant: str, times: list[float], submissions: int) -> dict:
    median = statistics.median(times) * 1e6
    return {**base, "variant": variant, "submissions_per_token": submissions,
            "median_us": median, "min_us": min(times) * 1e6, "max_us": max(times) * 1e6,
            "tokens_per_s": base["rows"] / (median * 1e-6),
            "roofline_pct": 100.0 * base["roofline_us"] / median}


def _streaming_experiments(spec: str) -> list[dict]:
    """'base;2048x2048:32,5632x2048:32' -> [{}, {(2048, 2048): 32, (5632, 2048): 32}]."""
    experiments = []
    for part in (spec or "base").split(";"):
        entries = {}
        for item in filter(None, part.strip().removeprefix("base").split(",")):
            shape, rows = item.split(":")
            k, n = shape.split("x")
            entries[(int(k), int(n))] = int(rows)
        experiments.append(entries)
    return experiments


def _attention_experiment(write: str, splits: str, stages: str, heads: str = "auto"):
    """An experiment of this benchmark only: 'xla' writes the step's K/V with XLA scatters
    before the attention kernel (the path before run 12); a number fixes the Mosaic decode
    kernel's context splits (capped by its blocks), slots or kv heads per program."""
    from loopjax import attention_backend
    from loopjax.kernels import paged_attention_mgpu_config as mgpu
    splits, _, min_blocks = splits.partition(":")
    numbers = (splits, stages, heads)
    if write not in ("kernel", "xla") or not all(v == "auto" or v.isdigit() for v in numbers) \
            or not (min_blocks == "" or min_blocks.isdigit()):
        raise ValueError(f"--attn-write {write!r} / --attn-splits {splits!r} / --attn-stages "
                         f"{stages!r} / --attn-heads {heads!r}")
    rules = {}
    if stages != "auto":
        rules["default_num_stages"] = lambda slot_bytes: int(stages)
    if splits != "auto":
        rules["mosaic_num_splits"] = lambda n, hkv, max_blocks: max(1, min(int(splits), max_blocks))
    if min_blocks:
        rules["default_min_blocks_per_split"] = lambda n, hkv, max_blocks: int(min_blocks)
    if heads != "auto":
        rules["default_heads_per_program"] = lambda n, hkv, num_splits: int(heads)
    backend = {"write_attention_fn": lambda attend, layout: None} if write == "xla" else {}
    stack = contextlib.ExitStack()
    stack.enter_context(patched(mgpu, **rules))
    stack.enter_context(patched(attention_backend, **backend))
    return stack


MOSAIC_SHORT_NAMES = ("qkv", "silu", "norms")  # of matmul_ops.MOSAIC_OPS, in its order


def _mosaic_ops() -> dict:
    from loopjax import matmul_ops
    return dict(zip(MOSAIC_SHORT_NAMES, matmul_ops.MOSAIC_OPS, strict=True))


def _mosaic_experiments(spec: str) -> list[dict | None]:
    """'base;none;qkv=8,32+silu=8' -> [None (the table as it is), {}, {qkv op: {8, 32}, silu op: {8}}]."""
    experiments = []
    for part in (spec or "base").split(";"):
        part = part.strip()
        table = {} if part != "base" else None
        for item in filter(None, part.removeprefix("base").removeprefix("none").split("+")):
            op, rows = item.split("=")
            table[_mosaic_ops().get(op, op)] = frozenset(ints(rows))
        experiments.append(table)
    return experiments


def _mosaic_name(table: dict | None) -> str:
    if table is None:
        return "-"
    short = {v: k for k, v in _mosaic_ops().items()}
    return "+".join(f"{short.get(op, op)}={','.join(map(str, sorted(rows)))}"
                    for op, rows in table.items()) or "none"


def _matmul_tables(streaming_extra: dict, mosaic_rows: dict | None):
    """An experiment of this benchmark only: matmul 'auto' also streams the weight shapes of
    streaming_extra up to its rows, and runs products on Mosaic kernels at mosaic_rows (None:
    as it is); matmul_ops' tables are restored after."""
    from loopjax import matmul_ops
    tables = {"STREAMING_MAX_ROWS": {**matmul_ops.STREAMING_MAX_ROWS, **streaming_extra}}
    if mosaic_rows is not None:
        tables["MOSAIC_ROWS"] = mosaic_rows
    return patched(matmul_ops, **tables)


def _print(records: list[dict]) -> None:
    for r in records:
        print(f"{r['preset']:>12} {r['backend']:>11} {r['matmul']:>9} {r['pointwise']:>6} "
              f"{r['variant']:>8} rows {r['rows']:>4} "
              + (f"+streaming {r['streaming_extra']} " if r["streaming_extra"] != "-" else "")
              + (f"mosaic {r['mosaic']} " if r.get("mosaic", "-") != "-" else "")
              + ("" if r["attn_write"] == "kernel" else "xla-write ")
              + ("" if r["attn_splits"] == "auto" else f"splits {r['attn_splits']} ")
              + ("" if r["attn_stages"] == "auto" else f"stages {r['attn_stages']} ")
              + ("" if r.get("attn_heads", "auto") == "auto" else f"heads {r['attn_heads']} ")
              + (f"top-{r['max_logprobs']} " if r.get("max_logprobs") else "")
              + f"ctx {r['context']:>5} width {r['page_width']:>5} loops {r['loops']:>2}: "
              f"{r['median_us']:>10.1f} us "
              f"{r['tokens_per_s']:>9.1f} tok/s  roofline {r['roofline_pct']:5.1f}%"
              + (f"  pipelined {r['pipelined_us']:8.1f} us {r['pipelined_roofline_pct']:5.1f}%"
                 if "pipelined_us" in r else "")
              + (f"  mean loops {r['mean_loops']:.2f}" if "mean_loops" in r else "")
              + ("  (kv pages wrapped)" if r["kv_pages_wrapped"] else ""), flush=True)


def run(args: argparse.Namespace) -> int:
    from loopjax.model import load

    if ints(args.page_width) and min(ints(args.page_width)) < max(ints(args.context)):
        print(f"decode_step: --page-width {min(ints(args.page_width))} is below the context "
              f"{max(ints(args.context))}; the page table must hold every context", file=sys.stderr)
        return 2
    print(f"loopjax decode-step benchmark on {jax.devices()[0].device_kind}", flush=True)
    records: list[dict] = []
    start = time.perf_counter()
    for preset in args.preset.split(","):
        model = load(preset, default_dtype(preset, args.dtype))
        args.current_preset = preset
        for backend in args.backend.split(","):
            for matmul in args.matmul.split(","):
                for pointwise in args.pointwise.split(","):
                    for extra, mosaic, *attn in itertools.product(
                            _streaming_experiments(args.streaming_rows),
                            _mosaic_experiments(args.mosaic_rows), args.attn_write.split(","),
                            args.attn_splits.split(","), args.attn_stages.split(","),
                            args.attn_heads.split(",")):
                        args.current_matmul, args.current_pointwise = matmul, pointwise
                        args.current_streaming_extra = ",".join(
                            f"{k}x{n}:{r}" for (k, n), r in extra.items()) or "-"
                        args.current_mosaic = _mosaic_name(mosaic)
                        args.current_attn = tuple(attn)
                        with _matmul_tables(extra, mosaic), _attention_experiment(*attn):
                            bench_model(model, args, backend, records)
        del model
        gc.collect()
    print(f"done in {time.perf_counter() - start:.1f} s", flush=True)
    write_json(args.out, {"device": jax.devices()[0].device_kind, "records": records})
    if args.plot:
        from loopjax.bench.report import write_steps_plot
        print(f"plot: {write_steps_plot(records, args.plot) or 'skipped (no matplotlib)'}", flush=True)
    bad = [r for r in records if not math.isfinite(r["median_us"])]
    return 1 if bad else 0


_PARSER, main = make_cli("python -m loopjax.bench.decode_step", __doc__, add_arguments, run, SMOKE)


if __name__ == "__main__":
    sys.exit(main())
