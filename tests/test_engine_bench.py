"""The decode-step benchmark runs end to end on CPU (tiny preset) and reports sane records."""

import json
import types

import pytest

from loopjax.bench import decode_step


def test_decode_step_smoke(tmp_path):
    out = tmp_path / "decode.json"
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--rows", "2", "--iters", "1",
                           "--pointwise", "xla,pallas", "--trace", str(tmp_path / "trace"),
                           "--out", str(out), "--plot", str(tmp_path / "steps.png")])
    assert rc == 0
    assert (tmp_path / "steps.png").stat().st_size > 0  # tokens/s and % of roofline against rows
    records = json.loads(out.read_text())["records"]
    assert [(r["pointwise"], r["variant"], r["rows"], r["submissions_per_token"]) for r in records] == [
        ("xla", "fused", 2, 1), ("xla", "per_loop", 2, 4),
        ("pallas", "fused", 2, 1), ("pallas", "per_loop", 2, 4)]
    # --trace: the fused step was traced (a CPU trace holds no GPU kernels: an empty summary)
    assert all(("trace" in r) == ("pipelined_us" in r) == (r["variant"] == "fused") for r in records)
    assert all(r["pipelined_us"] > 0 for r in records if r["variant"] == "fused")
    assert list((tmp_path / "trace").iterdir())
    for r in records:
        assert r["median_us"] > 0 and r["weight_bytes"] > 0 and r["kv_bytes"] > 0
        assert 0 < r["roofline_pct"] < 100


def test_decode_step_page_width_wider_than_the_context(tmp_path):
    out = tmp_path / "decode.json"
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--rows", "2", "--iters", "1",
                           "--per-loop-rows", "", "--backend", "xla,pallas", "--context", "24",
                           "--page-width", "24,48", "--out", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["backend"], r["context"], r["page_width"]) for r in records] == [
        ("xla", 24, 24), ("xla", 24, 48), ("pallas", 24, 24), ("pallas", 24, 48)]
    for r in records:  # a table twice the context: XLA gathers twice the KV
        assert r["kv_table_bytes"] == r["page_width"] // 24 * r["kv_bytes"] > 0 and r["median_us"] > 0


def test_decode_step_page_width_below_the_context_is_one_line(capsys):
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--context", "32", "--page-width", "64,16"])
    err = capsys.readouterr().err
    assert rc == 2 and "--page-width 16 is below the context 32" in err and err.count("\n") == 1


def test_decode_step_streaming_experiments(tmp_path):
    """--streaming-rows: each experiment adds weight shapes to matmul 'auto's table for its
    run only (on CPU 'auto' is XLA, so only the bookkeeping is checked here)."""
    from loopjax import matmul_ops
    table = dict(matmul_ops.STREAMING_MAX_ROWS)
    out = tmp_path / "decode.json"
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--rows", "2", "--iters", "1",
                           "--per-loop-rows", "", "--matmul", "auto",
                           "--streaming-rows", "base;64x192:8,96x64:32", "--attn-write", "kernel,xla",
                           "--out", str(out)])
    assert rc == 0 and matmul_ops.STREAMING_MAX_ROWS == table
    records = json.loads(out.read_text())["records"]
    assert [(r["streaming_extra"], r["attn_write"]) for r in records] == [
        ("-", "kernel"), ("-", "xla"), ("64x192:8,96x64:32", "kernel"), ("64x192:8,96x64:32", "xla")]
    assert decode_step._streaming_experiments("base;1x2:3") == [{}, {(1, 2): 3}]


def test_decode_step_sampled_case_and_attention_stages(tmp_path):
    """--sampled-case times the same executable with every row drawing (top-p); --attn-stages
    fixes the Mosaic attention's slots for its run only (the default is restored)."""
    from loopjax.kernels import paged_attention_mgpu_config as mgpu
    default = mgpu.default_num_stages
    out = tmp_path / "decode.json"
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--rows", "2", "--iters", "1",
                           "--per-loop-rows", "", "--sampled-case", "--attn-stages", "auto,2",
                           "--out", str(out)])
    assert rc == 0 and mgpu.default_num_stages is default
    records = json.loads(out.read_text())["records"]
    assert [(r["attn_stages"], r["variant"]) for r in records] == [
        ("auto", "fused"), ("auto", "fused_top_p"), ("2", "fused"), ("2", "fused_top_p")]
    assert all(r["pipelined_us"] > 0 for r in records)
    with decode_step._attention_experiment("kernel", "auto", "2"):
        assert mgpu.default_num_stages(4096) == 2
    assert mgpu.default_num_stages(32768) == 3 and mgpu.default_num_stages is default
    # --attn-splits S:M: S context splits (capped by the blocks) of at least M blocks each
    rules = (mgpu.mosaic_num_splits, mgpu.default_min_blocks_per_split)
    with decode_step._attention_experiment("kernel", "8:3", "auto"):
        assert mgpu.mosaic_num_splits(1, 16, 512) == 8 and mgpu.mosaic_num_splits(1, 16, 4) == 4
        assert mgpu.default_min_blocks_per_split(1, 16, 512) == 3
    assert (mgpu.mosaic_num_splits, mgpu.default_min_blocks_per_split) == rules
    with pytest.raises(ValueError, match="--attn-splits"):
        decode_step._attention_experiment("kernel", "8:x", "auto")


def test_decode_step_times_the_sampler_the_engine_picks(tmp_path):
    """Greedy rows run the greedy executable (as Runner.dispatch picks it), --sampled-case's
    drawing rows the full sampler's."""
    out = tmp_path / "decode.json"
    rc = decode_step.main(["--smoke", "--preset", "ouro-tiny", "--rows", "2", "--iters", "1",
                           "--per-loop-rows", "", "--sampled-case", "--out", str(out)])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["variant"], r["sampler"]) for r in records] == [("fused", "greedy"), ("fused_top_p", "full")]


class FakeAxes:
    def __init__(self):
        self.lines = []

    def plot(self, x, y, fmt=None, label=None):
        self.lines.append((label, list(x), list(y)))

    def __getattr__(self, name):  # set, set_xscale, legend, grid, ...: nothing to check
        return lambda *a, **k: None


def test_steps_plot_draws_one_line_per_variant(monkeypatch, tmp_path):
    """--plot with several backends (or matmul, page widths, ...) joined every variant's rows of
    a (preset, context) into one zigzag line: rows 1, 1, 8, 8 alternating between the variants."""
    from loopjax.bench import report as rep

    axes = [FakeAxes(), FakeAxes()]
    fig = types.SimpleNamespace(tight_layout=lambda: None, savefig=lambda *a, **k: None)
    plt = types.SimpleNamespace(subplots=lambda *a, **k: (fig, axes), close=lambda f: None)
    monkeypatch.setattr(rep, "_pyplot", lambda: plt)
    records = [dict(preset="p", context=512, page_width=512, backend=b, matmul="xla", variant="fused", rows=r,
                    pipelined_us=us, pipelined_roofline_pct=pct)
               for b, r, us, pct in (("xla", 1, 1000.0, 10.0), ("pallas", 1, 500.0, 20.0),
                                     ("xla", 8, 2000.0, 30.0), ("pallas", 8, 1000.0, 60.0))]
    rep.write_steps_plot(records, str(tmp_path / "steps.png"))
    tput, roof = ({label: (x, y) for label, x, y in ax.lines} for ax in axes)
    assert tput == {"p, context 512, backend xla": ([1, 8], [1000.0, 4000.0]),
                    "p, context 512, backend pallas": ([1, 8], [2000.0, 8000.0])}
    assert roof == {"p, context 512, backend xla": ([1, 8], [10.0, 30.0]),
                    "p, context 512, backend pallas": ([1, 8], [20.0, 60.0])}
