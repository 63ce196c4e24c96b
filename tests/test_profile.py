"""bench/profile.py: the trace parser on a synthetic trace whose busy time and gaps are known,
and the host timers on the tiny preset (CPU: no device streams, the host table only)."""

from __future__ import annotations

import gzip
import json

import pytest

from loopjax.bench import profile

GPU, HOST, STREAM, COPY, DERIVED = 2, 1, 10, 12, 11


def _x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def _meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def synthetic_trace(stream_name="Stream #14(Compute)"):
    """Kernels (µs) [10,30) A, [25,40) B, [60,70) A, [120,180) C, [185,190) copy; the union is
    [10,40) [60,70) [120,180) [185,190): busy 105 of a 180 span, gaps 20, 50, 5. Host steps
    [0,100) and [100,200). A derived "XLA Ops" row repeats the module over the whole span; the
    host's own copy event is not device time. Names as in a jax 0.11.2 trace on the H200."""
    return [
        _meta(HOST, "/host:CPU"), _meta(GPU, "/device:GPU:0"), _meta(HOST, "python3", 5),
        _meta(HOST, "pjrt_async_work_runner/-502", 6),
        _meta(GPU, stream_name, STREAM), _meta(GPU, "Stream #19(MemcpyD2H)", COPY),
        _meta(GPU, "XLA Ops", DERIVED),
        _x(HOST, 5, "loopjax_step_0", 0, 100), _x(HOST, 5, "loopjax_step_1", 100, 100),
        _x(HOST, 5, "loopjax_step_10_not_a_step", 0, 5), _x(HOST, 6, "MemcpyD2H", 182, 9),
        _x(GPU, STREAM, "A", 10, 20), _x(GPU, STREAM, "B", 25, 15), _x(GPU, STREAM, "A", 60, 10),
        _x(GPU, STREAM, "C", 120, 60), _x(GPU, COPY, "MemcpyD2H", 185, 5),
        {"ph": "i", "pid": GPU, "tid": STREAM, "name": "marker", "ts": 50},
    ]


def test_device_summary_busy_gaps_top_kernels_and_steps():
    events = synthetic_trace() + [_x(GPU, DERIVED, "fusion", 10, 180)]
    s = profile.device_summary(events, gap_us=10.0)
    assert s["num_kernels"] == 5 and s["device_streams"] == ["Stream #14(Compute)", "Stream #19(MemcpyD2H)"]
    assert s["span_us"] == 180 and s["busy_us"] == 105
    assert s["busy_pct"] == pytest.approx(100 * 105 / 180)
    g = s["gaps"]
    assert (g["count"], g["total_us"], g["largest_us"]) == (3, 75, [50, 20, 5])
    assert (g["over_threshold_count"], g["over_threshold_total_us"]) == (2, 70)
    top = [(k["name"], k["count"], k["total_us"], k["mean_us"]) for k in s["top_kernels"]]
    assert top == [("C", 1, 60, 60), ("A", 2, 30, 15), ("B", 1, 15, 15), ("MemcpyD2H", 1, 5, 5)]
    steps = [(st["step"], st["wall_us"], st["device_busy_us"], st["idle_before_first_kernel_us"],
              st["idle_after_last_kernel_us"]) for st in s["steps"]]
    assert steps == [(0, 100, 40, 10, 30), (1, 100, 65, 20, 10)]
    assert profile.device_summary(events, top=2)["top_kernels"][1]["name"] == "A"
    text = profile.format_device_summary(s, {0: "decode", 1: "prefill"})
    assert "busy 0.10 ms (58.3%)" in text and "decode" in text and "largest 50, 20, 5 µs" in text


def test_device_summary_without_stream_rows_uses_every_device_row_and_none_on_cpu():
    events = [e for e in synthetic_trace(stream_name="gpu compute") if e.get("tid") != COPY]
    s = profile.device_summary(events + [_x(GPU, DERIVED, "fusion", 10, 180)])  # no "Stream" row
    assert s["num_kernels"] == 4 and s["busy_us"] == 100 and s["device_streams"] == []
    cpu_only = [e for e in synthetic_trace() if e["pid"] == HOST]
    assert profile.device_summary(cpu_only) is None


def test_kernel_positions_tell_apart_one_kernel_at_two_places():
    """Two layer applications of attention, a product P, a norm, P again (wo's and w_down's
    partials share a kernel): P#0 and P#1 get their own times and the idle gaps before them;
    no anchor kernel, no table."""
    from loopjax.bench.trace_summary import format_positions, kernel_positions

    events, t = [_meta(GPU, "/device:GPU:0"), _meta(GPU, "Stream #14(Compute)", STREAM)], 0
    layer = (("loopjax_paged_decode_write", 5, 1), ("P", 4, 2), ("norm", 2, 0), ("P", 8, 1))
    for _ in range(2):
        for name, dur, gap in layer:
            t += gap
            events.append(_x(GPU, STREAM, name, t, dur))
            t += dur
    rows = {r["position"]: (r["count"], r["mean_us"], r["mean_gap_us"]) for r in kernel_positions(events)}
    assert rows == {"loopjax_paged_decode_write#0": (2, 5, 0.5), "P#0": (2, 4, 2), "norm#0": (2, 2, 0),
                    "P#1": (2, 8, 1)}
    assert kernel_positions(events)[0]["position"] == "P#1"  # the largest total first
    assert "P#1" in format_positions(kernel_positions(events))
    assert kernel_positions([e for e in events if "paged" not in e["name"]]) == []


def test_load_trace_events_reads_the_newest_perfetto_file(tmp_path):
    run = tmp_path / "plugins" / "profile" / "2026_01_01"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": synthetic_trace()}, f)
    assert profile.device_summary(profile.load_trace_events(str(tmp_path)))["busy_us"] == 105
    with pytest.raises(RuntimeError, match="no perfetto_trace.json.gz"):
        profile.load_trace_events(str(tmp_path / "plugins" / "empty"))


def test_host_table_derives_read_other_and_host():
    ms = 1e-3
    records = [{"kind": "decode", "rows": 4, "schedule": 1 * ms, "run": 10 * ms, "make_batch": 2 * ms,
                "submit": 1 * ms, "wait": 6 * ms, "update": 1 * ms, "step": 13 * ms},
               {"kind": "decode", "rows": 2, "schedule": 1 * ms, "run": 6 * ms, "make_batch": 2 * ms,
                "submit": 1 * ms, "wait": 2 * ms, "update": 1 * ms, "step": 9 * ms},
               {"kind": "idle", "step": 0.5 * ms}]
    t = profile.host_table(records)
    d = t["decode"]
    assert d["steps"] == 2 and d["mean_rows"] == 3
    assert d["read"]["mean_ms"] == pytest.approx(1.0) and d["other"]["mean_ms"] == pytest.approx(1.0)
    assert d["wait"]["mean_ms"] == pytest.approx(4.0) and d["host"]["mean_ms"] == pytest.approx(7.0)
    assert d["host_pct"] == pytest.approx(100 * 7 / 11)
    assert set(t) == {"decode"}  # idle steps (nothing planned) are left out
    assert "decode" in profile.format_host_table(t)


def test_profile_tiny_burst_on_cpu(tmp_path, capsys):
    out = tmp_path / "prof"
    rc = profile.main(["ouro-tiny", "-P", "12", "-O", "3", "-C", "2", "--trace-steps", "2",
                       "--no-async-scheduling", "--split-wait",  # synchronous: one plan per step
                       "--out", str(out), "--max-num-rows", "4", "--decode-row-buckets", "4",
                       "--max-prefill-tokens", "32", "--prefill-token-buckets", "32",
                       "--max-prefill-rows", "4", "--no-verbose"])
    assert rc == 0
    summary = json.loads((out / "profile.json").read_text())
    host = summary["host"]
    # Both prompts pack into one prefill (first tokens); two decode steps give tokens 2 and 3.
    assert (host["prefill"]["steps"], host["decode"]["steps"], host["decode"]["mean_rows"]) == (1, 2, 2)
    for stage in ("schedule", "make_batch", "submit", "wait", "update", "step"):
        assert host["decode"][stage]["mean_ms"] > 0, stage
    assert host["decode"]["step"]["mean_ms"] >= host["decode"]["host"]["mean_ms"] > 0
    assert summary["compilations_during_run"] == 0 and summary["trace"] is None
    assert set(summary["wrapped"]) == {"Scheduler.schedule", "Scheduler.update", "Runner.run",
                                       "Runner.make_batch", "Runner.read", "Runner.submit"}
    text = capsys.readouterr().out
    assert "no GPU stream events" in text and "host stages per step" in text
    assert not (out / "trace").exists()  # the raw trace is kept only with --keep-trace


def test_kernel_groups_drop_numeric_suffixes():
    assert [profile.kernel_group(n) for n in ("loop_add_fusion_12", "gemm_fusion_dot.3", "fusion_2.1",
                                               "input_reduce_fusion", "sm90_xmma_gemm_bf16")] == [
        "loop_add_fusion", "gemm_fusion_dot", "fusion", "input_reduce_fusion", "sm90_xmma_gemm_bf16"]
    events = synthetic_trace() + [_x(GPU, STREAM, "A_7", 200, 30)]
    groups = profile.device_summary(events)["top_kernel_groups"]
    assert (groups[0]["name"], groups[0]["count"], groups[0]["total_us"]) == ("A", 3, 60)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_is_named_by_the_plan_it_reads(async_scheduling):
    """Pipelined, a step sends plan n + 1 and reads (waits for) plan n: the record takes plan
    n's kind and rows, so each kind counts the plans applied of it, and the burst's last step
    (it sends nothing) is no idle step. On the fake device (tests/fake_device.py)."""
    from fake_device import engine_on_fake_device

    import loopjax
    from loopjax.engine import EngineConfig
    from loopjax.sampling_params import SamplingParams

    config = EngineConfig(page_size=4, max_num_rows=4, max_context_len=32, max_prefill_tokens=8,
                          prefill_token_buckets=(8,), max_prefill_rows=1, async_scheduling=async_scheduling)
    engine = engine_on_fake_device(loopjax.load("tests/data/ouro"), config)
    applied = []  # (kind, real rows) of every plan the engine applies, in order
    update = engine.scheduler.update
    engine.scheduler.update = lambda plan, out: applied.append((plan.kind.value, plan.num_real_rows)) \
        or update(plan, out)
    timer = profile.StageTimer(engine)
    for k, length in enumerate((6, 7, 5)):  # one prompt per prefill step: prefills among decodes
        engine.add_request(list(range(1, length + 1)), SamplingParams(max_tokens=4 + k, ignore_eos=True))
    profile._drain(engine)
    named = [(r["kind"], r["rows"]) for r in timer.records if r["kind"] != "idle"]
    assert named == applied and {"prefill", "decode"} <= {kind for kind, _ in named}
    assert timer.records[-1]["kind"] == "decode"
