"""The device benchmarks bench/adaptive.py and bench/prefill.py and the host benchmark
bench/host_step.py run end to end with --smoke on CPU (tiny presets, in-process) and their JSON
has every field; the prefill FLOP formula."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from loopjax import config
from loopjax.bench import adaptive, host_overhead, host_step, prefill


def _load(path):
    with open(path) as f:
        return json.load(f)


def test_adaptive_smoke(tmp_path):
    out = tmp_path / "adaptive.json"
    assert adaptive.main(["--smoke", "--out", str(out)]) == 0
    data = _load(out)
    assert data["records"] and data["skipped"] == [] and data["device"]
    for r in data["records"]:
        assert not set(adaptive.RECORD_FIELDS) - set(r), r
        assert r["median_us"] > 0 and r["tokens_per_s"] > 0 and "error" not in r
    for preset, depth, exits in (("huginn-tiny", 8, (4, 8)), ("ouro-tiny", 4, (2, 4))):
        recs = {r["variant"]: r for r in data["records"] if r["preset"] == preset}
        assert {r["exit_mode"] for r in recs.values()} == {"fixed", "skip", "select"}
        fixed = recs["fixed"]
        assert fixed["mean_loops"] == depth and fixed["saved_us"] == 0.0
        assert fixed["fixed_us_per_loop"] == pytest.approx(fixed["median_us"] / depth)
        for e in exits:  # trace exits run exactly the traced loops
            trace = recs[f"trace{e}"]
            assert trace["mean_loops"] == e and trace["exit_mode"] == "skip"
            assert (trace["us_saved_per_loop_skipped"] is None) == (e == depth)
            assert trace["saved_us"] == pytest.approx(fixed["median_us"] - trace["median_us"])
        for r in recs.values():
            if r["exit_mode"] == "select":  # every loop runs; the rule picks one
                assert r["mean_loops"] == depth and 1 <= r["selected_loops"] <= depth
            assert 1 <= r["mean_loops"] <= depth
        assert recs[f"depth{exits[0]}"]["mean_loops"] == exits[0]  # fixed-depth baseline
    huginn = {r["variant"]: r for r in data["records"] if r["preset"] == "huginn-tiny"}
    assert huginn["steps4"]["mean_loops"] == 4 and "skip-kl" in huginn and "select-latent-diff" in huginn
    assert "skip-q0.5" in {r["variant"] for r in data["records"] if r["preset"] == "ouro-tiny"}


def test_prefill_smoke(tmp_path):
    out, huginn_out = tmp_path / "prefill.json", tmp_path / "huginn.json"
    # XLA attention only (the Pallas backend is the same runner with another string; its
    # interpret-mode compile would double this test's time on CPU). The engine start-up runs
    # for Ouro only: its path is the same for both families, and Huginn's costs ~13 s on CI.
    assert prefill.main(["--smoke", "--preset", "ouro-tiny", "--shapes", "2x16", "--backend", "xla",
                         "--out", str(out)]) == 0
    assert prefill.main(["--smoke", "--preset", "huginn-tiny", "--backend", "xla",
                         "--startup-backends", "none", "--out", str(huginn_out)]) == 0
    data, huginn_data = _load(out), _load(huginn_out)
    assert data["peak_tflops"] == 790.0 and data["skipped"] == huginn_data["skipped"] == []
    records = data["records"] + huginn_data["records"]
    assert {(r["preset"], r["backend"]) for r in records} == {
        (p, "xla") for p in ("ouro-tiny", "huginn-tiny")}
    for r in records:
        assert not set(prefill.RECORD_FIELDS) - set(r), r
        assert r["compiles_during"] == 0 and r["tokens_per_s"] > 0 and r["pct_peak"] > 0
        assert r["bucket"] == [2, 32] and r["tokens"] == 32
    assert [e["preset"] for e in data["engines"]] == ["ouro-tiny"] and huginn_data["engines"] == []
    for e in data["engines"]:
        assert not set(prefill.ENGINE_FIELDS) - set(e), e
        assert e["warmup_s"] > 0 and e["compilations"] == 3  # one decode (both samplers) + one prefill
        assert e["steady_state_ok"] and e["steady_state_compiles"] == 0 and e["steady_state_steps"] > 1


def test_host_step_smoke(tmp_path):
    out = tmp_path / "host.json"
    assert host_step.main(["--smoke", "--out", str(out)]) == 0
    data = _load(out)
    assert data["preset"] == "ouro-tiny" and data["async_scheduling"]
    (result,) = data["results"]
    assert (result["rows"], result["steps"], result["compilations_during_run"]) == (2, 5, 0)
    us = result["median_us"]
    assert set(us) == set(host_step.PHASES)
    assert all(us[p] > 0 for p in ("schedule", "rows", "make_batch", "submit", "update", "host"))
    assert us["step"] >= us["host"]


def test_host_step_without_device_compiles_nothing(tmp_path):
    out = tmp_path / "host.json"
    assert host_step.main(["--smoke", "--no-device", "--rows", "1,3", "--out", str(out)]) == 0
    data = _load(out)
    assert data["no_device"] and [r["rows"] for r in data["results"]] == [1, 3]
    for result in data["results"]:
        assert result["steps"] == 5 and result["compilations_during_run"] == 0
        assert result["median_us"]["make_batch"] > 0


def test_host_overhead_smoke(tmp_path):
    """Every case (greedy, sampled, with text) decodes its rows with a canned step; a burst's
    first dispatch is timed."""
    out = tmp_path / "host.json"
    assert host_overhead.main(["--smoke", "--out", str(out)]) == 0
    data = _load(out)
    cases = [(r["rows"], r["sampled"], r["detokenize"]) for r in data["results"]]
    assert cases == [(2, False, False), (2, True, False), (2, True, True)]
    for result in data["results"]:
        assert set(result["median_us"]) == set(host_overhead.PHASES)
        assert all(result["median_us"][p] > 0 for p in ("schedule", "make_batch", "update", "host"))
    assert len(data["bursts"]) == 3 and all(b["first_dispatch_us"] > 0 for b in data["bursts"])


def test_host_step_phases_add_up_to_the_step():
    ms = 1e-3
    # the step reads the device (read) before Engine._update, which holds update and outputs
    record = {"schedule": 1 * ms, "engine_run": 5 * ms, "make_batch": 2 * ms, "submit": 1 * ms,
              "engine_update": 3 * ms, "read": 6 * ms, "update": 1 * ms, "step": 16 * ms}
    p = host_step.phases(record)
    assert (p["rows"], p["outputs"], p["host"]) == pytest.approx((2 * ms, 2 * ms, 10 * ms))
    assert p["other"] == pytest.approx(1 * ms)  # host 16 - 6 = 10 ms, 9 of them in the phases
    assert sum(p[k] for k in host_step.HOST_PHASES) + p["other"] == pytest.approx(p["host"])
    assert p["python"] == pytest.approx(9 * ms)  # host less the step call


def test_prefill_flops_formula():
    from loopjax.models import huginn, ouro
    cfg = config.preset("ouro-1.4b")
    model = SimpleNamespace(cfg=cfg, params=ouro.param_specs(cfg, "bfloat16"))
    h, f, v = 2048, 5632, 49152
    layer = h * (16 + 2 * 16) * 128 + 16 * 128 * h + h * 2 * f + f * h
    dense = 2 * 24 * layer * 4 * 2048 + 2 * h * v  # lm_head on the row's last token
    attention = 4 * 16 * 128 * 2048 * 2049 / 2 * 24 * 4
    assert prefill.step_flops(model, 1, 2048, 4) == pytest.approx(dense + attention, rel=1e-12)
    assert 10.5e9 < (dense + attention) / 2048 < 11.4e9  # the issue's ~11.4 counts every weight
    cfg = config.preset("huginn-0125")
    model = SimpleNamespace(cfg=cfg, params=huginn.param_specs(cfg, "bfloat16"))
    per_token = prefill.step_flops(model, 8, 256, 32) / (8 * 256)
    assert 100e9 < per_token < 120e9
    # Huginn: the coda runs over every token, its tied lm_head over the rows' last tokens only
    # (steps.huginn_step, since 8843875); 4 x 512 counted the head over all 2,048 tokens.
    h, f, v = 5280, 17920, 65536
    layer = h * 3 * h + h * h + h * 2 * f + f * h
    dense = 2 * ((2 + 2) * layer + h * h + (4 * layer + h * h) * 32) * 4 * 512 + 2 * h * v * 4
    attention = 4 * 4 * h * 512 * 513 / 2 * (2 + 2 + 4 * 32)
    assert prefill.step_flops(model, 4, 512, 32) == pytest.approx(dense + attention, rel=1e-12)
    assert prefill.parse_shapes("1x2048, 32X512") == [(1, 2048), (32, 512)]
    assert prefill.parse_shapes("none") == []


def test_gc_pause_probe_runs(capsys):
    import gc

    from loopjax.bench.probes import gc_pause

    assert gc_pause.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ouro-tiny: ") and "objects tracked" in lines[0]
    assert lines[1].startswith("full collection, ms:") and "frozen" in lines[2]
    assert gc.get_freeze_count() == 0  # the probe leaves the collector as it found it


def test_gap_census_places_idle_time_between_its_neighbours():
    from loopjax.bench.probes import gap_census

    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "Stream #14(Compute)"}},
              {"ph": "X", "pid": 9, "tid": 1, "ts": 0.0, "dur": 40.0, "name": "loopjax_step_0"},
              {"ph": "X", "pid": 9, "tid": 1, "ts": 40.0, "dur": 400.0, "name": "loopjax_step_1"}]
    start = 1.0
    # (name, duration, idle after); a gap belongs to the step where it starts.
    timeline = [("fusion_1", 10, 0.5), ("Memset 0", 5, 2), ("nvjet_a", 20, 60), ("fusion_2", 3, 300),
                ("MemcpyH2D", 7, 0)]
    for name, dur, idle in timeline:
        events.append({"ph": "X", "pid": 1, "tid": 2, "ts": start, "dur": dur, "name": name})
        start += dur + idle
    c = gap_census.census(events)
    assert c["num_kernels"] == 5 and c["busy_us"] == 45
    assert [h["count"] for h in c["histogram"]] == [1, 1, 0, 0, 1, 1]
    assert c["largest"][0] == {"gap_us": 300, "step": 1, "before": "fusion_2", "after": "MemcpyH2D"}
    assert c["largest"][1] == {"gap_us": 60, "step": 0, "before": "nvjet_a", "after": "fusion_2"}
    assert c["pairs"][0] == {"pair": "fusion -> MemcpyH2D", "count": 1, "total_us": 300}
    step0, step1 = c["steps"]
    assert (step0["kernels"], step1["kernels"]) == (3, 2)
    assert step0["busy_us"] == 10 + 5 + 20 and step1["idle_us"] == 400 - step1["busy_us"]
    assert "fusion_2 -> MemcpyH2D" in gap_census.format_census(c)
