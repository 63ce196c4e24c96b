"""Host time of one engine decode step: `python -m loopjax.bench.host_step`.

    python -m loopjax.bench.host_step                        # ouro-tiny, 1 / 8 / 32 requests
    python -m loopjax.bench.host_step --rows 1,32 --steps 500 --out host.json
    python -m loopjax.bench.host_step --smoke                # a few steps (the tests)

For each R of --rows, R greedy requests (random prompts of --prompt-len tokens, ignore_eos)
run on an engine of --preset (the tiny preset by default: the device step is not the point,
and on CPU only ratios within one run count). Once the engine decodes all R rows and
--warmup-steps more steps have run, --steps engine steps are timed with bench/profile.py's
StageTimer plus the engine's own `_run` / `_update`. Each row count gets its own engine (one
decode bucket, a pool of R full contexts). Phases of a step, median µs over the steps:

    schedule    Scheduler.schedule: the plan of the next decode step
    rows        Engine._run less make_batch and submit: the plan's RowInputs
    make_batch  Runner.make_batch (batch.build_step_batch and the bucket choice)
    submit      Runner.submit: the jitted step's call (on a GPU its dispatch only)
    update      Scheduler.update: the sampled tokens applied to the requests
    outputs     Engine._update less update: stop strings, slots, RequestOutputs
    other       host less the phases above: engine.step's own loop, the timers
    host        step - read: the host's share of a step (the critical path of one stream
                once the device step is shorter)
    python      host - submit: on CPU the jitted call also runs part of the step (XLA:CPU
                executes on the calling thread), so this is the host work that compares
    read        Runner.read: waits for the device and copies the outputs (not host work)

With async scheduling (the default) a step plans and dispatches step n+1, then reads step n;
on CPU the device step then runs beside the host work on the same cores, and
--no-async-scheduling gives steadier host phases. --no-device runs no step at all (canned
outputs, nothing compiled): the host phases alone, the steadiest numbers for comparing host code;
there the model's context limit grows to what --warmup-steps and --steps need, so costs that grow
with the output (a few thousand tokens) show.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

from loopjax.bench.common import ints, make_cli, write_json
from loopjax.bench.profile import StageTimer
from loopjax.bench.workloads import WorkloadSpec, burst_prompts

PHASES = ("schedule", "rows", "make_batch", "submit", "update", "outputs", "other", "host", "python", "read",
          "step")
HOST_PHASES = PHASES[:PHASES.index("other")]
SMOKE = dict(rows="2", steps=5, warmup_steps=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="ouro-tiny", help="model preset (seeded random weights)")
    parser.add_argument("--rows", default="1,8,32", help="comma-separated running requests")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per row count")
    parser.add_argument("--warmup-steps", type=int, default=20, help="untimed decode steps before them")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--matmul", default="xla", help="EngineConfig.matmul ('auto' on a GPU; on CPU "
                        "its Pallas kernels run interpreted)")
    parser.add_argument("--attention-backend", default="xla", help="EngineConfig.attention_backend")
    parser.add_argument("--no-async-scheduling", action="store_true", help="one plan in flight at most")
    parser.add_argument("--no-device", action="store_true",
                        help="Runner.submit returns canned outputs: no step runs, nothing compiles (the "
                             "host phases alone, warm; submit and read are then not the real ones)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--smoke", action="store_true", help=f"small run: {SMOKE}")


def build(model, args, rows: int):
    """An Engine for `rows` requests: one decode bucket, a pool of `rows` full contexts (on CPU
    a larger pool slows the device step, which then competes with the host for the cores)."""
    from loopjax.engine import Engine, EngineConfig

    prefill_rows = min(8, rows)
    context = args.prompt_len + args.warmup_steps + args.steps + 8  # + the steps before steady
    if args.no_device and context > model.cfg.max_context_len:
        # no step runs: long outputs (host costs that grow with them) need only the positions
        model = dataclasses.replace(model, cfg=dataclasses.replace(
            model.cfg, max_position_embeddings=context))
    config = EngineConfig(max_num_rows=rows, decode_row_buckets=(rows,),
                          max_prefill_rows=prefill_rows, max_prefill_tokens=prefill_rows * args.prompt_len,
                          prefill_token_buckets=(prefill_rows * args.prompt_len,),
                          max_context_len=context, async_scheduling=not args.no_async_scheduling,
                          matmul=args.matmul, attention_backend=args.attention_backend, verbose=False,
                          warmup=not args.no_device)
    engine = Engine(model, config)
    if args.no_device:
        engine.runner.submit = _canned_outputs
    return engine


def _canned_outputs(batch, kind):
    """Runner.submit without a device: token 0 and every loop for each row (--no-device)."""
    import numpy as np

    from loopjax.steps import StepOut
    rows = batch.page_table.shape[0]
    return StepOut(np.zeros(rows, np.int32), np.full(rows, kind.num_loops, np.int32),
                   np.zeros(rows, np.float32), np.zeros((rows, 0), np.int32), np.zeros((rows, 0), np.float32),
                   np.ones(rows, np.int32))


def timed_steps(engine, timer: StageTimer, prompts, args) -> list[dict]:
    """The step records of `args.steps` decode steps over all of `prompts`, once steady."""
    from loopjax.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.warmup_steps + args.steps + 4, temperature=0.0,
                            ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    full = lambda r: r["kind"] == "decode" and r["rows"] == len(prompts)  # noqa: E731
    while not (timer.records and full(timer.records[-1])):
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    start = len(timer.records)
    for _ in range(args.steps):
        engine.step()
    records = timer.records[start:]
    bad = [r for r in records if not full(r)]
    if bad:
        raise RuntimeError(f"a timed step was not a decode of {len(prompts)} rows: "
                           f"{bad[0]['kind']}, {bad[0].get('rows', 0)} rows")
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return records


def phases(record: dict) -> dict:
    """Seconds per phase of one step record (see the module note)."""
    r = {k: record.get(k, 0.0) for k in ("schedule", "engine_run", "make_batch", "submit", "read",
                                         "update", "engine_update", "step")}
    p = {"schedule": r["schedule"], "rows": r["engine_run"] - r["make_batch"] - r["submit"],
         "make_batch": r["make_batch"], "submit": r["submit"], "update": r["update"],
         "outputs": r["engine_update"] - r["update"], "host": r["step"] - r["read"],
         "read": r["read"], "step": r["step"]}
    return {**p, "other": p["host"] - sum(p[k] for k in HOST_PHASES), "python": p["host"] - p["submit"]}


def summary(records: list[dict]) -> dict:
    """{phase: median µs} over the step records."""
    split = [phases(r) for r in records]
    return {p: 1e6 * statistics.median(s[p] for s in split) for p in PHASES}


def format_table(results: list[dict]) -> str:
    lines = ["host phases of a decode step, median µs", f"{'rows':>5}{'steps':>6}"
             + "".join(f"{p:>11}" for p in PHASES)]
    for res in results:
        lines.append(f"{res['rows']:>5}{res['steps']:>6}"
                     + "".join(f"{res['median_us'][p]:>11.1f}" for p in PHASES))
    return "\n".join(lines)


def run(args) -> int:
    import jax

    from loopjax.model import load

    model, results = load(args.preset), []
    for r in sorted(set(ints(args.rows))):
        start = time.perf_counter()
        engine = build(model, args, r)
        built = time.perf_counter() - start
        timer = StageTimer(engine)
        timer.wrap(engine, "_run", "engine_run")
        timer.wrap(engine, "_update", "engine_update")
        compiled = engine.runner.compilations
        spec = WorkloadSpec("burst", prompt_len=args.prompt_len, concurrency=r, seed=args.seed)
        records = timed_steps(engine, timer, burst_prompts(spec, model.cfg.vocab_size), args)
        results.append({"rows": r, "steps": len(records), "build_s": built,
                        "compilations_during_run": engine.runner.compilations - compiled,
                        "median_us": summary(records)})
    print(f"{'no device' if args.no_device else jax.devices()[0].device_kind}, {args.preset}, "
          f"{'async' if not args.no_async_scheduling else 'sync'} scheduling")
    print(format_table(results), flush=True)
    payload = {"preset": args.preset, "device_kind": jax.devices()[0].device_kind,
               "async_scheduling": not args.no_async_scheduling, "no_device": args.no_device,
               "prompt_len": args.prompt_len, "results": results}
    write_json(args.out, payload)
    return 0


parser, main = make_cli("python -m loopjax.bench.host_step", __doc__, add_arguments, run, SMOKE)

if __name__ == "__main__":
    sys.exit(main())
