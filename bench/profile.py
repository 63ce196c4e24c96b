"""Where an engine step's time goes: `python -m loopjax.bench.profile MODEL [-P -O -C] [engine options]`.

    python -m loopjax.bench.profile ouro-1.4b -P 512 -O 64 -C 32 --max-context-len 1024 --out prof

The engine is built as `loopjax bench` builds it (presets have seeded random weights; every
EngineConfig flag) and driven by `engine.step()` (no engine thread): one untimed warm-up
request, then the burst of `loopjax bench --workload burst` (C random prompts of P tokens,
O greedy tokens each).

Host timers (`StageTimer`) wrap, on the instances and from the outside, engine.step,
scheduler.schedule / update and runner.run / make_batch / submit. After a submission that
returns outputs the wrapper waits for them ("wait", `jax.block_until_ready`): the runner reads
them right after anyway, so this splits the wait from the copy without changing the pipeline
(a runner that overlaps steps needs `--no-split-wait`: the wait then stays in "read").
Derived: read = run - make_batch - submit - wait (device_get); other = step - schedule - run -
update (rows, outputs); host = step - wait. With the pipelined runner (`Runner.read` exists)
read is timed directly and holds the wait for the device: host = step - wait - read.
Count, mean and p50 (ms) per step kind.

Device trace: the same burst again; once every request decodes (or the rows are full),
`--trace-steps` engine steps run under `jax.profiler.trace` (perfetto JSON), each inside a
`TraceAnnotation` named `loopjax_step_<i>`; the rest of that burst is aborted. The trace is
parsed with the standard library (`device_summary`): kernels are the events on the device
streams ("Stream #N" threads of a "/device:" process; derived rows such as "XLA Ops" are
skipped); busy = union of kernel intervals; a gap = idle time between kernels; per step the
busy time inside the step's host interval and the idle time before its first and after its
last kernel. The summary goes to OUT/profile.json, the raw trace only with --keep-trace
(OUT/trace). On CPU the trace has no device streams: one line says so, the host table stays.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import itertools
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict

from loopjax.bench.report import percentile
from loopjax.bench.workloads import WorkloadSpec, burst_prompts

STEP_PREFIX = "loopjax_step_"
# Rows xprof derives from the kernels (they repeat their time): never counted as kernels.
DERIVED_ROWS = ("XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Framework Ops", "Framework Name Scope",
                "TensorFlow Ops", "TensorFlow Name Scope", "Source code", "Launch Stats")
STAGES = ("schedule", "make_batch", "submit", "wait", "read", "update", "other", "host", "step")


class StageTimer:
    """Per-step host timings of an engine (see the module note); `records` holds one dict per
    step: kind, rows, tokens and seconds per wrapped stage."""

    def __init__(self, engine, split_wait: bool = True):
        import jax

        self.records: list[dict] = []
        self._now: dict | None = None
        self.wrapped = []

        def timed(obj, name, stage, after=None):
            original = getattr(obj, name, None)
            if original is None:
                return
            self.wrapped.append(f"{type(obj).__name__}.{name}")

            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                result = original(*args, **kwargs)
                self._add(stage, time.perf_counter() - start)
                if after is not None:
                    after(result)
                return result
            setattr(obj, name, wrapper)

        def wait(out):
            if out is not None and split_wait:
                start = time.perf_counter()
                jax.block_until_ready(out)
                self._add("wait", time.perf_counter() - start)

        def planned(plan):
            # NOTE: a pipelined step may plan twice (prefill, then the decode after it): the first names it.
            if self._now is not None and plan is not None and self._now.get("kind") == "idle":
                self._now.update(kind=plan.kind.value, rows=plan.num_real_rows, bucket=plan.row_bucket,
                                 tokens=plan.num_real_tokens)

        timed(engine.scheduler, "schedule", "schedule", planned)
        timed(engine.scheduler, "update", "update")
        timed(engine.runner, "run", "run")
        timed(engine.runner, "read", "read")  # the pipelined runner: read = wait + copy
        timed(engine.runner, "make_batch", "make_batch")
        timed(engine.runner, "submit", "submit", wait)
        step = engine.step

        def timed_step():
            self._now = {"kind": "idle"}
            start = time.perf_counter()
            try:
                return step()
            finally:
                self._now["step"] = time.perf_counter() - start
                self.records.append(self._now)
                self._now = None
        engine.step = timed_step

    def _add(self, stage: str, seconds: float) -> None:
        if self._now is not None:
            self._now[stage] = self._now.get(stage, 0.0) + seconds


def derive(record: dict) -> dict:
    """A step record with the derived stages (read, other, host) filled in."""
    r = {s: record.get(s, 0.0) for s in ("schedule", "make_batch", "submit", "wait", "run", "read",
                                         "update")}
    if "read" in record:  # Runner.read wrapped (dispatch/read split): it holds the device wait
        run = r["make_batch"] + r["submit"] + r["wait"] + r["read"]
        return {**record, "other": record["step"] - r["schedule"] - run - r["update"],
                "host": record["step"] - r["wait"] - r["read"]}
    return {**record, "read": r["run"] - r["make_batch"] - r["submit"] - r["wait"],
            "other": record["step"] - r["schedule"] - r["run"] - r["update"],
            "host": record["step"] - r["wait"]}


def host_table(records: list[dict]) -> dict:
    """{kind: {"steps", "mean_rows", stage: {"mean_ms", "p50_ms"}}} over the step records
    (idle steps, which plan nothing, are left out)."""
    by_kind = defaultdict(list)
    for record in (r for r in records if r["kind"] != "idle"):
        by_kind[record["kind"]].append(derive(record))
    table = {}
    for kind, rows in sorted(by_kind.items()):
        entry = {"steps": len(rows), "mean_rows": sum(r.get("rows", 0) for r in rows) / len(rows)}
        for stage in STAGES:
            ms = [r.get(stage, 0.0) * 1e3 for r in rows]
            entry[stage] = {"mean_ms": sum(ms) / len(ms), "p50_ms": percentile(ms, 50)}
        entry["host_pct"] = 100.0 * entry["host"]["mean_ms"] / max(entry["step"]["mean_ms"], 1e-9)
        table[kind] = entry
    return table


def format_host_table(table: dict) -> str:
    head = f"{'kind':<8}{'steps':>6}{'rows':>6}" + "".join(f"{s:>12}" for s in STAGES) + f"{'host%':>7}"
    lines = ["host stages per step, ms: mean / p50 (wait = waiting for the device)", head]
    for kind, e in table.items():
        cells = "".join(f"{e[s]['mean_ms']:>6.2f}/{e[s]['p50_ms']:<5.2f}" for s in STAGES)
        lines.append(f"{kind:<8}{e['steps']:>6}{e['mean_rows']:>6.1f}{cells}{e['host_pct']:>6.1f}%")
    return "\n".join(lines)


# ------------------------------------------------------------------ the trace
def load_trace_events(trace_dir: str) -> list[dict]:
    """Events of the newest perfetto_trace.json.gz under trace_dir (jax.profiler.trace output)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1], "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals):
    """Sorted, merged [start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _clipped_busy(merged, lo: float, hi: float) -> float:
    return sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in merged)


def device_summary(events: list[dict], *, gap_us: float = 50.0, top: int = 15) -> dict | None:
    """Kernel time of a Chrome/perfetto trace (times in µs); None when it has no device events.

    Kernels: complete ("X") events on the "Stream ..." threads of "/device:..." processes
    other than CPUs (when no thread is named "Stream": every thread but the DERIVED_ROWS)."""
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = str(e.get("args", {}).get("name", ""))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = str(e.get("args", {}).get("name", ""))
    devices = {pid for pid, name in processes.items() if name.startswith("/device:") and "CPU" not in name}
    streams = {key for key, name in threads.items() if key[0] in devices and name.startswith("Stream")}
    derived = {key for key, name in threads.items() if key[0] in devices and name in DERIVED_ROWS}
    kernels, steps = [], []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if e["pid"] in devices:
            key = (e["pid"], e.get("tid"))
            if key in streams or not (streams or key in derived):
                kernels.append((start, end, str(e.get("name", "?"))))
        else:
            m = re.fullmatch(re.escape(STEP_PREFIX) + r"(\d+)", str(e.get("name", "")))
            if m:
                steps.append((int(m.group(1)), start, end))
    if not kernels:
        return None
    merged = _union((s, e) for s, e, _ in kernels)
    gaps = [b[0] - a[1] for a, b in zip(merged, merged[1:])]
    span = merged[-1][1] - merged[0][0]
    busy = sum(e - s for s, e in merged)
    ranked = _ranked(kernels, lambda name: name, top)
    groups = _ranked(kernels, kernel_group, top)
    per_step = []
    for index, lo, hi in sorted(steps):
        inside = [(max(s, lo), min(e, hi)) for s, e in merged if e > lo and s < hi]
        step_busy = _clipped_busy(merged, lo, hi)
        per_step.append({"step": index, "wall_us": hi - lo, "device_busy_us": step_busy,
                         "busy_pct": 100.0 * step_busy / max(hi - lo, 1e-9),
                         "idle_before_first_kernel_us": inside[0][0] - lo if inside else None,
                         "idle_after_last_kernel_us": hi - inside[-1][1] if inside else None})
    return {"num_kernels": len(kernels), "device_streams": sorted(threads[k] for k in streams),
            "span_us": span, "busy_us": busy, "busy_pct": 100.0 * busy / max(span, 1e-9),
            "gaps": {"count": len(gaps), "total_us": sum(gaps), "largest_us": sorted(gaps, reverse=True)[:5],
                     "threshold_us": gap_us, "over_threshold_count": sum(g > gap_us for g in gaps),
                     "over_threshold_total_us": sum(g for g in gaps if g > gap_us)},
            "top_kernels": ranked, "top_kernel_groups": groups,
            "steps": per_step}


def kernel_group(name: str) -> str:
    """A kernel name without its numeric suffixes: `loop_add_fusion_12` -> `loop_add_fusion`
    (XLA numbers each fusion; the group shows e.g. all transposes or elementwise loops)."""
    return re.sub(r"([._]\d+)+$", "", name)


def _ranked(kernels, key, top: int) -> list[dict]:
    """The `top` names (after `key`) by total time: name, count, total and mean µs."""
    totals = defaultdict(lambda: [0, 0.0])
    for start, end, name in kernels:
        totals[key(name)][0] += 1
        totals[key(name)][1] += end - start
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": n, "count": c, "total_us": t, "mean_us": t / c} for n, (c, t) in ranked]


def format_device_summary(s: dict, kinds: dict | None = None) -> str:
    g = s["gaps"]
    lines = [f"device: {s['num_kernels']} kernels on {len(s['device_streams']) or 'all'} stream(s), span "
             f"{s['span_us'] / 1e3:.2f} ms, busy {s['busy_us'] / 1e3:.2f} ms ({s['busy_pct']:.1f}%)",
             f"gaps: {g['count']}, total {g['total_us'] / 1e3:.2f} ms, largest "
             + ", ".join(f"{x:.0f}" for x in g["largest_us"]) + f" µs; {g['over_threshold_count']} over "
             f"{g['threshold_us']:.0f} µs totalling {g['over_threshold_total_us'] / 1e3:.2f} ms",
             f"{'total ms':>9}{'count':>7}{'mean µs':>10}  kernel"]
    lines += [f"{k['total_us'] / 1e3:>9.2f}{k['count']:>7}{k['mean_us']:>10.1f}  {k['name'][:90]}"
              for k in s["top_kernels"]]
    lines.append("kernel groups (numeric suffixes dropped):")
    lines += [f"{k['total_us'] / 1e3:>9.2f}{k['count']:>7}{k['mean_us']:>10.1f}  {k['name'][:90]}"
              for k in s["top_kernel_groups"][:8]]
    if s["steps"]:
        lines.append(f"{'step':>5} {'kind':<8}{'wall ms':>9}{'busy ms':>9}{'busy%':>7}"
                     f"{'idle before µs':>16}{'idle after µs':>15}")
        for st in s["steps"]:
            fmt = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
            lines.append(f"{st['step']:>5} {(kinds or {}).get(st['step'], '?'):<8}{st['wall_us'] / 1e3:>9.2f}"
                         f"{st['device_busy_us'] / 1e3:>9.2f}{st['busy_pct']:>6.1f}%"
                         f"{fmt(st['idle_before_first_kernel_us']):>16}{fmt(st['idle_after_last_kernel_us']):>15}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the run
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loopjax.async_engine import add_engine_arguments

    parser.add_argument("model", help="checkpoint folder or preset (seeded random weights)")
    parser.add_argument("--prompt-len", "-P", type=int, default=512)
    parser.add_argument("--output-len", "-O", type=int, default=64)
    parser.add_argument("--concurrency", "-C", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--max-steps", type=int, default=None, help="cut the timed burst after N steps")
    parser.add_argument("--trace-steps", type=int, default=10, help="engine steps traced (0: no trace)")
    parser.add_argument("--gap-us", type=float, default=50.0, help="gaps above this are counted apart")
    parser.add_argument("--keep-trace", action="store_true", help="keep the raw trace under OUT/trace")
    parser.add_argument("--python-trace", action="store_true", help="also trace Python calls (large)")
    parser.add_argument("--no-split-wait", action="store_true", help="do not wait after submit (see above)")
    parser.add_argument("--out", default="profile-out", help="folder of profile.json (and the trace)")
    add_engine_arguments(parser)


def _add_burst(engine, prompts, output_len: int) -> None:
    from loopjax.sampling_params import SamplingParams
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))


def _drain(engine, max_steps: int | None = None) -> None:
    """Step until idle, aborting what is left after max_steps."""
    for steps in itertools.count():
        if not engine.has_unfinished():
            return
        if steps == max_steps:
            for request_id in list(engine.scheduler.requests):
                engine.abort(request_id)
        engine.step()


def _steady(engine, timer: StageTimer) -> bool:
    """The last step decoded and nothing is left to prefill (or the rows are full)."""
    s, rows = engine.scheduler.stats(), engine.scheduler.config.max_num_rows
    return timer.records[-1]["kind"] == "decode" and (s["num_running"] >= rows or
                                                      s["num_waiting"] + s["num_prefilling"] == 0)


def trace_steps(engine, timer: StageTimer, prompts, args, trace_dir: str) -> dict:
    """Run the burst again, trace --trace-steps steps from its steady decode; {step: kind}."""
    import jax

    _add_burst(engine, prompts, args.output_len)
    before = len(timer.records)
    while engine.has_unfinished() and not (len(timer.records) > before and _steady(engine, timer)):
        engine.step()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if args.python_trace else 0
    kinds = {}
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
        for i in range(args.trace_steps):
            if not engine.has_unfinished():
                break
            with jax.profiler.TraceAnnotation(f"{STEP_PREFIX}{i}"):
                engine.step()
            kinds[i] = timer.records[-1]["kind"]
    _drain(engine, max_steps=0)
    return kinds


def run(args) -> int:
    import jax

    from loopjax.async_engine import build_engine
    timings: dict = {}
    try:
        spec = WorkloadSpec("burst", prompt_len=args.prompt_len, output_len=args.output_len,
                            concurrency=args.concurrency, seed=args.seed)
        model, engine = build_engine(args, timings)
        if spec.max_context > engine.scheduler.config.max_seq_len:
            raise ValueError(f"the burst needs {spec.max_context} tokens of context, the engine serves "
                             f"{engine.scheduler.config.max_seq_len} (see --max-context-len)")
        prompts = burst_prompts(spec, model.cfg.vocab_size)
        _add_burst(engine, [prompts[0][:8]], 2)  # warm-up request, untimed
        _drain(engine)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"loopjax profile: {e}", file=sys.stderr)
        return 1
    device = jax.devices()[0].device_kind
    print(f"{device}: load {timings['load_s']:.1f} s, warm-up {timings['warmup_s']:.1f} s", flush=True)
    timer = StageTimer(engine, split_wait=not args.no_split_wait)
    compiled = engine.runner.compilations
    start = time.perf_counter()
    interrupted = False
    try:
        _add_burst(engine, prompts, args.output_len)
        _drain(engine, args.max_steps)
    except KeyboardInterrupt:  # gpu_run.sh's time limit: report what was measured, trace nothing
        interrupted = True
    summary = {"model": args.model, "device_kind": device, "interrupted": interrupted,
               "spec": {k: getattr(spec, k) for k in ("prompt_len", "output_len", "concurrency", "seed")},
               "burst_s": time.perf_counter() - start, "wrapped": timer.wrapped,
               "compilations_during_run": engine.runner.compilations - compiled,
               "host": host_table(timer.records), "trace": None}
    print(f"burst C={spec.concurrency} P={spec.prompt_len} O={spec.output_len}: {len(timer.records)} steps "
          f"in {summary['burst_s']:.2f} s, {summary['compilations_during_run']} compilations")
    print(format_host_table(summary["host"]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    if args.trace_steps > 0 and not interrupted:
        with contextlib.ExitStack() as stack:
            trace_dir = (os.path.join(args.out, "trace") if args.keep_trace
                         else stack.enter_context(tempfile.TemporaryDirectory()))
            try:
                kinds = trace_steps(engine, timer, prompts, args, trace_dir)
                summary["trace"] = device_summary(load_trace_events(trace_dir), gap_us=args.gap_us)
            except KeyboardInterrupt:
                summary["interrupted"], kinds = True, None
        if kinds is None:
            print("device trace: interrupted by the time limit")
        elif summary["trace"] is None:
            print("device trace: no GPU stream events (a CPU run): device table skipped")
        else:
            for st in summary["trace"]["steps"]:
                st["kind"] = kinds.get(st["step"])
            print(format_device_summary(summary["trace"], kinds))
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"wrote {os.path.join(args.out, 'profile.json')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loopjax.bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
