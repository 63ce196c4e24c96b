"""`loopjax bench`: workloads send what they promise, the report has every field, the
--max-seconds guard cuts and skips runs, and the CLI runs end to end on the tiny preset
in-process (a burst sweep without FastAPI/uvicorn/httpx importable, as on the GPU image; the
sessions workload with --compare-prefix-cache). The run over HTTP against a live server is in
test_server_metrics.py (it shares the session's live server, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import types

import pytest

from loopjax.bench import report as rep
from loopjax.bench.cli import run_specs
from loopjax.bench.workloads import Record, WorkloadSpec, run_workload
from loopjax.cli import main

TINY = ["-P", "12", "-O", "4", "-C", "3", "-N", "2", "-T", "2", "-U", "3", "--no-progress"]
# Engine options that keep compilation short on CI's CPU (flags generated from EngineConfig).
ENGINE_FLAGS = ["--max-num-rows", "4", "--decode-row-buckets", "4", "--max-prefill-tokens", "32",
                "--prefill-token-buckets", "32", "--max-prefill-rows", "4", "--no-verbose"]


class EchoBackend:
    """Answers every request with `max_tokens` copies of its last prompt token; logs prompts."""

    def __init__(self):
        self.prompts, self.clock = [], 0.0

    async def generate(self, prompt_ids, max_tokens):
        self.prompts.append(list(prompt_ids))
        self.clock += 1.0
        await asyncio.sleep(0)
        return Record(prompt_len=len(prompt_ids), start=self.clock, first_token=self.clock + 0.5,
                      end=self.clock + 0.5 + 0.1 * (max_tokens - 1), token_ids=[prompt_ids[-1]] * max_tokens,
                      exit_loops=[4] * max_tokens, submissions=max_tokens)


def test_burst_prompts_are_seeded_and_sized():
    spec = WorkloadSpec("burst", prompt_len=20, output_len=3, concurrency=5, seed=7)
    a, b = EchoBackend(), EchoBackend()
    records = asyncio.run(run_workload(spec, a, vocab_size=50))
    asyncio.run(run_workload(spec, b, vocab_size=50))
    assert a.prompts == b.prompts and len(a.prompts) == 5 and len({tuple(p) for p in a.prompts}) == 5
    assert all(len(p) == 20 and all(3 <= t < 50 for t in p) for p in a.prompts)
    assert all(len(r.token_ids) == 3 for r in records)
    other = EchoBackend()
    asyncio.run(run_workload(WorkloadSpec("burst", prompt_len=20, concurrency=5, seed=8), other, 50))
    assert other.prompts != a.prompts


def test_sessions_append_answer_and_new_message():
    spec = WorkloadSpec("sessions", prompt_len=6, output_len=2, num_sessions=3, num_turns=3, user_len=4)
    backend = EchoBackend()
    records = asyncio.run(run_workload(spec, backend, vocab_size=100))
    assert len(records) == 9 == spec.num_requests
    for s in range(3):
        turns = sorted((r for r in records if r.session == s), key=lambda r: r.turn)
        assert [r.prompt_len for r in turns] == [6, 6 + 2 + 4, 6 + 2 * (2 + 4)]
    # Each later prompt starts with the previous prompt followed by the previous answer.
    by_len = {}
    for p in backend.prompts:
        by_len.setdefault(len(p), []).append(p)
    for later in by_len[12]:
        first = next(p for p in by_len[6] if later[:6] == p)
        assert later[6:8] == [first[-1]] * 2
    assert spec.max_context == 6 + 3 * 2 + 2 * 4


def test_summary_fields_and_percentiles(monkeypatch, tmp_path):
    assert rep.percentile([3, 1, 2], 50) == 2 and rep.percentile([1, 2], 90) == pytest.approx(1.9)
    assert rep.percentile([], 50) is None
    spec = WorkloadSpec("burst", prompt_len=5, output_len=3, concurrency=4)
    records = asyncio.run(run_workload(spec, EchoBackend(), vocab_size=30))
    report = rep.summarize(records, 2.0, workload="burst", model="m", target="in-process", spec={})
    assert tuple(report) == rep.REPORT_FIELDS
    assert report["output_tokens"] == 12 and report["tokens_per_s"] == 6.0
    assert report["ttft_p50_s"] == pytest.approx(0.5) and report["tpot_p50_s"] == pytest.approx(0.1)
    assert report["submissions_per_output_token"] == 1.0 and report["mean_loops_per_token"] == 4.0
    assert report["compilations_during_run"] is None and report["warmup_s"] is None
    assert report["truncated"] is False and report["prefix_cache"]["hit_rate"] is None  # nothing known
    # Engine counters are the run's: after minus before; hit rates over the run's admissions.
    before = {"compilations": 5, "prefix_cache_queried_tokens": 100, "prefix_cache_hit_tokens": 10,
              "prefix_cache_queried_pages": 6, "prefix_cache_hit_pages": 1, "prefix_cache_evictions": 2}
    after = {"compilations": 5, "prefix_cache_queried_tokens": 300, "prefix_cache_hit_tokens": 110,
             "prefix_cache_queried_pages": 16, "prefix_cache_hit_pages": 5, "prefix_cache_evictions": 7,
             "prefix_cache_pages": 12, "prefix_cache_parked_pages": 4}
    report = rep.summarize(records, 2.0, workload="burst", model="m", target="in-process", spec={},
                       engine_stats=after, stats_before=before, prefix_caching=True, truncated=True,
                       startup={"load_s": 1.0, "warmup_s": 2.5, "compilations_after_warmup": 5})
    assert report["prefix_cache"] == {
        "enabled": True, "hit_rate": 0.5, "page_hit_rate": 0.4, "hit_tokens": 100, "queried_tokens": 200,
        "hit_pages": 4, "queried_pages": 10, "evictions": 5, "cached_pages": 12, "parked_pages": 4}
    assert tuple(report["prefix_cache"]) == rep.PREFIX_CACHE_FIELDS
    assert (report["load_s"], report["warmup_s"], report["compilations_after_warmup"]) == (1.0, 2.5, 5)
    assert report["compilations_during_run"] == 0 and report["truncated"] is True
    off = rep.prefix_cache_summary({}, {"prefix_cache_queried_tokens": 0}, False)
    assert off["hit_rate"] == off["page_hit_rate"] == 0.0 and off["enabled"] is False
    line = rep.format_summary(report)
    assert "prefix cache hit 50.0% of tokens, 40.0% of pages, 5 evictions" in line
    assert "warm-up 2.5 s, 5 compilations | 0 compilations in the run | TRUNCATED" in line
    times = [{"label": f"decode rows={r}", "seconds": s, "lower_s": 0.5, "cache_hit": r == 8}
             for r, s in ((8, 9.0), (4, 5.25), (2, 1.0), (1, 0.75))]
    assert rep.format_compile_times(times) == (
        "4 executables, 16.0 s summed over compile threads (1 from the compilation cache); slowest: "
        "decode rows=8 9.0 s (lower 0.5), decode rows=4 5.2 s (lower 0.5), decode rows=2 1.0 s (lower 0.5)")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no matplotlib: no plot, no crash
    assert rep.write_plot(report, str(tmp_path / "p.png")) is None and not os.listdir(tmp_path)
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec("storm")


class SlowBackend(EchoBackend):
    """EchoBackend that takes `slow_s` for prompts longer than `fast_len` tokens."""

    def __init__(self, fast_len, slow_s):
        super().__init__()
        self.fast_len, self.slow_s = fast_len, slow_s

    async def generate(self, prompt_ids, max_tokens):
        await asyncio.sleep(0.001 if len(prompt_ids) <= self.fast_len else self.slow_s)
        return await super().generate(prompt_ids, max_tokens)


def test_budget_cuts_and_skips_runs(capsys):
    """--max-seconds: a run that overruns its share is cut with its finished requests; a run
    with no time left is skipped; the time a fast run leaves goes to the next one."""
    async def stats():  # no generated_tokens: nothing to wait for
        return {"compilations": 2}

    sessions = WorkloadSpec("sessions", prompt_len=4, output_len=2, num_sessions=3, num_turns=2, user_len=2)
    fast = WorkloadSpec("burst", prompt_len=3, output_len=2, concurrency=2)

    async def go(deadline_in):
        backend = SlowBackend(fast_len=4, slow_s=30.0)  # turn 0 is fast, turn 1 never finishes in time
        start = time.perf_counter()
        runs = await run_specs([("fast", fast), ("sessions", sessions)], backend, 50, stats,
                               deadline=start + deadline_in, warmup_request=False, progress=False)
        return runs, time.perf_counter() - start

    runs, took = asyncio.run(go(1.0))
    assert [r.label for r in runs] == ["fast", "sessions"] and took < 5
    assert not runs[0].truncated and len(runs[0].records) == 2
    cut = runs[1]
    assert cut.truncated and 0.5 < cut.duration_s < 2.0  # most of the budget: "fast" left it its time
    assert sorted((r.session, r.turn) for r in cut.records) == [(0, 0), (1, 0), (2, 0)]
    assert cut.stats_before == cut.stats_after == {"compilations": 2}
    assert "sessions cut after" in capsys.readouterr().err
    runs, _ = asyncio.run(go(-1.0))  # nothing left: both skipped
    assert runs == [] and capsys.readouterr().err.count("skipped") == 2


class TrickleStreams:
    """An AsyncEngine's submit(): one token every `every_s` seconds up to max_tokens."""

    def __init__(self, every_s):
        self.every_s = every_s

    async def submit(self, prompt_ids, params):
        every_s = self.every_s

        async def tokens():
            ids = []
            for i in range(params.max_tokens):
                await asyncio.sleep(every_s)
                ids.append(i)
                yield types.SimpleNamespace(new_token_ids=[i], token_ids=list(ids), exit_loops=[4] * len(ids),
                                            metrics={"num_submissions": i + 1},
                                            finished=i == params.max_tokens - 1)

        class Stream:
            def __aiter__(self):
                return tokens()

            def close(self):
                pass

        return Stream()


def test_truncated_run_counts_the_tokens_its_cut_requests_received():
    """A burst cut by --max-seconds before any request finished ran at full speed: its tokens/s
    was 0 (the cut requests' wall time counted, their tokens not)."""
    from loopjax.bench.workloads import InProcessBackend

    async def stats():
        return {}

    spec = WorkloadSpec("burst", prompt_len=3, output_len=1000, concurrency=3)
    backend = InProcessBackend(TrickleStreams(every_s=0.01))
    (run,) = asyncio.run(run_specs([("burst", spec)], backend, 50, stats, deadline=time.perf_counter() + 0.5,
                                   warmup_request=False, progress=False))
    assert run.truncated and run.records == [] and 3 * 20 <= run.cut_tokens <= 3 * 50
    report = rep.summarize(run.records, run.duration_s, workload="burst", model="m", target="in-process",
                           spec={}, truncated=True, cut_tokens=run.cut_tokens)
    assert report["output_tokens"] == 0 and report["cut_output_tokens"] == run.cut_tokens
    assert report["tokens_per_s"] == pytest.approx(run.cut_tokens / run.duration_s)
    assert f"(+{run.cut_tokens} of cut requests)" in rep.format_summary(report)


class FakeStreams:
    """An AsyncEngine's submit(): records the params, streams nothing."""

    def __init__(self):
        self.params = []

    async def submit(self, prompt_ids, params):
        self.params.append(params)

        async def nothing():
            return
            yield

        class Stream:
            def __aiter__(self):
                return nothing()

            def close(self):
                pass

        return Stream()


def test_requests_carry_the_sampling_flags_and_seeds():
    """Greedy by default; the flags' fields on every request; with a sampling seed, a prompt's
    seed depends on the prompt only (not on the order requests go out), in-process and over HTTP."""
    from loopjax.bench.workloads import HttpBackend, InProcessBackend

    streams = FakeStreams()
    asyncio.run(InProcessBackend(streams).generate([5, 6], 3))
    (params,) = streams.params
    assert params.is_plain_greedy and params.max_tokens == 3 and params.ignore_eos
    sampling = {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3}
    streams = FakeStreams()
    backend = InProcessBackend(streams, sampling, sampling_seed=100)
    for prompt in ([5, 6], [7], [5, 6]):
        asyncio.run(backend.generate(prompt, 2))
    a, b, c = streams.params
    assert (a.temperature, a.top_k, a.repetition_penalty, a.frequency_penalty) == (0.7, 5, 1.3, 0.0)
    assert a.seed == c.seed != b.seed and a.seed >= 100
    http = HttpBackend(None, "m", sampling, sampling_seed=100)
    assert http.request_fields([5, 6], 2) == dict(sampling, max_tokens=2, ignore_eos=True, seed=a.seed)
    assert HttpBackend(None, "m").request_fields([5], 2) == {"temperature": 0.0, "max_tokens": 2,
                                                             "ignore_eos": True}


def test_bad_sampling_flags_are_refused_before_the_engine_is_built(capsys, monkeypatch):
    import loopjax.engine_args

    def no_engine(*a, **k):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(loopjax.engine_args, "build_engine", no_engine)
    for flags, field in ((["--temperature", "3"], "temperature"), (["--presence-penalty", "-2.5"],
                         "--presence-penalty"), (["--repetition-penalty", "0"], "--repetition-penalty")):
        assert main(["bench", "ouro-tiny", *TINY, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("loopjax bench: error: ") and field in err and "\n" not in err


def check_report(report, workload, num_requests, in_process=True):
    """Every field of a real run's report (tiny preset, O = 4, a warm engine)."""
    assert tuple(report) == rep.REPORT_FIELDS
    assert report["workload"] == workload and report["num_requests"] == num_requests
    assert report["output_tokens"] == 4 * num_requests  # ignore_eos: exactly O each
    for key in ("tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "submissions_per_output_token",
                "mean_loops_per_token"):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert report["ttft_p50_s"] <= report["ttft_p90_s"]
    assert report["engine_stats"]["pages_free"] > 0
    assert report["compilations_during_run"] == 0 and report["truncated"] is False
    pc = report["prefix_cache"]
    assert tuple(pc) == rep.PREFIX_CACHE_FIELDS and isinstance(pc["enabled"], bool)
    assert all(isinstance(pc[k], int) and pc[k] >= 0 for k in rep.PREFIX_CACHE_FIELDS[3:]), pc
    assert isinstance(pc["hit_rate"], float) and isinstance(pc["page_hit_rate"], float)
    if in_process:
        assert report["load_s"] > 0 and report["warmup_s"] > 0
        assert report["compilations_after_warmup"] == report["engine_stats"]["compilations"] > 0
        times = report["compile_times"]  # one entry per executable, slowest first
        assert len(times) == report["compilations_after_warmup"]
        assert [t["seconds"] for t in times] == sorted((t["seconds"] for t in times), reverse=True)
        assert all(t["compile_s"] > 0 and t["lower_s"] > 0 and t["cache_hit"] is False for t in times)
        assert sum(t["seconds"] for t in times) == pytest.approx(report["engine_stats"]["compile_s"])
        assert len({(t["label"], t["kind"]["num_loops"]) for t in times}) == len(times)
    else:
        assert report["load_s"] is None and report["warmup_s"] is None
        assert report["compilations_after_warmup"] is None and report["compile_times"] is None


def _load(path):
    png = path[:-5] + ".png"
    assert os.path.getsize(png) > 1000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(path) as f:
        return json.load(f)


def test_unwritable_report_paths_are_refused_before_the_engine_is_built(tmp_path, capsys, monkeypatch):
    """--out / --plot naming a folder, or under a file, failed only when the report was written
    after the whole run (a traceback, the run's results lost)."""
    import loopjax.engine_args

    def no_engine(*a, **k):
        raise AssertionError("the engine was built")

    monkeypatch.setattr(loopjax.engine_args, "build_engine", no_engine)
    (tmp_path / "file").write_text("")
    for flags, reason in ((["--out", str(tmp_path)], "is a folder"),
                          (["--plot", str(tmp_path)], "is a folder"),
                          (["--out", str(tmp_path / "file" / "r.json")], "is not a folder")):
        assert main(["bench", "ouro-tiny", *TINY, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"loopjax bench: error: {flags[0]} ") and reason in err, err
        assert "\n" not in err


def test_unreachable_server_is_one_line(tmp_path, capsys):
    """--url of a server that is not up (or not an http URL) was an httpx traceback."""
    for url in ("http://127.0.0.1:9", "localhost:8000"):
        assert main(["bench", "x", "--workload", "burst", *TINY, "--url", url, "--vocab-size", "256",
                     "--out", str(tmp_path / "r.json")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"loopjax bench: error: cannot reach the server at {url}: "), err
        assert "\n" not in err
    assert not (tmp_path / "r.json").exists()


def test_a_server_whose_models_list_is_not_loopjaxs_is_one_line(tmp_path, capsys):
    """--url of an OpenAI-like server whose /v1/models has no model list was a KeyError traceback."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            body = json.dumps({"object": "list"}).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert main(["bench", "x", "--workload", "burst", *TINY, "--url", url]) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err.strip()
    assert err == (f"loopjax bench: error: the server at {url} does not list 'x' with its vocabulary size "
                   "(served: []); pass --vocab-size"), err


def test_url_without_httpx_is_one_line(monkeypatch, capsys):
    """httpx comes with the bench extra: without it --url was a ModuleNotFoundError traceback."""
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` now raises ImportError
    assert main(["bench", "x", "--workload", "burst", *TINY, "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "loopjax bench: error: --url needs httpx; install it with: pip install 'loopjax[bench]'"


def test_ctrl_c_is_one_line_exit_130(monkeypatch, capsys):
    """Ctrl-C during the warm-up or a run (minutes) was a page of traceback."""
    import loopjax.engine_args

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(loopjax.engine_args, "build_engine", interrupted)
    assert main(["bench", "ouro-tiny", *TINY]) == 130
    assert capsys.readouterr().err == "loopjax bench: interrupted; no report written\n"


def test_bench_in_process_burst_sweep(tmp_path, capsys, monkeypatch, no_compilation_cache):
    # The GPU image has no FastAPI/uvicorn (and maybe no httpx): in-process bench needs none.
    for name in ("fastapi", "uvicorn", "httpx", "loopjax.server"):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    out = str(tmp_path / "burst.json")
    assert main(["bench", "ouro-tiny", "--workload", "burst", *TINY, "-C", "1", "3", *ENGINE_FLAGS,
                 "--max-seconds", "600", "--out", out]) == 0
    sweep = _load(out)["sweep"]
    assert [r["spec"]["concurrency"] for r in sweep] == [1, 3]
    for report, c in zip(sweep, (1, 3)):
        check_report(report, "burst", c)
        assert report["target"] == "in-process"
        assert report["prefix_cache"]["enabled"] is False and report["prefix_cache"]["hit_rate"] == 0.0
    assert sweep[0]["warmup_s"] == sweep[1]["warmup_s"]  # one engine, one warm-up
    printed = capsys.readouterr().out
    assert printed.count("tok/s") == 2 and printed.count("0 compilations in the run") == 2
    first = sweep[0]
    assert f"warm-up {first['warmup_s']:.1f} s, {first['compilations_after_warmup']} compilations" in printed
    slowest = first["compile_times"][0]
    assert f"slowest: {slowest['label']} {slowest['seconds']:.1f} s" in printed


def test_bench_compare_prefix_cache(tmp_path, capsys, no_compilation_cache):
    """Sessions with the cache off then on, one engine: same prompts and, drawn with the same
    seeds (--sampling-seed), the same outputs; the second turns hit the first turns' full page
    (16 of 27 tokens), ratios of both runs."""
    out = str(tmp_path / "compare.json")
    drawn = ["--temperature", "0.8", "--top-p", "0.9", "--presence-penalty", "0.5", "--sampling-seed", "11"]
    assert main(["bench", "ouro-tiny", "--workload", "sessions", *TINY, "-P", "20", *ENGINE_FLAGS, *drawn,
                 "--compare-prefix-cache", "--out", out]) == 0
    result = _load(out)
    assert tuple(result) == rep.COMPARE_FIELDS and result["compare"] == "prefix_cache"
    off, on = result["off"], result["on"]
    for report in (off, on):
        check_report(report, "sessions", 4)
        assert report["prompt_tokens"] == 94  # 2 x (20 + 27): the same prompts in both runs
    assert off["prefix_cache"]["enabled"] is False and off["prefix_cache"]["hit_tokens"] == 0
    assert on["prefix_cache"]["enabled"] is True
    assert (on["prefix_cache"]["hit_tokens"], on["prefix_cache"]["queried_tokens"]) == (32, 94)
    assert on["prefix_cache"]["page_hit_rate"] == 0.5 and on["prefix_cache"]["evictions"] == 0
    assert off["warmup_s"] == on["warmup_s"]  # one engine: its scheduler switched between the arms
    assert result["matching_outputs"] == 1.0  # fp32, seeded draws: the cache changes no token
    assert off["spec"]["sampling"] == on["spec"]["sampling"] == {
        "temperature": 0.8, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0,
        "frequency_penalty": 0.0, "presence_penalty": 0.5}
    assert off["spec"]["sampling_seed"] == 11
    ratio = result["ratio"]
    assert tuple(ratio) == rep.RATIO_FIELDS and ratio["prefix_cache_hit_rate"] is None  # off hits nothing
    assert ratio["tokens_per_s"] == pytest.approx(on["tokens_per_s"] / off["tokens_per_s"])
    assert ratio["ttft_p50_s"] == pytest.approx(on["ttft_p50_s"] / off["ttft_p50_s"])
    assert ratio["tpot_p50_s"] == pytest.approx(on["tpot_p50_s"] / off["tpot_p50_s"])
    printed = capsys.readouterr().out
    assert "prefix cache off vs on" in printed and "hit rate (tokens)" in printed and "34.0%" in printed
    assert printed.count("temperature=0.8 top_p=0.9 presence_penalty=0.5") == 2  # the runs' summaries
    # The comparison runs the sessions workload in-process only: one clear line, exit code 2.
    assert main(["bench", "ouro-tiny", *TINY, "--compare-prefix-cache", "--out", out]) == 2
    assert main(["bench", "x", "--workload", "sessions", *TINY, "--compare-prefix-cache", "--url",
                 "http://127.0.0.1:9", "--out", out]) == 2
    assert "in-process only" in capsys.readouterr().err


def test_url_with_an_api_key(tmp_path, monkeypatch):
    """A server started with --api-key: bench sends --api-key (or $OPENAI_API_KEY) as a bearer
    token; without one it is one line naming the flag (a 401 read as a server of no models).
    NOTE: no capsys: uvicorn binds its log handlers to the sys.stderr of the moment."""
    import contextlib
    import io

    from fake_engine import FakeEngine
    from server_helpers import MODEL_NAME, LiveServer

    from loopjax.server import create_app

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with LiveServer(create_app(FakeEngine(), MODEL_NAME, api_key="k3y")) as live:
        args = ["bench", MODEL_NAME, "--workload", "burst", *TINY, "--url", live.url, "--out",
                str(tmp_path / "r.json")]
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(args) == 2
        assert err.getvalue().strip() == (f"loopjax bench: error: the server at {live.url} asks for an API "
                                          f"key (401): pass --api-key or set OPENAI_API_KEY")
        assert main([*args, "--vocab-size", "256", "--api-key", "k3y"]) == 0
        with open(tmp_path / "r.json") as f:
            assert json.load(f)["output_tokens"] == 12
