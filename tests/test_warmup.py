"""Start-up cost guards, no accelerator and no XLA compile: the default engine's warm-up builds
no more executables than its row buckets (1, then 8 and up) give (counted, not compiled), and a decode
step lowered for CUDA (abstract weights, an abstract H200) holds one Mosaic GPU kernel per
distinct KV shape, however many layers call it (a kernel per call site made XLA compile the
same kernel once per layer at start-up), a prefill step one Triton attention call per KV
shape, a 1-row decode step one Triton kernel per distinct weight-streaming product; the probe
in both modes end to end."""

from __future__ import annotations

import json

import pytest

from loopjax import config as config_lib
from loopjax.bench import warmup_probe
from loopjax.engine import EngineConfig

# Warm-up executables of EngineConfig() (max_num_rows 32): decode rows 1, 8, 16, 32, each with the
# full and the greedy sampler (StepKind.greedy: all-greedy steps skip the sort and the noise),
# and the eight prefill token buckets up to max_prefill_tokens 2048. Raise only on purpose: each
# one is another compile at every start (run 10: 35-52 s of compile each with the Mosaic decode).
DEFAULT_EXECUTABLES = 16


@pytest.mark.parametrize("preset", ["ouro-1.4b", "huginn-0125"])
def test_default_warmup_executable_count(preset):
    engine = warmup_probe.abstract_engine(config_lib.preset(preset), EngineConfig(verbose=False))
    steps = engine.runner.warmup_steps(**engine.warmup_options)
    decode_rows = sorted({b.page_table.shape[0] for b, _ in steps if b.decode})
    # 2-7 rows run padded to 8; a single request streams the weights at 1 row
    assert decode_rows == [1, 8, 16, 32]
    assert len(steps) <= DEFAULT_EXECUTABLES, f"{len(steps)} warm-up executables by default"


SMALL = dict(max_num_rows=8, decode_row_buckets=(8,), max_prefill_tokens=16,
             prefill_token_buckets=(16,), max_context_len=256, num_pages=64, verbose=False)


@pytest.mark.parametrize("backend", ["pallas_mgpu", "pallas"])
@pytest.mark.parametrize("preset, kernels", [("ouro-1.4b", 1),  # 24 layers, one KV shape
                                             ("huginn-0125", 2)])  # 1-plane prelude/coda, 32-plane core
def test_steps_share_one_attention_kernel_per_kv_shape(preset, kernels, backend):
    """Decode: the Mosaic GPU or the Triton decode kernel; prefill: the Triton flash kernel.
    Each Mosaic kernel is lowered once (Ouro-1.4B's 8-row products run on Mosaic kernels too:
    matmul_ops.MOSAIC_ROWS)."""
    config = EngineConfig(**SMALL, attention_backend=backend)
    with warmup_probe.cuda_target():
        engine = warmup_probe.abstract_engine(config_lib.preset(preset), config)
        records = warmup_probe.lower_warmup(engine)
    decode = [r for r in records if r["label"].startswith("decode")]
    label = f"decode rows=8 width=16 loops={engine.max_loops}"
    assert [r["label"] for r in decode] == [label, f"{label} greedy"]  # the two samplers
    mosaic = kernels if backend == "pallas_mgpu" else 0
    for step in decode:
        assert step["mosaic_calls"] == step["mosaic_kernels"] == sum(step["mosaic_names"].values())
        assert step["mosaic_names"].get("loopjax_paged_decode_write", 0) == mosaic
        assert step["triton_calls"].get("loopjax_paged_decode", 0) == kernels - mosaic
    prefill = [r for r in records if r not in decode]
    # a 16-token prefill streams its products (on Mosaic kernels where MOSAIC_ROWS says), but
    # attends with the Triton flash kernel
    assert len(prefill) == 1 and not any("paged" in k for k in prefill[0]["mosaic_names"])
    assert prefill[0]["triton_calls"]["loopjax_paged_prefill"] == kernels


# Ouro-1.4B's distinct weight-streaming products at 1 row, by kernel name: both matmuls stream
# lm_head as a plain product (none), w_gate_up with SiLU*up in the epilogue (silu), wo and
# w_down into their split-K partials for the norm_add_norm kernel (partials) on the Triton
# kernel, and wqkv with the RoPE in its epilogue on the Mosaic one (matmul_ops.MOSAIC_ROWS);
# 'streaming' streams the same products ('auto' is every product below 8 rows).
STREAMING_KERNELS = {
    "loopjax_streaming_matmul_none": 1, "loopjax_streaming_matmul_silu": 1,
    "loopjax_streaming_matmul_partials": 2,
}
MOSAIC_STREAMING_KERNELS = {"loopjax_streaming_matmul_rope_mgpu": 1}
# A kernel function's call whose outputs are partly unused is lowered as a pruned copy (JAX
# drops the unused results): the last layer's norm_add_norm, whose residual sum no one reads.
PRUNED_COPIES = {"loopjax_norm_add_norm": 1}


@pytest.mark.parametrize("matmul", ["auto", "streaming"])
def test_decode_step_lowers_each_streaming_kernel_once(matmul):
    """A 1-row decode step calls the weight-streaming matmul 97 times (4 products x 24 layers
    and the head) and the fused norms 48 times, but lowers each distinct kernel configuration
    once: every call site of one configuration calls the same lowered function (a kernel per
    call site made the lowering 2.5 s)."""
    config = EngineConfig(**{**SMALL, "decode_row_buckets": (1,)}, matmul=matmul)
    with warmup_probe.cuda_target():
        engine = warmup_probe.abstract_engine(config_lib.preset("ouro-1.4b"), config)
        records = warmup_probe.lower_warmup(engine)
    for record in records:  # every step: as many Triton calls as distinct Triton kernels
        kernels = record["triton_kernels"]
        want = {k: v + PRUNED_COPIES.get(k, 0) for k, v in kernels.items()}
        assert record["triton_calls"] == want, record["label"]
    [decode] = [r for r in records if r["label"] == "decode rows=1 width=16 loops=4"]
    streaming = {k: v for k, v in decode["triton_calls"].items() if "streaming_matmul" in k}
    assert streaming == STREAMING_KERNELS
    mosaic = {k: v for k, v in decode["mosaic_names"].items() if "streaming_matmul" in k}
    assert mosaic == MOSAIC_STREAMING_KERNELS
    # one norm_add_norm lowering per distinct partials shape: wo's and w_down's K splits (TUNED)
    from loopjax.kernels import streaming_matmul as sm
    splits = {sm.pick_config(1, k, 2048).split_k for k in (2048, 5632)}
    assert decode["triton_kernels"]["loopjax_norm_add_norm"] == len(splits)


def test_huginn_decode_fuses_its_sandwich_norms():
    """With matmul 'streaming', Huginn-0125's decode steps run each branch's closing norm with
    the next branch's input norm in the add_norm_norm kernel on the product's split-K partials
    (wo, and w_down where a layer follows), lowered once per partials shape; the last coda
    layer's call, whose residual sum no one reads (only ln_f of it), is a pruned copy. ('auto'
    keeps these norms in XLA: the kernel did not win on the H200.)"""
    config = EngineConfig(**{**SMALL, "decode_row_buckets": (1, 8)}, matmul="streaming")
    with warmup_probe.cuda_target():
        engine = warmup_probe.abstract_engine(config_lib.preset("huginn-0125"), config)
        records = warmup_probe.lower_warmup(engine)
    for record in [r for r in records if r["label"].startswith("decode")]:
        calls, kernels = record["triton_calls"], record["triton_kernels"]
        assert kernels["loopjax_add_norm_norm"] == 2, record["label"]  # wo's and w_down's splits
        assert calls["loopjax_add_norm_norm"] == kernels["loopjax_add_norm_norm"] + 1, record["label"]
        assert "loopjax_norm_add_norm" not in calls


def test_probe_lower_only_prints_each_executable(tmp_path, capsys):
    out = tmp_path / "probe.json"
    # one prefill bucket: the decode buckets are what the settings change
    assert warmup_probe.main(["ouro-tiny", "--lower-only", "--max-num-rows", "8",
                              "--max-context-len", "64", "--engine-arg", "max_prefill_tokens=16",
                              "--engine-arg", "prefill_token_buckets=[16]", "--out", str(out)]) == 0
    results = {r["setting"]: r for r in json.loads(out.read_text())["results"]}
    labels = {s: [e["label"] for e in r["executables"]] for s, r in results.items()}
    decode = lambda s: [x for x in labels[s] if x.startswith("decode")]  # noqa: E731
    both = lambda *rows: [f"decode rows={r} width=4 loops=4{sampler}"  # noqa: E731
                          for r in rows for sampler in ("", " greedy")]  # the two samplers each
    assert decode("default") == both(1, 8)  # 2-7 pad to 8
    assert decode("old-buckets") == both(1, 2, 4, 8)
    assert len(labels["default"]) == len(labels["old-buckets"]) - 4  # the same prefill buckets
    assert all(e["lower_s"] > 0 for r in results.values() for e in r["executables"])
    text = capsys.readouterr().out
    assert "default: 5 executables" in text and "old-buckets: 9 executables" in text  # + 1 prefill
    assert "(1 mgpu)" in text


def test_probe_device_path_runs_on_cpu():
    """The path the H200 runs (build the engine, time its warm-up, one request), in-process on
    the CPU at tiny shapes: every executable listed, the request decoded without a compile."""
    args = warmup_probe.PARSER.parse_args([
        "ouro-tiny", "--max-num-rows", "8", "--max-context-len", "64", "--prompt-len", "8",
        "--decode-tokens", "5", "--engine-arg", "max_prefill_tokens=16",
        "--engine-arg", "prefill_token_buckets=[16]"])
    result = warmup_probe.run_on_device("default", args)
    assert [e["label"] for e in result["executables"]] == [  # in runner.compile_order
        "prefill rows=4 tokens=16 width=4 loops=4",
        "decode rows=8 width=4 loops=4", "decode rows=8 width=4 loops=4 greedy",
        "decode rows=1 width=4 loops=4", "decode rows=1 width=4 loops=4 greedy"]
    assert all(e["lower_s"] > 0 and e["compile_s"] > 0 for e in result["executables"])
    assert result["warmup_s"] > 0 and result["decode_rows"] == [1, 8]
    assert result["compiles_in_request"] == 0 and result["one_request_tpot_ms"] > 0
    assert "default: 5 executables" in warmup_probe.table([result])
