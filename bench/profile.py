"""Where an engine step's time goes: `python -m loopjax.bench.profile MODEL [-P -O -C] [engine options]`.

    python -m loopjax.bench.profile ouro-1.4b -P 512 -O 64 -C 32 --max-context-len 1024 --out prof

The engine is built as `loopjax bench` builds it (presets have seeded random weights; every
EngineConfig flag) and driven by `engine.step()` (no engine thread): one untimed warm-up
request, then the burst of `loopjax bench --workload burst` (C random prompts of P tokens,
O greedy tokens each).

Host timers (`StageTimer`) wrap, on the instances and from the outside, engine.step,
scheduler.schedule / update and runner.run / read / make_batch / submit. `Runner.read` (the
one host read of a step's outputs) holds the wait for the device: with async scheduling (the
default) it reads step n while step n+1 runs. A step is named (kind, rows) by the plan it
reads and applies (step n): its wait, read and update are that plan's, while its schedule,
make_batch and submit are of the plan it sends (n + 1, pipelined); a step that applies none is
idle. Derived: other = step - schedule - make_batch -
submit - read - update (rows, outputs); host = step - read. `--split-wait` (synchronous engines
only: it would stall the pipeline) waits after each submit ("wait", `jax.block_until_ready`)
to split the device time from the copy.
Count, mean and p50 (ms) per step kind.

Device trace: the same burst again; once every request decodes (or the rows are full), or
from its first step with `--trace-from start`, `--trace-steps` engine steps run under
`jax.profiler.trace` (perfetto JSON), each inside a `TraceAnnotation` named
`loopjax_step_<i>`; the rest of that burst is aborted. The trace is
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
import itertools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict

from loopjax.bench.report import percentile
from loopjax.bench.trace_summary import (  # noqa: F401  (the trace half of this tool)
    DERIVED_ROWS,
    STEP_PREFIX,
    device_summary,
    format_device_summary,
    kernel_group,
    load_trace_events,
)
from loopjax.bench.workloads import WorkloadSpec, burst_prompts

STAGES = ("schedule", "make_batch", "submit", "wait", "read", "update", "other", "host", "step")


class StageTimer:
    """Per-step host timings of an engine (see the module note); `records` holds one dict per
    step: kind, rows, tokens and seconds per wrapped stage."""

    def __init__(self, engine, split_wait: bool = False):
        import jax

        self.records: list[dict] = []
        self._now: dict | None = None
        self.wrapped = []

        def wait(out):
            if out is not None and split_wait:
                start = time.perf_counter()
                jax.block_until_ready(out)
                self._add("wait", time.perf_counter() - start)

        def applied(plan, *_):
            # NOTE: the plan a step reads and applies names it (its wait, read and update are that
            # plan's); pipelined, the plan it sends is the next one, whose device time the next
            # step's wait holds (the plan sent named it: a decode's wait went to the prefill sent
            # beside it, and the last step of a burst, which sends none, counted as idle).
            if self._now is not None:
                self._now.update(kind=plan.kind.value, rows=plan.num_real_rows, bucket=plan.row_bucket,
                                 tokens=plan.num_real_tokens)

        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "update", "update", before=applied)
        self.wrap(engine.runner, "run", "run")
        self.wrap(engine.runner, "read", "read")  # the pipelined runner: read = wait + copy
        self.wrap(engine.runner, "make_batch", "make_batch")
        self.wrap(engine.runner, "submit", "submit", wait)
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

    def wrap(self, obj, name: str, stage: str, after=None, before=None) -> None:
        """Add the seconds of each `obj.name(...)` call (an instance attribute now shadows the
        method) to `stage` of the current step; `before(*args, **kwargs)` and `after(result)`
        run outside the timing."""
        original = getattr(obj, name, None)
        if original is None:
            return
        self.wrapped.append(f"{type(obj).__name__}.{name}")

        def wrapper(*args, **kwargs):
            if before is not None:
                before(*args, **kwargs)
            start = time.perf_counter()
            result = original(*args, **kwargs)
            self._add(stage, time.perf_counter() - start)
            if after is not None:
                after(result)
            return result
        setattr(obj, name, wrapper)

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
    (idle steps, which apply no plan, are left out)."""
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


# ------------------------------------------------------------------ the run
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from loopjax.engine_args import add_engine_arguments

    parser.add_argument("model", help="checkpoint folder or preset (seeded random weights)")
    parser.add_argument("--prompt-len", "-P", type=int, default=512)
    parser.add_argument("--output-len", "-O", type=int, default=64)
    parser.add_argument("--concurrency", "-C", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--max-steps", type=int, default=None, help="cut the timed burst after N steps")
    parser.add_argument("--trace-steps", type=int, default=10, help="engine steps traced (0: no trace)")
    parser.add_argument("--trace-from", default="steady", choices=("steady", "start"),
                        help="trace from the burst's steady decode (default) or from its first step "
                             "(its prefill steps)")
    parser.add_argument("--gap-us", type=float, default=50.0, help="gaps above this are counted apart")
    parser.add_argument("--keep-trace", action="store_true", help="keep the raw trace under OUT/trace")
    parser.add_argument("--python-trace", action="store_true", help="also trace Python calls (large)")
    parser.add_argument("--split-wait", action="store_true",
                        help="wait after each submit (synchronous engines only; see above)")
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
    """Run the burst again, trace --trace-steps steps from its steady decode (or its first
    step: --trace-from start); {step: kind}."""
    import jax

    _add_burst(engine, prompts, args.output_len)
    before = len(timer.records)
    while (args.trace_from == "steady" and engine.has_unfinished()
           and not (len(timer.records) > before and _steady(engine, timer))):
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

    from loopjax.engine_args import build_engine
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
    timer = StageTimer(engine, split_wait=args.split_wait)
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
