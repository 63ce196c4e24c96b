"""`loopjax bench`: workloads send what they promise, the report has every field, and the
CLI runs end to end on the tiny preset in-process and over HTTP against a live server."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
from test_server import LiveServer  # tests/ is on sys.path under pytest's default import mode

from loopjax.bench.report import REPORT_FIELDS, percentile, summarize
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


def test_summary_fields_and_percentiles():
    assert percentile([3, 1, 2], 50) == 2 and percentile([1, 2], 90) == pytest.approx(1.9)
    assert percentile([], 50) is None
    spec = WorkloadSpec("burst", prompt_len=5, output_len=3, concurrency=4)
    records = asyncio.run(run_workload(spec, EchoBackend(), vocab_size=30))
    report = summarize(records, 2.0, workload="burst", model="m", target="in-process", spec={})
    assert tuple(report) == REPORT_FIELDS
    assert report["output_tokens"] == 12 and report["tokens_per_s"] == 6.0
    assert report["ttft_p50_s"] == pytest.approx(0.5) and report["tpot_p50_s"] == pytest.approx(0.1)
    assert report["submissions_per_output_token"] == 1.0 and report["mean_loops_per_token"] == 4.0
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec("storm")


def _check_report(report, workload, num_requests):
    assert tuple(report) == REPORT_FIELDS
    assert report["workload"] == workload and report["num_requests"] == num_requests
    assert report["output_tokens"] == 4 * num_requests  # greedy + ignore_eos: exactly O each
    for key in ("tokens_per_s", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "submissions_per_output_token",
                "mean_loops_per_token"):
        assert isinstance(report[key], float) and report[key] > 0, key
    assert report["ttft_p50_s"] <= report["ttft_p90_s"]
    assert report["engine_stats"]["pages_free"] > 0


def _load(path):
    png = path[:-5] + ".png"
    assert os.path.getsize(png) > 1000
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(path) as f:
        return json.load(f)


def test_bench_in_process_burst_sweep(tmp_path, capsys):
    out = str(tmp_path / "burst.json")
    assert main(["bench", "ouro-tiny", "--workload", "burst", *TINY, "-C", "1", "3", *ENGINE_FLAGS,
                 "--out", out]) == 0
    sweep = _load(out)["sweep"]
    assert [r["spec"]["concurrency"] for r in sweep] == [1, 3]
    for report, c in zip(sweep, (1, 3)):
        _check_report(report, "burst", c)
        assert report["target"] == "in-process"
    assert capsys.readouterr().out.count("tok/s") == 2


def test_bench_over_http_sessions(tmp_path):
    from loopjax.engine import Engine, EngineConfig
    from loopjax.model import load
    from loopjax.server import create_app

    model = load("ouro-tiny")
    config = EngineConfig(max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
                          prefill_token_buckets=(32,), max_prefill_rows=4, verbose=False)
    app = create_app(Engine(model, config), "tiny", model=model)
    with LiveServer(app) as live:
        out = str(tmp_path / "sessions.json")
        assert main(["bench", "tiny", "--workload", "sessions", *TINY, "--url", live.url, "--out", out]) == 0
        report = _load(out)
        _check_report(report, "sessions", 4)
        assert report["target"] == live.url and report["engine_stats"]["requests_finished_total"] >= 4
        # A name the server does not serve is one clear error line, not a traceback.
        assert main(["bench", "nope", *TINY, "--url", live.url, "--out", out]) == 1
