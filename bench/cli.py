"""`loopjax bench MODEL --workload burst|sessions [sizes] [--url URL] [--out JSON] [--plot PNG]`.

Without `--url` the workload runs in-process: the Engine (built from MODEL and the engine
options, as `loopjax serve` builds it) behind an AsyncEngine, timed at the point where
outputs reach the event loop. With `--url` the same workload (same prompts) streams from a
running `loopjax serve` over HTTP, timed at the client; MODEL is then the served model name.
Prints one summary line, writes the JSON report and the PNG plot (bench/report.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time

from loopjax.bench.report import format_summary, summarize, write_json, write_plot, write_sweep_plot
from loopjax.bench.workloads import Record, WorkloadSpec, run_workload


class InProcessBackend:
    """Streams requests through an AsyncEngine; greedy, ignore_eos, exactly max_tokens tokens."""

    def __init__(self, aengine):
        self.aengine = aengine

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Record:
        from loopjax.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        stream = await self.aengine.submit(prompt_ids, params)
        record = Record(prompt_len=len(prompt_ids), start=start, first_token=None, end=start)
        async for out in stream:
            now = time.perf_counter()
            if record.first_token is None and out.new_token_ids:
                record.first_token = now
            record.end = now
            record.token_ids = list(out.token_ids)
            loops = list(out.exit_loops or [])
            record.exit_loops = loops if len(loops) == len(out.token_ids) else record.exit_loops + loops
            per_token = (out.metrics or {}).get("submissions") or 0  # the engine's, per output token
            record.submissions = round(per_token * max(1, len(out.token_ids)))
        return record


class HttpBackend:
    """Streams requests from a loopjax server's /v1/completions (token-id prompts, SSE)."""

    def __init__(self, client, model: str):
        self.client, self.model = client, model

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> Record:
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        record = Record(prompt_len=len(prompt_ids), start=start, first_token=None, end=start)
        async with self.client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                raise RuntimeError(f"server answered {resp.status_code}: {text[:300]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"server error mid-stream: {chunk['error'].get('message')}")
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids"):
                        record.first_token = record.first_token or now
                        record.token_ids += choice["token_ids"]
                        record.exit_loops += choice.get("exit_loops") or []
                    record.end = now
                if chunk.get("usage"):
                    record.submissions = int(chunk["usage"].get("submissions") or 0)
        return record


def add_arguments(parser):
    from loopjax.async_engine import add_engine_arguments

    d = WorkloadSpec("burst")
    parser.add_argument("model", help="checkpoint folder or preset (in-process), or the served name (--url)")
    parser.add_argument("--workload", choices=("burst", "sessions"), default="burst")
    parser.add_argument("--prompt-len", "-P", type=int, default=d.prompt_len,
                        help="burst prompt tokens / sessions' opening tokens")
    parser.add_argument("--output-len", "-O", type=int, default=d.output_len, help="tokens per request/turn")
    parser.add_argument("--concurrency", "-C", type=int, nargs="+", default=[d.concurrency],
                        help="burst requests sent at once; several values run a sweep")
    parser.add_argument("--sessions", "-N", type=int, default=d.num_sessions, help="sessions")
    parser.add_argument("--turns", "-T", type=int, default=d.num_turns, help="turns per session")
    parser.add_argument("--user-len", "-U", type=int, default=d.user_len, help="tokens per later user turn")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--url", default=None, help="http://host:port of a running `loopjax serve`")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="with --url: token ids to draw from (default: the server's /v1/models)")
    parser.add_argument("--no-warmup-request", action="store_true", help="skip the untimed warm-up request")
    parser.add_argument("--out", default=None, help="JSON report path (default: bench-<workload>.json)")
    parser.add_argument("--plot", default=None, help="PNG plot path (default: the JSON path with .png)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)


def _specs(args) -> list[WorkloadSpec]:
    """One spec per burst concurrency level (a sweep when several are given)."""
    levels = args.concurrency if args.workload == "burst" else args.concurrency[:1]
    return [WorkloadSpec(args.workload, prompt_len=args.prompt_len, output_len=args.output_len,
                         concurrency=c, num_sessions=args.sessions, num_turns=args.turns,
                         user_len=args.user_len, seed=args.seed) for c in levels]


async def _run_specs(specs, backend, vocab_size, args, stats):
    """[(spec, records, duration_s, engine stats after it)]; one untimed warm-up request first
    (first-call costs such as compilation or connection setup stay out of the numbers)."""
    from tqdm import tqdm

    if not args.no_warmup_request:
        low = specs[0].token_low
        await backend.generate(list(range(low, low + min(specs[0].prompt_len, 8))), 2)
    results = []
    for spec in specs:
        label = spec.name if spec.name == "sessions" else f"burst C={spec.concurrency}"
        with tqdm(total=spec.num_requests, desc=label, unit="req", disable=args.no_progress) as bar:
            start = time.perf_counter()
            records = await run_workload(spec, backend, vocab_size, on_done=lambda r: bar.update(1))
            duration = time.perf_counter() - start
        results.append((spec, records, duration, await stats()))
    return results


async def _run_in_process(args, specs):
    from loopjax.async_engine import AsyncEngine, build_engine

    model, engine = build_engine(args)
    sched = getattr(getattr(engine, "scheduler", None), "config", None)  # may allow less than the model
    context = getattr(sched, "max_seq_len", None) or model.cfg.max_context_len
    need = max(s.max_context for s in specs)
    if need > context:
        raise ValueError(f"the workload needs {need} tokens of context, the engine serves {context} "
                         f"(see --max-context-len)")
    aengine = AsyncEngine(engine, max_waiting=max(s.num_requests for s in specs) + 1)
    await aengine.start()

    async def stats():
        return aengine.stats()

    try:
        return await _run_specs(specs, InProcessBackend(aengine), model.cfg.vocab_size, args, stats)
    finally:
        aengine.shutdown()


async def _run_http(args, specs):
    import httpx

    from loopjax.metrics import parse

    most = max(s.num_requests for s in specs)
    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        vocab_size = args.vocab_size
        if vocab_size is None:
            cards = (await client.get("/v1/models")).json()["data"]
            vocab_size = next((c.get("vocab_size") for c in cards if c["id"] == args.model), None)
            if vocab_size is None:
                raise ValueError(f"the server at {args.url} does not serve {args.model!r} with a known "
                                 f"vocab_size (served: {[c['id'] for c in cards]}); pass --vocab-size")

        async def stats():  # the server's gauges and counters, as /metrics has them
            samples = parse((await client.get("/metrics")).text)
            return {k[len("loopjax_"):]: v for k, v in samples.items()
                    if k.startswith("loopjax_") and "{" not in k}

        return await _run_specs(specs, HttpBackend(client, args.model), vocab_size, args, stats)


def run(args) -> int:
    try:
        specs = _specs(args)
        runner = _run_http if args.url else _run_in_process
        results = asyncio.run(runner(args, specs))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"loopjax bench: {e}", file=sys.stderr)
        return 1
    reports = []
    for spec, records, duration, stats in results:
        loops = None if any(r.exit_loops for r in records) else stats.get("mean_loops_per_token")
        reports.append(summarize(records, duration, workload=spec.name, model=args.model,
                                 target=args.url or "in-process", engine_stats=stats,
                                 mean_loops_per_token=loops,
                                 spec=dataclasses.asdict(spec) | {"num_requests": spec.num_requests}))
        print(format_summary(reports[-1]))
    out = args.out or f"bench-{specs[0].name}.json"
    plot = args.plot or (out[:-5] if out.endswith(".json") else out) + ".png"
    # One level: its report. A sweep: {"sweep": [report per level]} and a plot against C.
    if len(reports) == 1:
        write_json(reports[0], out)
        write_plot(reports[0], plot)
    else:
        write_json({"sweep": reports}, out)
        write_sweep_plot(reports, plot)
    print(f"wrote {out} and {plot}")
    return 0
