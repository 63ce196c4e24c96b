"""`loopjax bench MODEL --workload burst|sessions [sizes] [--url URL] [--out JSON] [--plot PNG]`.

Without `--url` the workload runs in-process: the Engine (built from MODEL and the engine
options, as `loopjax serve` builds it) behind an AsyncEngine, timed at the point where
outputs reach the event loop. With `--url` the same workload (same prompts) streams from a
running `loopjax serve` over HTTP, timed at the client; MODEL is then the served model name.
Prints one summary line per run, writes the JSON report and the PNG plot (bench/report.py).
In-process reports carry the start-up: model load, warm-up (Engine construction: pool and
every bucket compiled), the compile count after it and each executable's lowering and compile
seconds, slowest first (the three slowest are printed); every report counts the compilations
during the timed run (0 on a warm engine) and the prefix cache's hits and evictions in it.

`--compare-prefix-cache` (sessions, in-process): the same workload (same seed, so the same
user messages) twice on one engine, prefix cache off, then on. Between the arms the idle
engine's scheduler (host state only: queue, page allocator, prefix cache) is rebuilt with the
flag flipped; the KV pool and the compiled steps stay, so both arms run the same programs
after one warm-up and each starts with an empty cache. Prints a table of both runs and their
on/off ratio and writes {"compare", "off", "on", "ratio", "matching_outputs"}.

`--max-seconds S` is a wall-clock budget from the start of the command, load and warm-up
included. Each run (a sweep level, a compare arm) gets at most an even share of what is left
when it starts (runs that finish early leave their time to the later ones); a run that
overruns is cut (its open requests aborted), its report keeps the finished requests and says
`truncated: true`, and its tokens/s also counts the tokens the cut requests had received
(`cut_output_tokens`), over the same wall time; a run with no time left is skipped. The JSON is
written either way.

Only the standard library, loopjax's engine modules and (optional) tqdm and matplotlib are
needed in-process; httpx only with `--url`. FastAPI is never imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

from loopjax.bench import report as rep
from loopjax.bench.workloads import HttpBackend, InProcessBackend, Record, WorkloadSpec, run_workload


def add_arguments(parser):
    from loopjax.cli import int_at_least
    from loopjax.engine_args import add_engine_arguments, add_sampling_arguments

    d, positive = WorkloadSpec("burst"), int_at_least(1)  # sizes: refused at parsing, naming the flag
    parser.add_argument("model", help="checkpoint folder, HF folder, cached Hub name or preset (in-process), "
                                      "or the served name (--url)")
    parser.add_argument("--workload", choices=("burst", "sessions"), default="burst",
                        help="burst: C requests at once; sessions: multi-turn chats (default: burst)")
    parser.add_argument("--prompt-len", "-P", type=positive, default=d.prompt_len,
                        help="burst prompt tokens / sessions' opening tokens (default: %(default)s)")
    parser.add_argument("--output-len", "-O", type=positive, default=d.output_len,
                        help="tokens per request/turn (default: %(default)s)")
    parser.add_argument("--concurrency", "-C", type=positive, nargs="+", default=[d.concurrency],
                        help="burst requests sent at once; several values run a sweep (default: %(default)s)")
    parser.add_argument("--sessions", "-N", type=positive, default=d.num_sessions,
                        help="sessions (default: %(default)s)")
    parser.add_argument("--turns", "-T", type=positive, default=d.num_turns,
                        help="turns per session (default: %(default)s)")
    parser.add_argument("--user-len", "-U", type=positive, default=d.user_len,
                        help="tokens per later user turn (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    add_sampling_arguments(parser)
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="drawing requests: a request's seed is SAMPLING_SEED + crc32(its prompt "
                             "ids), so runs repeat (default: a random seed per request)")
    parser.add_argument("--url", default=None, help="http://host:port of a running `loopjax serve`")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or None,
                        help="with --url: the server's API key (default: $OPENAI_API_KEY)")
    parser.add_argument("--vocab-size", type=positive, default=None,
                        help="with --url: token ids to draw from (default: the server's /v1/models)")
    parser.add_argument("--no-warmup-request", action="store_true", help="skip the untimed warm-up request")
    parser.add_argument("--out", default=None, help="JSON report path (default: bench-<workload>.json)")
    parser.add_argument("--plot", default=None, help="PNG plot path (default: the JSON path with .png)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--compare-prefix-cache", action="store_true",
                        help="sessions, in-process: run the workload with the prefix cache off, then on "
                             "(same prompts, one engine) and report both and their ratio")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="wall-clock budget of the whole command (load and warm-up included): runs "
                             "that overrun are cut (reported as truncated), runs with no time left skipped")
    add_engine_arguments(parser)


def _sampling(args) -> dict:
    """The request fields of the sampling flags, refused here (one line) when out of range."""
    from loopjax.engine_args import sampling_options
    from loopjax.sampling_params import SamplingParams

    options = sampling_options(args)
    SamplingParams(**options, seed=args.sampling_seed)
    return options


def _backend_args(args) -> dict:
    return {"sampling": _sampling(args), "sampling_seed": args.sampling_seed}


def _specs(args) -> list[WorkloadSpec]:
    """One spec per burst concurrency level (a sweep when several are given)."""
    levels = args.concurrency if args.workload == "burst" else args.concurrency[:1]
    return [WorkloadSpec(args.workload, prompt_len=args.prompt_len, output_len=args.output_len,
                         concurrency=c, num_sessions=args.sessions, num_turns=args.turns,
                         user_len=args.user_len, seed=args.seed) for c in levels]


def _plan(args) -> list[tuple[bool | None, list[tuple[str, WorkloadSpec]]]]:
    """Groups of (label, spec) runs; a group's flag sets the prefix cache for its runs
    (None: as the engine was built). One group, or the two arms of --compare-prefix-cache."""
    if args.max_seconds is not None and args.max_seconds <= 0:
        raise ValueError(f"--max-seconds must be > 0, got {args.max_seconds}")
    _sampling(args)  # bad sampling flags are refused before the engine is built
    for flag, path in (("--out", args.out), ("--plot", args.plot)):  # not after the whole run
        _check_output_path(flag, path)
    specs = _specs(args)
    if args.compare_prefix_cache:
        if args.url:
            raise ValueError("--compare-prefix-cache switches the engine's prefix cache, so it runs "
                             "in-process only; drop --url")
        if args.workload != "sessions":
            raise ValueError(f"--compare-prefix-cache runs the sessions workload; got --workload "
                             f"{args.workload}")
        return [(on, [(f"sessions, prefix cache {'on' if on else 'off'}", specs[0])]) for on in (False, True)]
    return [(None, [(s.name if s.name == "sessions" else f"burst C={s.concurrency}", s) for s in specs])]


def _check_output_path(flag: str, path: str | None) -> None:
    """A report file `path` (None: the default, in the working folder) that can be written:
    not a folder, under folders that exist or can be made."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder; give a file path")
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(folder):
        if os.path.lexists(folder):
            raise ValueError(f"{flag} {path}: {folder} is not a folder")
        folder = os.path.dirname(folder)


@dataclass
class Run:
    """One timed run of a workload and the engine stats around it."""

    label: str
    spec: WorkloadSpec
    records: list[Record]
    duration_s: float
    stats_before: dict
    stats_after: dict
    truncated: bool = False  # cut by --max-seconds: `records` holds the finished requests
    cut_tokens: int = 0  # tokens the requests cut by --max-seconds had received
    prefix_caching: bool | None = None  # the engine's prefix cache (None: unknown)
    startup: dict = field(default_factory=dict)  # load_s, warmup_s, compilations_after_warmup, compile_times


class _NoBar:
    def update(self, n=1):
        pass


@contextlib.contextmanager
def _progress(total: int, label: str, enabled: bool):
    """A tqdm bar, or nothing (--no-progress, or tqdm not installed)."""
    try:
        from tqdm import tqdm
    except ImportError:
        enabled = False
    if not enabled:
        yield _NoBar()
        return
    with tqdm(total=total, desc=label, unit="req") as bar:
        yield bar


async def _settled(stats, min_generated: int, timeout_s: float = 5.0) -> dict:
    """stats() once it counts at least `min_generated` generated tokens: the engine posts its
    snapshot after a step's outputs, so one read right after the last output can be a step old."""
    deadline = time.perf_counter() + timeout_s
    while True:
        snapshot = await stats()
        got = snapshot.get("generated_tokens")
        if got is None or got >= min_generated or time.perf_counter() > deadline:
            return snapshot
        await asyncio.sleep(0.01)


async def run_specs(items, backend, vocab_size: int, stats, *, deadline: float | None = None,
                    runs_after: int = 0, warmup_request: bool = True, progress: bool = True) -> list[Run]:
    """Run the (label, spec) items in order against `backend`; `stats()` (async) returns the
    engine stats. One untimed warm-up request first (first-call costs such as compilation or
    connection setup stay out of the numbers). `deadline` (perf_counter) splits the time left
    evenly over this run and the ones still to come (`runs_after` of them after `items`):
    an overrun is cut (truncated), a run with no time left skipped (a line on stderr)."""
    generated = (await stats()).get("generated_tokens") or 0
    if warmup_request:
        low, spec = items[0][1].token_low, items[0][1]
        record = await backend.generate(list(range(low, low + min(spec.prompt_len, 8))), 2)
        generated += len(record.token_ids)
    runs = []
    for i, (label, spec) in enumerate(items):
        timeout = None
        if deadline is not None:
            left = deadline - time.perf_counter()
            if left <= 0:
                print(f"loopjax bench: {label} skipped: the --max-seconds budget is spent", file=sys.stderr)
                continue
            timeout = left / (len(items) - i + runs_after)
        before = await _settled(stats, generated)
        finished: list[Record] = []
        cut_from = len(getattr(backend, "cut", ()))
        with _progress(spec.num_requests, label, progress) as bar:
            def on_done(record, bar=bar, finished=finished):
                finished.append(record)
                bar.update(1)

            start = time.perf_counter()
            task = asyncio.ensure_future(run_workload(spec, backend, vocab_size, on_done=on_done))
            await asyncio.wait({task}, timeout=timeout)
            truncated = not task.done()
            if truncated:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            duration = time.perf_counter() - start
        records = list(finished) if truncated else task.result()
        cut_tokens = sum(len(r.token_ids) for r in getattr(backend, "cut", [])[cut_from:])
        if truncated:
            print(f"loopjax bench: {label} cut after {duration:.1f} s by --max-seconds "
                  f"({len(records)} of {spec.num_requests} requests finished)", file=sys.stderr)
        generated += sum(len(r.token_ids) for r in records) + cut_tokens
        after = await _settled(stats, generated)
        runs.append(Run(label, spec, records, duration, before, after, truncated, cut_tokens))
    return runs


def _snapshot(aengine):
    async def stats():
        return aengine.stats()
    return stats


def set_prefix_caching(engine, enabled: bool) -> None:
    """Rebuild the idle engine's scheduler with the prefix cache on or off (see the module
    note); requests a cut run left behind are aborted first. Call it with no engine thread."""
    from loopjax.scheduler import Scheduler

    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    engine.step()  # hands back the aborted requests' outputs; nothing is left to run
    if engine.has_unfinished():
        raise RuntimeError("the engine is not idle; cannot switch its prefix cache")
    engine.scheduler = Scheduler(dataclasses.replace(engine.scheduler.config, enable_prefix_caching=enabled))


async def _run_in_process(args, plan, deadline):
    from loopjax.async_engine import AsyncEngine
    from loopjax.engine_args import build_engine

    timings = {}
    model, engine = build_engine(args, timings)
    times = sorted(engine.runner.compile_times, key=lambda t: -t.seconds)
    startup = dict(timings, compilations_after_warmup=engine.stats().get("compilations"),
                   compile_times=[dataclasses.asdict(t) | {"label": t.label, "seconds": t.seconds}
                                  for t in times])
    print(f"engine ready: load {startup['load_s']:.1f} s, warm-up {startup['warmup_s']:.1f} s, "
          f"{startup['compilations_after_warmup']} compilations", flush=True)
    print(rep.format_compile_times(startup["compile_times"]), flush=True)
    sched = getattr(getattr(engine, "scheduler", None), "config", None)  # may allow less than the model
    context = getattr(sched, "max_seq_len", None) or model.cfg.max_context_len
    specs = [spec for _, items in plan for _, spec in items]
    need = max(s.max_context for s in specs)
    if need > context:
        raise ValueError(f"the workload needs {need} tokens of context, the engine serves {context} "
                         f"(see --max-context-len)")
    runs, left = [], len(specs)
    for prefix_caching, items in plan:
        if prefix_caching is not None:
            set_prefix_caching(engine, prefix_caching)
        aengine = AsyncEngine(engine, max_waiting=max(s.num_requests for s in specs) + 1)
        await aengine.start()
        left -= len(items)
        try:
            backend = InProcessBackend(aengine, **_backend_args(args))
            group = await run_specs(items, backend, model.cfg.vocab_size, _snapshot(aengine),
                                    deadline=deadline, runs_after=left,
                                    warmup_request=not args.no_warmup_request, progress=not args.no_progress)
        finally:
            aengine.shutdown()
        for run in group:
            run.prefix_caching, run.startup = aengine.prefix_caching, startup
        runs += group
    return runs


async def _run_http(args, plan, deadline):
    try:
        import httpx
    except ImportError:  # the bench extra's
        raise RuntimeError("--url needs httpx; install it with: pip install 'loopjax[bench]'") from None

    (_, items), = plan
    most = max(spec.num_requests for _, spec in items)
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=64)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        return await _run_http_client(args, items, deadline, httpx.AsyncClient(
            base_url=args.url, timeout=httpx.Timeout(600.0), limits=limits, headers=headers))
    except (httpx.HTTPError, httpx.InvalidURL) as e:  # e.g. no server up yet: not a traceback
        raise RuntimeError(f"cannot reach the server at {args.url}: {e or type(e).__name__}") from None


async def _run_http_client(args, items, deadline, client):
    from loopjax.metrics import engine_stats_from_samples, parse

    async with client:
        vocab_size = args.vocab_size
        if vocab_size is None:
            response = await client.get("/v1/models")
            if response.status_code == 401:
                raise RuntimeError(f"the server at {args.url} asks for an API key (401): pass --api-key "
                                   f"or set OPENAI_API_KEY")
            reply = response.json()
            cards = reply.get("data") if isinstance(reply, dict) else None
            cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
            vocab_size = next((c.get("vocab_size") for c in cards if c.get("id") == args.model), None)
            if vocab_size is None:  # e.g. another server's /v1/models: no list, or no vocab_size
                raise ValueError(f"the server at {args.url} does not list {args.model!r} with its vocabulary "
                                 f"size (served: {[c.get('id') for c in cards]}); pass --vocab-size")

        async def stats():  # the server's gauges and counters, as /metrics has them, by stats() key
            return engine_stats_from_samples(parse((await client.get("/metrics")).text))

        backend = HttpBackend(client, args.model, **_backend_args(args))
        runs = await run_specs(items, backend, vocab_size, stats, deadline=deadline,
                               warmup_request=not args.no_warmup_request, progress=not args.no_progress)
    for run in runs:
        enabled = run.stats_after.get("prefix_cache_enabled")
        run.prefix_caching = None if enabled is None else bool(enabled)
    return runs


def _report(run: Run, args) -> dict:
    stats = run.stats_after
    loops = None if any(r.exit_loops for r in run.records) else stats.get("mean_loops_per_token")
    return rep.summarize(run.records, run.duration_s, workload=run.spec.name, model=args.model,
                     target=args.url or "in-process", engine_stats=stats, mean_loops_per_token=loops,
                     spec=dataclasses.asdict(run.spec) | {"num_requests": run.spec.num_requests,
                                                          "sampling": _sampling(args),
                                                          "sampling_seed": args.sampling_seed},
                     stats_before=run.stats_before, prefix_caching=run.prefix_caching, startup=run.startup,
                     truncated=run.truncated, cut_tokens=run.cut_tokens)


def _outputs(run: Run | None) -> dict:
    return {} if run is None else {(r.session, r.turn): r.token_ids for r in run.records}


def run(args) -> int:
    """Plan, run and report. A bad option, an engine that cannot be built, a server that cannot
    be reached or a budget spent before the first run is one line on stderr and exit code 2
    (as `loopjax generate` and `serve`); Ctrl-C: 130."""
    from loopjax.engine_args import failure_line

    started = time.perf_counter()
    try:
        plan = _plan(args)
        deadline = None if args.max_seconds is None else started + args.max_seconds
        runner = _run_http if args.url else _run_in_process
        runs = asyncio.run(runner(args, plan, deadline))
    except BrokenPipeError:  # stdout's reader went away: cli.run_command ends quietly
        raise
    except (ValueError, RuntimeError, OSError, MemoryError) as e:  # bad options, no server, no memory
        line = failure_line(e, args) or next(iter(str(e).splitlines()), "") or type(e).__name__
        print(f"loopjax bench: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # during the warm-up or a run: 128 + SIGINT, as a shell says
        print("loopjax bench: interrupted; no report written", file=sys.stderr)
        return 130
    if not runs:
        print("loopjax bench: error: the --max-seconds budget was spent before the first run; no report "
              "written", file=sys.stderr)
        return 2
    reports = []
    for run_ in runs:
        reports.append(_report(run_, args))
        print(rep.format_summary(reports[-1]))
    out = args.out or f"bench-{plan[0][1][0][1].name}.json"
    plot = args.plot or (out[:-5] if out.endswith(".json") else out) + ".png"
    if args.compare_prefix_cache:  # {"compare", "off", "on", "ratio", "matching_outputs"}
        arms = {run_.prefix_caching: (run_, report) for run_, report in zip(runs, reports)}
        off, on = arms.get(False, (None, None)), arms.get(True, (None, None))
        a, b = _outputs(off[0]), _outputs(on[0])
        keys = sorted(set(a) | set(b), key=lambda k: (k[0] or 0, k[1] or 0))
        result = rep.compare_prefix_cache(off[1], on[1], [a.get(k) for k in keys], [b.get(k) for k in keys])
        print(rep.format_compare(result))
        rep.write_json(result, out)
        plot = rep.write_compare_plot(result, plot) if off[1] and on[1] else None
    elif len(reports) == 1:  # one level: its report
        rep.write_json(reports[0], out)
        plot = rep.write_plot(reports[0], plot)
    else:  # a sweep: {"sweep": [report per level]} and a plot against C
        rep.write_json({"sweep": reports}, out)
        plot = rep.write_sweep_plot(reports, plot)
    if plot is None:
        plot = " (no plot: matplotlib is not installed)" if rep._pyplot() is None else " (no plot)"
    else:
        plot = f" and {plot}"
    print(f"wrote {out}{plot}")
    return 0


def main(argv: list[str] | None = None) -> int:  # python -m loopjax.bench.cli (bench/gpu_run.sh)
    from loopjax.cli import CommandParser, run_command

    parser = CommandParser(prog="loopjax bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_command(run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
