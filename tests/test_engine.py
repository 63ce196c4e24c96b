"""Engine end to end on the golden tiny models (fp32): greedy identity with the references,
fused == per-loop decode, batch-composition independence, padding rows, page accounting,
compile guard, bad inputs. One engine per module fixture; every engine is strict (any
compilation after warm-up raises)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from engine_helpers import greedy, run_all
from safetensors.numpy import load_file

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

OURO = "tests/data/ouro"
HUGINN = "tests/data/huginn/huginn_shape_242"
PROMPTS = ("p0", "p1", "p2")

SMALL = dict(page_size=8, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
             prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64,
             max_logprobs=2, strict_compile=True, verbose=False)


@pytest.fixture(scope="module")
def ouro_model():
    return loopjax.load(OURO)


@pytest.fixture(scope="module")
def ouro_ref():
    return np.load(f"{OURO}/reference_fp32.npz")


@pytest.fixture(scope="module")
def ouro_engine(ouro_model):
    return Engine(ouro_model, EngineConfig(**SMALL))


def test_ouro_greedy_equals_golden_with_staggered_arrivals(ouro_engine, ouro_ref):
    compiled = ouro_engine.stats()["compilations"]
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    # p0 alone first, p1 joins mid-decode, p2 later still: mixed prompt lengths and arrival times.
    finals = run_all(ouro_engine, {0: [(ids[0], greedy(24), "p0")], 3: [(ids[1], greedy(24), "p1")],
                                   7: [(ids[2], greedy(24), "p2")]})
    for k in PROMPTS:
        out = finals[k]
        assert out.token_ids == ouro_ref[f"{k}_greedy_tokens"].tolist(), k
        assert out.exit_loops == [s + 1 for s in ouro_ref[f"{k}_greedy_exit_steps"].tolist()]
        assert out.finish_reason == "length"
        assert out.metrics["decode_submissions_per_token"] == 1.0
    stats = ouro_engine.stats()
    assert stats["compilations"] == compiled, "something compiled in steady state"
    assert stats["pages_free"] == stats["pages_total"]
    assert stats["mean_loops_per_token"] == 4.0


def test_sampled_tokens_independent_of_batch_composition(ouro_engine, ouro_ref):
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    params = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    alone = run_all(ouro_engine, {0: [(ids[1], params, "a")]})["a"].token_ids
    mixed = run_all(ouro_engine, {0: [(ids[0], greedy(12), "x")], 2: [(ids[1], params, "b")],
                                  3: [(ids[2], greedy(5), "y")]})["b"].token_ids
    assert alone == mixed
    other_seed = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=99, ignore_eos=True)
    assert run_all(ouro_engine, {0: [(ids[1], other_seed, "c")]})["c"].token_ids != alone


def test_padding_rows_write_no_page(ouro_engine, ouro_ref):
    """A decode step of 1 real row in a bucket of 4 changes only that row's new slot."""
    prompt = ouro_ref["p1_input_ids"].tolist()
    ouro_engine.add_request(prompt, greedy(3), "pad")
    ouro_engine.step()  # prefill
    request = ouro_engine.scheduler.get("pad")
    before = jax.device_get(ouro_engine.runner.state.kv)
    ouro_engine.step()  # dispatches one decode (pipelined: of the position after len(prompt))
    after = jax.device_get(ouro_engine.runner.state.kv)
    size = ouro_engine.layout.page_size
    pos = request.num_computed_tokens - 1  # the input position of the last dispatched step
    slot = request.page_ids[pos // size] * size + pos % size
    for b, a in zip(before.k + before.v, after.k + after.v):
        flat_b = b.reshape(b.shape[0], b.shape[1], -1, b.shape[-1])
        flat_a = a.reshape(flat_b.shape)
        changed = np.nonzero(np.any(flat_b != flat_a, axis=(0, 1, 3)))[0]
        assert changed.tolist() == [slot]
    run_all(ouro_engine)


def sat_params(model):
    """Model A-sat (tests/data/ouro/README.md §5): gate bias 8, so fp32 tokens exit at loop
    2 or 3 under the config threshold 1.0. Params are an argument of the jitted step, so an
    engine runs them without recompiling."""
    import jax.numpy as jnp
    return {**model.params, "gate_b": jnp.asarray([8.0], model.params["gate_b"].dtype)}


def run_sat(engine, model):
    sat = np.load(f"{OURO}/reference_sat_fp32.npz")
    saved, engine.runner.params = engine.runner.params, sat_params(model)
    try:
        ids = [sat[f"{k}_input_ids"].tolist() for k in PROMPTS]
        finals = run_all(engine, {0: [(ids[0], greedy(12), "p0")], 1: [(ids[1], greedy(12), "p1")],
                                  4: [(ids[2], greedy(12), "p2")]})
    finally:
        engine.runner.params = saved
    for k in PROMPTS:
        assert finals[k].token_ids == sat[f"{k}_greedy_tokens"].tolist(), k
        assert finals[k].exit_loops == [s + 1 for s in sat[f"{k}_greedy_exit_steps"].tolist()], k
    return finals


def test_ouro_exit_rule_selects_inside_the_fused_loop(ouro_engine, ouro_model):
    finals = run_sat(ouro_engine, ouro_model)
    assert {2, 3} <= {loop for out in finals.values() for loop in out.exit_loops}
    assert all(out.metrics["decode_submissions_per_token"] == 1.0 for out in finals.values())


def test_per_loop_decode_equals_fused(ouro_model, ouro_ref):
    """One submission per loop (state kept on device between them) gives the fused tokens
    and exit loops, for fixed exits (Model A) and rule-selected exits (Model A-sat)."""
    engine = Engine(ouro_model, EngineConfig(**SMALL, fused_decode=False))
    compiled = engine.stats()["compilations"]
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    finals = run_all(engine, {0: [(ids[0], greedy(12), "p0")], 2: [(ids[1], greedy(12), "p1")],
                              3: [(ids[2], greedy(12), "p2")]})
    for k in PROMPTS:
        assert finals[k].token_ids == ouro_ref[f"{k}_greedy_tokens"][:12].tolist()
        assert finals[k].exit_loops == [4] * 12
        assert finals[k].metrics["decode_submissions_per_token"] == 4.0
    run_sat(engine, ouro_model)
    assert engine.stats()["compilations"] == compiled
    with pytest.raises(ValueError, match="fused_decode"):  # adaptive exits run fused on device
        engine.add_request(ids[0], greedy(4, exit_mode="skip"))


def test_pages_return_after_finish_abort_and_preemption(ouro_model, ouro_ref):
    """A pool of 8 pages (64 tokens) cannot hold three 41-token requests: preemption by
    recompute must keep every token equal to the golden and leak no page."""
    engine = Engine(ouro_model, EngineConfig(**{**SMALL, "num_pages": 8, "max_context_len": 48,
                                                "decode_context_buckets": (16,)}))
    assert engine.runner.buckets.page_widths == (2, 6)  # decode steps also run a narrower page table
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    for k, prompt in zip(PROMPTS, ids):
        engine.add_request(prompt, greedy(24), k)
    engine.add_request(ids[0], greedy(24), "doomed")
    finals = {}
    for step in range(400):
        if step == 5:
            assert engine.abort("doomed")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert finals["doomed"].finish_reason == "abort"
    for k in PROMPTS:
        assert finals[k].token_ids == ouro_ref[f"{k}_greedy_tokens"].tolist(), k
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert stats["pages_free"] == stats["pages_total"] == 8
    engine.scheduler.block_manager.check([])
    assert not engine.abort("doomed")


@pytest.mark.parametrize("options, message", [
    (dict(page_size="16"), "EngineConfig.page_size must be int, got '16'"),
    (dict(max_num_rows=0), "EngineConfig.max_num_rows must be >= 1, got 0"),
    (dict(num_pages=True), "EngineConfig.num_pages must be int | None, got True"),
    (dict(fused_decode=1), "EngineConfig.fused_decode must be bool, got 1"),
    (dict(decode_row_buckets=[4, "8"]), r"EngineConfig.decode_row_buckets must be tuple\[int, ...\] | None"),
    # every request would be refused, naming an initial_state it did not send
    (dict(huginn_init="random"), "EngineConfig.huginn_init must be 'seeded' or 'zero', got 'random'"),
    # were a warm-up error naming no option ("loops [0, 0) outside 0..4"; a negative array dimension)
    (dict(loop_buckets=(2, 0)), r"EngineConfig.loop_buckets entries must be >= 1, got \(2, 0\)"),
    (dict(decode_context_buckets=(-8,)),
     r"EngineConfig.decode_context_buckets entries must be >= 1, got \(-8,\)"),
    # () compiled the default row buckets, resp. failed naming SchedulerConfig
    (dict(decode_row_buckets=()), r"EngineConfig.decode_row_buckets must list at least one count, got \(\)$"),
    (dict(prefill_token_buckets=[]), r"EngineConfig.prefill_token_buckets must list at least one count"),
    # num_pages sized the pool, kv_memory_bytes was ignored
    (dict(num_pages=8, kv_memory_bytes=2**20), "EngineConfig.num_pages and kv_memory_bytes both size the "
                                               "KV pool; give one$"),
])
def test_engine_options_are_checked_when_made(options, message):
    """A wrong type or a count below 1 is one line naming the field when the config is made
    (`--engine-arg page_size=x` was a TypeError deep in the build; max_num_rows=0 a misleading
    pool message); a list of ints is taken as its tuple."""
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig(**options)


def test_engine_options_the_family_ignores_are_refused(ouro_model, huginn):
    """An option off its default that the model's family (or layout) would ignore is one line
    naming it, before the engine builds anything: it ran without effect (Huginn compiled the
    weighted-exit steps for nothing; an Ouro engine took a Huginn seed it never uses)."""
    for model, options in [(huginn[0], dict(enable_weighted_exit=True)), (ouro_model, dict(huginn_seed=3)),
                           (ouro_model, dict(huginn_init="zero")),
                           (ouro_model, dict(kv_layout="shared", shared_kv_slots=16)),
                           (huginn[0], dict(shared_kv_slots=16))]:  # per_loop: no ring
        name = next(iter(options.keys() - {"kv_layout"}))
        with pytest.raises(ValueError, match=rf"^EngineConfig.{name}=\S+ applies to [^\n]+; this (is an? "
                                             rf"{model.cfg.family.capitalize()} model|Huginn model has "
                                             rf"kv_layout='\w+')$"):
            Engine(model, EngineConfig(**options, warmup=False))
    Engine(huginn[0], EngineConfig(kv_layout="shared", shared_kv_slots=16, huginn_seed=3, warmup=False,
                                   num_pages=8, verbose=False))
    assert EngineConfig(decode_row_buckets=[4, 8]).decode_row_buckets == (4, 8)


def test_skip_mode_on_huginn_needs_an_exit_criterion(huginn):
    """exit_mode='skip' on Huginn without an exit_criterion (or exit_trace) ran every loop, as
    'select' does, on the adaptive path: the engine (so the LLM, the server and the CLI too)
    refuses it in one line; with a criterion or a trace it is accepted."""
    engine = Engine(huginn[0], EngineConfig(warmup=False, verbose=False, num_pages=8))
    with pytest.raises(ValueError, match=r"^exit_mode='skip' on a Huginn model stops at its exit_criterion; "
                                         r"give one \(or an exit_trace\)$"):
        engine.add_request([1, 2], greedy(2, exit_mode="skip"))
    assert not engine.has_unfinished()
    for ok in (dict(exit_criterion="kl"), dict(exit_trace=(2,))):
        engine.add_request([1, 2], greedy(2, exit_mode="skip", loops=4, **ok))


def test_a_pool_smaller_than_one_context_is_refused_at_start(ouro_model):
    """vLLM's start-up check: a pool that cannot hold one max_context_len context is one line
    naming both and the ways out (it cut every request at the pool's size, finish "length")."""
    small = dict(page_size=16, max_context_len=64, warmup=False, verbose=False)
    with pytest.raises(ValueError, match=r"^max_context_len 64 is larger than the KV pool holds \(3 pages x "
                                         r"16 tokens = 48 tokens\): give a larger kv_memory_bytes \(or "
                                         r"num_pages\), or a smaller max_context_len$"):
        Engine(ouro_model, EngineConfig(num_pages=3, **small))
    assert Engine(ouro_model, EngineConfig(num_pages=4, **small)).scheduler.config.max_seq_len == 64


def test_bad_inputs_are_refused_and_others_served(ouro_engine, ouro_ref):
    ok = ouro_ref["p0_input_ids"].tolist()
    ouro_engine.add_request(ok, greedy(24), "good")
    bad = [
        (list(range(1, 70)), greedy(4)),      # longer than the context
        ([], greedy(4)),                       # empty
        ([1, 2, 300], greedy(4)),              # outside the vocabulary
        ([1.5, 2.0], greedy(4)),               # not token ids
        ("hello", greedy(4)),                  # a string, not ids
        (ok, {"temperature": 0.5}),            # not a SamplingParams
        (ok, greedy(4, logprobs=3)),           # more logprobs than the engine serves
        (ok, greedy(4, loops=9)),              # deeper than the engine
        (ok, greedy(4, exit_criterion="kl")),  # adaptive exit: not yet
        (ok, greedy(4, stop=("x",))),          # stop strings without a tokenizer
        (ok, greedy(4, n=2)),                  # n samples: the caller submits fan_out()
    ]
    for prompt, params in bad:
        with pytest.raises(ValueError) as info:
            ouro_engine.add_request(prompt, params)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="already in use"):
        ouro_engine.add_request(ok, greedy(4), "good")
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    assert ouro_engine.stats()["queue_len"] + ouro_engine.stats()["running_rows"] == 1
    finals = run_all(ouro_engine)
    assert finals["good"].token_ids == ouro_ref["p0_greedy_tokens"].tolist()


def test_strict_engine_refuses_adaptive_requests_it_did_not_compile(ouro_engine, ouro_ref):
    """A strict engine without adaptive_exit refuses an adaptive request when it is added: it
    used to be queued, and the first step with its row raised CompileAfterWarmup, aborting every
    request of that step (batch-mates too)."""
    ok = ouro_ref["p0_input_ids"].tolist()
    ouro_engine.add_request(ok, greedy(24), "mate")
    for params in (greedy(4, exit_mode="skip", exit_threshold=0.5), greedy(4, exit_trace=(2, 3))):
        with pytest.raises(ValueError, match=r"^exit_mode='skip', exit_trace and exit_criterion run in "
                                             r"adaptive steps; this strict engine compiled none "
                                             r"\(adaptive_exit=False\)$"):
            ouro_engine.add_request(ok, params)
    finals = run_all(ouro_engine)
    assert finals["mate"].token_ids == ouro_ref["p0_greedy_tokens"].tolist()


def test_max_logprobs_out_of_range_is_a_clear_error(ouro_model):
    with pytest.raises(ValueError, match=r"^max_logprobs must be in \[0, 20\], got 21$"):
        Engine(ouro_model, EngineConfig(**{**SMALL, "max_logprobs": 21}))


def test_loop_buckets_deeper_than_max_loops_are_a_clear_error(ouro_model):
    with pytest.raises(ValueError, match=r"^EngineConfig.loop_buckets entry 8 exceeds max_loops=4$"):
        Engine(ouro_model, EngineConfig(**{**SMALL, "loop_buckets": (2, 8), "warmup": False}))
    # a context bucket past the context compiled nothing, silently (the runner drops it)
    with pytest.raises(ValueError, match=r"^EngineConfig.decode_context_buckets entry 80 exceeds "
                                         r"max_context_len=64$"):
        Engine(ouro_model, EngineConfig(**{**SMALL, "decode_context_buckets": (16, 80), "warmup": False}))


def test_pool_too_small_is_a_clear_error(ouro_model):
    with pytest.raises(ValueError, match="too small"):
        Engine(ouro_model, EngineConfig(**{**SMALL, "num_pages": None, "kv_memory_bytes": 100}))


def test_default_pool_holds_every_row_at_full_context(ouro_model):
    """Without a size, the pool holds max_num_rows full contexts, each in whole pages (a
    context of 60 tokens takes 8 pages of 8, not 7.5)."""
    config = EngineConfig(**{**SMALL, "max_context_len": 60, "warmup": False})
    assert Engine(ouro_model, config).layout.num_pages == config.max_num_rows * 8


def test_default_pool_holds_one_context_past_its_byte_cap(ouro_model, monkeypatch):
    """The default size's byte cap (kv_cache.DEFAULT_KV_BYTES: 16 GiB) never leaves less than one
    context: such a pool is refused at start (Huginn-0125 at 64 loops needs 22 GiB for one)."""
    from loopjax import kv_cache

    config = EngineConfig(**{**SMALL, "max_context_len": 60, "warmup": False})
    page_bytes = 8 * Engine(ouro_model, config).layout.bytes_per_token
    monkeypatch.setattr(kv_cache, "DEFAULT_KV_BYTES", 3 * page_bytes)
    assert Engine(ouro_model, config).layout.num_pages == 8  # 60 tokens in pages of 8
    monkeypatch.setattr(kv_cache, "DEFAULT_KV_BYTES", 16 * page_bytes)
    assert Engine(ouro_model, config).layout.num_pages == 16


def test_default_row_buckets_follow_the_context_limit(ouro_model, monkeypatch):
    """Unconfigured, an engine whose requests may pass LONG_CONTEXT_KEYS (4,096; 256 here, the
    tiny model's context being 512) compiles a 4-row decode bucket
    (step_plan.default_decode_row_buckets); one that may not pads 2-7 rows to 8."""
    from loopjax import step_plan

    monkeypatch.setattr(step_plan, "LONG_CONTEXT_KEYS", 256)
    buckets = {}
    for context in (256, 512):
        config = EngineConfig(**{**SMALL, "decode_row_buckets": None, "max_num_rows": 16, "num_pages": 64,
                                 "max_context_len": context, "warmup": False})
        buckets[context] = Engine(ouro_model, config).scheduler.config.row_buckets
    assert buckets == {256: (1, 8, 16), 512: (1, 4, 8, 16)}


def test_min_tokens_holds_back_stop_tokens(ouro_engine, ouro_ref):
    """A stop token the greedy output reaches at index 2 ends it there; with min_tokens=6 the
    first 6 tokens cannot be it (the first two are the golden's), then it may end the output.
    More stop ids than the sampler can suppress are refused at once, in one line."""
    prompt, golden = ouro_ref["p0_input_ids"].tolist(), ouro_ref["p0_greedy_tokens"].tolist()
    stop = golden[2]
    assert stop not in golden[:2]
    ouro_engine.add_request(prompt, greedy(12, stop_token_ids=(stop,)), "plain")
    ouro_engine.add_request(prompt, greedy(12, stop_token_ids=(stop,), min_tokens=6), "held")
    finals = run_all(ouro_engine)
    assert finals["plain"].token_ids == golden[:3] and finals["plain"].finish_reason == "stop"
    held = finals["held"].token_ids
    assert held[:2] == golden[:2] and len(held) >= 6 and stop not in held[:6]
    assert finals["held"].finish_reason == ("stop" if held[-1] == stop else "length")
    with pytest.raises(ValueError, match="at most 64 stop token ids") as info:
        ouro_engine.add_request(prompt, greedy(4, stop_token_ids=tuple(range(65)), min_tokens=2))
    assert "\n" not in str(info.value)
    # the model's EOS (2) named by the request too counts once: 64 ids, not 65
    full = SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=tuple(range(64)), min_tokens=2)
    assert ouro_engine.abort(ouro_engine.add_request(prompt, full))
    run_all(ouro_engine)


def test_generation_config_eos_ids_stop_too(ouro_model, ouro_ref):
    """generation_config.json's eos_token_id ends an output as config.json's does (HF generate
    stops there; Ouro's Hub config.json names 0, chat ends at 2), unless ignore_eos; a bad
    one is a one-line error when the engine is built."""
    import dataclasses

    from loopjax.config import ConfigError, eos_token_ids

    prompt, golden = ouro_ref["p0_input_ids"].tolist(), ouro_ref["p0_greedy_tokens"].tolist()
    stop = golden[2]
    assert stop not in golden[:2] and stop not in eos_token_ids(ouro_model.cfg)
    model = dataclasses.replace(ouro_model, generation_config={"eos_token_id": [stop]})
    engine = Engine(model, EngineConfig(**SMALL))
    finals = run_all(engine, {0: [(prompt, SamplingParams(max_tokens=8, temperature=0.0), "eos"),
                                  (prompt, greedy(8), "ignored")]})
    assert finals["eos"].token_ids == golden[:3] and finals["eos"].finish_reason == "stop"
    assert finals["ignored"].token_ids == golden[:8] and finals["ignored"].finish_reason == "length"
    bad = dataclasses.replace(ouro_model, generation_config={"eos_token_id": "2"})
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be a token id"):
        Engine(bad, EngineConfig(**SMALL))


def test_earlier_outputs_keep_what_they_reported(ouro_engine, ouro_ref):
    """Each step's RequestOutput reports the tokens so far without copying them (Snapshots of
    the request's lists): later steps must not change what an earlier output holds."""
    ouro_engine.add_request(ouro_ref["p0_input_ids"].tolist(), greedy(6, logprobs=0), "snap")
    outs = []
    while ouro_engine.has_unfinished():
        outs += ouro_engine.step()
    final = outs[-1]
    assert final.finished and final.token_ids == ouro_ref["p0_greedy_tokens"].tolist()[:6]
    assert [len(o.token_ids) for o in outs] == list(range(1, 7))
    for o in outs:
        n = len(o.token_ids)
        assert o.token_ids == final.token_ids[:n] and o.new_token_ids == final.token_ids[n - 1:n]
        assert (len(o.exit_loops), len(o.logprobs), len(o.top_logprobs), len(o.ranks)) == (n, n, n, n)
        assert o.logprobs == final.logprobs[:n] and o.ranks == final.ranks[:n]
    assert final.ranks == [1] * 6  # vLLM's Logprob.rank: each greedy token is its step's only argmax


def test_greedy_request_with_top_logprobs_runs_the_full_sampler(ouro_engine, ouro_ref):
    """Top logprobs leave the greedy executable (it computes none): the full sampler's decode
    steps give the same greedy tokens, each token first among its top logprobs."""
    decode_kinds = []
    submit = ouro_engine.runner.submit
    ouro_engine.runner.submit = lambda batch, kind: decode_kinds.append(kind.greedy) or submit(batch, kind)
    try:
        ouro_engine.add_request(ouro_ref["p0_input_ids"].tolist(), greedy(5, logprobs=2), "top")
        final = run_all(ouro_engine)["top"]
    finally:
        ouro_engine.runner.submit = submit
    assert final.token_ids == ouro_ref["p0_greedy_tokens"].tolist()[:5]
    assert decode_kinds and not any(decode_kinds)
    for token, logprob, top in zip(final.token_ids, final.logprobs, final.top_logprobs):
        assert len(top) == 2 and top[0] == (token, logprob) and top[1][1] <= logprob < 0


# ------------------------------------------------------------------------------ Huginn

@pytest.fixture(scope="module")
def huginn():
    model = loopjax.load(HUGINN)
    gen = load_file(f"{HUGINN}/generate.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    return model, gen, prompt


@pytest.mark.parametrize("layout, key", [("per_loop", "gen_tokens"), ("per_loop", "gen_latest_m4_tokens"),
                                         ("shared", "gen_compress_s8_tokens")])
def test_huginn_greedy_equals_golden(huginn, layout, key):
    model, gen, prompt = huginn
    engine = _huginn_engine(model, layout)
    states = gen["gen_init_states"][0]
    rid = engine.add_request(prompt, greedy(8), initial_state=states)
    out = run_all(engine)[rid]
    assert out.token_ids == gen[key][0].tolist()
    assert out.exit_loops == [8] * 8
    assert out.metrics["decode_submissions_per_token"] == 1.0


def test_huginn_zero_and_seeded_states(huginn):
    from loopjax.models import huginn as hm
    model, gen, prompt = huginn
    engine = _huginn_engine(model, "per_loop")
    zero = engine.add_request(prompt, greedy(8), initial_state="zero")
    seeded = engine.add_request(prompt[:7], greedy(6))
    finals = run_all(engine)
    assert finals[zero].token_ids == gen["gen_zero_state_tokens"][0].tolist()
    expected, _, _ = hm.generate_greedy_recompute(model.params, model.cfg, prompt[:7], 6, seed=0)
    assert finals[seeded].token_ids == np.asarray(expected).tolist()
    with pytest.raises(ValueError, match="initial_state"):
        engine.add_request(prompt, greedy(8), initial_state=np.zeros((3, 64)))


_HUGINN_ENGINES: dict = {}


def _huginn_engine(model, layout):
    if layout not in _HUGINN_ENGINES:
        _HUGINN_ENGINES[layout] = Engine(model, EngineConfig(**SMALL, kv_layout=layout,
                                                             shared_kv_slots=8))
    return _HUGINN_ENGINES[layout]


# ------------------------------------------------------------------------- generate API

@pytest.fixture(scope="module")
def ouro_llm(ouro_model):
    return loopjax.LLM(ouro_model, **SMALL)


def test_generate_and_llm_reuse(ouro_model, ouro_ref, ouro_llm):
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    outs = loopjax.generate(ouro_model, ids, max_new_tokens=24, ignore_eos=True)
    for k, out in zip(PROMPTS, outs):
        assert out.token_ids == ouro_ref[f"{k}_greedy_tokens"].tolist()
        assert out.finish_reason == "length" and out.text is None
        assert out.metrics["submissions_per_token"] == 1.0 and out.metrics["ttft"] > 0
        assert out.metrics["num_submissions"] == len(out.token_ids)  # a count (the server's usage sums them)
    llm = ouro_llm
    compiled = llm.engine.stats()["compilations"]
    for _ in range(2):
        first = llm.generate(ids[2], max_new_tokens=5, ignore_eos=True)[0]
        assert first.token_ids == ouro_ref["p2_greedy_tokens"][:5].tolist()
        assert first.logprobs is None and first.top_logprobs is None
    # the generated tokens' logprobs and top logprobs (the greedy token first among them)
    scored = llm.generate(ids[2], max_new_tokens=5, ignore_eos=True, logprobs=2)[0]
    assert scored.token_ids == first.token_ids and len(scored.logprobs) == len(scored.top_logprobs) == 5
    assert all(top[0] == (t, lp) and len(top) == 2 for t, lp, top in
               zip(scored.token_ids, scored.logprobs, scored.top_logprobs))
    # n samples per prompt: result p * n + i is prompt p's sample i, drawn with seed + i.
    sampled = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    outs = llm.generate(ids[:2], SamplingParams(n=3, seed=40, logprobs=0, **sampled))
    assert len(outs) == 6 and [o.prompt_token_ids for o in outs] == [ids[0]] * 3 + [ids[1]] * 3
    # each sampled token's rank (vLLM's): 1 for the step's argmax, more for a less likely draw
    ranks = [r for o in outs for r in o.ranks]
    assert len(ranks) == 36 and min(ranks) == 1 and max(ranks) > 1
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3
    assert llm.generate(ids[1], SamplingParams(seed=42, **sampled))[0].token_ids == outs[5].token_ids
    assert llm.engine.stats()["compilations"] == compiled


def test_max_tokens_and_its_alias_must_agree(ouro_llm):
    """max_new_tokens (HF's name) is max_tokens (vLLM's): both given and different is refused,
    not one of them silently dropped."""
    with pytest.raises(ValueError, match=r"^max_tokens \(2\) and max_new_tokens \(3\) disagree; give one$"):
        ouro_llm.generate([1, 2], max_tokens=2, max_new_tokens=3)
    assert not ouro_llm.engine.has_unfinished()
    assert len(ouro_llm.generate([1, 2], max_tokens=2, max_new_tokens=2, ignore_eos=True)[0].token_ids) == 2


def test_unseeded_params_draw_a_seed_per_request(ouro_llm, ouro_ref, monkeypatch):
    """One SamplingParams without a seed for many prompts and calls (vLLM's `generate([p] * 3,
    params)`): each request draws its own seed, so the samples differ, as vLLM's do; a given
    seed is kept, so its samples repeat."""
    from loopjax import sampling_params

    draws = iter(range(100, 200))
    monkeypatch.setattr(sampling_params.secrets, "randbits", lambda bits: next(draws))
    prompt = ouro_ref["p0_input_ids"].tolist()
    drawn = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    params = SamplingParams(**drawn)
    outs = ouro_llm.generate([prompt] * 3, params) + ouro_llm.generate(prompt, params)
    outs += ouro_llm.generate([prompt] * 2, [params, params]) + ouro_llm.generate([prompt] * 2, **drawn)
    assert len({tuple(o.token_ids) for o in outs}) == len(outs) == 8
    seeded = ouro_llm.generate([prompt] * 2, SamplingParams(seed=7, **drawn))
    assert seeded[0].token_ids == seeded[1].token_ids
    # Engine.add_request too (AsyncEngine.submit's): it reused the params' one drawn seed
    outs = run_all(ouro_llm.engine, {0: [(prompt, params, "a"), (prompt, params, "b")]})
    assert outs["a"].token_ids != outs["b"].token_ids
    with pytest.raises(ValueError, match="sampling_params must be SamplingParams, got dict"):
        ouro_llm.generate([prompt], [drawn])


def test_detokenize_false_leaves_the_text_none(ouro_llm, monkeypatch):
    """SamplingParams(detokenize=False) (vLLM's field): no text, as the engine's outputs have
    none; the default decodes the generated tokens."""
    import dataclasses

    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with_tokenizer = dataclasses.replace(ouro_llm.model, tokenizer=tokenizer)
    monkeypatch.setattr(ouro_llm, "model", with_tokenizer)
    monkeypatch.setattr(ouro_llm.engine, "model", with_tokenizer)
    greedy_params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = ouro_llm.generate(["w28 w72 w220"] * 2,
                             [greedy_params, dataclasses.replace(greedy_params, detokenize=False)])
    assert outs[0].text == "".join(f" w{t}" for t in outs[0].token_ids)  # each after a space (vLLM's)
    assert outs[1].token_ids == outs[0].token_ids and outs[1].text is None
    assert ouro_llm.generate({"prompt": "w28 w72 w220"}, greedy_params)[0].token_ids == outs[0].token_ids
    # an aborted request's text is that of the tokens it got (it was None)
    engine = ouro_llm.engine
    engine.add_request([28, 72, 220], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True), "cut")
    while not engine.step():
        pass
    assert engine.abort("cut")
    [aborted] = [o for o in engine.step() if o.request_id == "cut"]
    assert aborted.finish_reason == "abort" and aborted.token_ids
    assert aborted.text == "".join(f" w{t}" for t in aborted.token_ids)
    assert not engine.has_unfinished()


def test_chat_renders_the_template_and_generates(ouro_llm, monkeypatch):
    """LLM.chat (vLLM's): one conversation or a list, rendered by the checkpoint's template (or
    chat_template=) without the tokenizer's special tokens, then generated as `generate` would;
    text parts join; a bad message is one line naming its conversation; no template, a refusal."""
    import dataclasses

    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {f"w{i}": i for i in range(3, 256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    chatml = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>{% endif %}")
    model = dataclasses.replace(ouro_llm.model, tokenizer=tokenizer, chat_template=chatml)
    monkeypatch.setattr(ouro_llm, "model", model)
    monkeypatch.setattr(ouro_llm.engine, "model", model)
    talk = [{"role": "system", "content": "w7 w9"}, {"role": "user", "content": "w28 w72"}]
    rendered = "<|im_start|>system w7 w9<|im_end|><|im_start|>user w28 w72<|im_end|><|im_start|>"
    expected = ouro_llm.generate([tokenizer.encode(rendered, add_special_tokens=False).ids],
                                 max_new_tokens=3, ignore_eos=True)[0]
    assert expected.prompt_token_ids[:2] == [1, 0]  # <|im_start|>, then "system" (unknown)
    one = ouro_llm.chat(talk, max_new_tokens=3, ignore_eos=True)
    parts = [talk[0], {"role": "user", "content": [{"type": "text", "text": "w28"},
                                                    {"type": "text", "text": " w72"}]}]
    two = ouro_llm.chat([talk, parts], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # tuples as lists (a tuple of messages was taken for a list of conversations, each refused)
    tuples = ouro_llm.chat(tuple(talk), max_new_tokens=3, ignore_eos=True)
    tuples += ouro_llm.chat((tuple(talk), parts), max_new_tokens=3, ignore_eos=True)
    for out in (one[0], *two, *tuples):
        assert (out.prompt_token_ids, out.token_ids) == (expected.prompt_token_ids, expected.token_ids)
    closed = ouro_llm.chat(talk, max_new_tokens=1, add_generation_prompt=False)[0]
    assert closed.prompt_token_ids == expected.prompt_token_ids[:-1]
    going_on = ouro_llm.chat(talk + [{"role": "assistant", "content": "w5 w6"}], max_new_tokens=1,
                             continue_final_message=True)[0]  # the last turn left open
    assert going_on.prompt_token_ids == closed.prompt_token_ids + [1, 0, 5, 6]
    plain = ouro_llm.chat(talk, max_new_tokens=1, chat_template="{{ messages[1].content }} {{ more }}",
                          chat_template_kwargs={"more": "w9"})[0]
    assert plain.prompt_token_ids == [28, 72, 9]
    for messages, message in (
            ([talk, [{"role": None, "content": "w3"}]],
             r"^conversation 1: messages\[0\] must have a role"),
            ([{"role": "user", "content": [{"type": "image_url"}]}],
             r"^messages\[0\] has a content part of type 'image_url'; this model takes text only$"),
            ([], "^messages must be a conversation")):
        with pytest.raises(ValueError, match=message):
            ouro_llm.chat(messages, max_new_tokens=1)
    monkeypatch.setattr(ouro_llm, "model", dataclasses.replace(model, chat_template=None))
    with pytest.raises(ValueError, match="^chat needs a tokenizer and a chat template: this model has no c"):
        ouro_llm.chat(talk, max_new_tokens=1)
    with pytest.raises(ValueError, match="^conversation 0: chat needs a tokenizer"):
        ouro_llm.chat([talk], max_new_tokens=1)
    assert not ouro_llm.engine.has_unfinished()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(ouro_llm, ouro_ref):
    """vLLM's truncate_prompt_tokens: the request runs on its prompt's last k tokens (its output
    names those), in LLM.generate and the engine; a prompt past the context is served once
    cut; shorter prompts are unchanged."""
    prompt = ouro_ref["p2_input_ids"].tolist()  # 17 tokens
    cut = ouro_llm.generate(prompt[-6:], max_new_tokens=4, ignore_eos=True)[0]
    out = ouro_llm.generate([prompt, prompt[-3:]], max_new_tokens=4, ignore_eos=True,
                            truncate_prompt_tokens=6)
    assert (out[0].prompt_token_ids, out[0].token_ids) == (prompt[-6:], cut.token_ids)
    assert out[1].prompt_token_ids == prompt[-3:]
    assert out[0].token_ids != ouro_llm.generate(prompt, max_new_tokens=4, ignore_eos=True)[0].token_ids
    too_long = list(range(1, 100)) + prompt[-6:]  # past the engine's context of 64
    rid = ouro_llm.engine.add_request(too_long, greedy(4, truncate_prompt_tokens=6))
    finals = ouro_llm._drain()
    assert finals[rid].token_ids == cut.token_ids and not ouro_llm.engine.has_unfinished()


def test_use_tqdm_shows_finished_requests(ouro_llm, ouro_ref, capsys):
    """vLLM's use_tqdm: a bar of finished requests on stderr when asked, nothing otherwise; it is
    no sampling keyword (with sampling_params it was refused as one)."""
    prompt = ouro_ref["p1_input_ids"].tolist()
    params = SamplingParams(max_tokens=2, temperature=0.0, n=2)
    outs = ouro_llm.generate([prompt, prompt[:4]], params, use_tqdm=True)
    assert len(outs) == 4 and "4/4" in capsys.readouterr().err
    ouro_llm.generate(prompt, params, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_token_id_arrays_are_prompts(ouro_llm, ouro_ref):
    """Token ids as numpy arrays (a 1-D array or integer items is one prompt, a 2-D array one
    per row); a prompt that is not token ids, or too long, is a one-line ValueError naming it,
    nothing queued."""
    prompt = ouro_ref["p0_input_ids"]
    golden = ouro_ref["p0_greedy_tokens"][:3].tolist()
    for prompts, count in ((prompt, 1), (list(prompt), 1), (np.stack([prompt, prompt]), 2),
                           (jax.numpy.asarray(prompt), 1), ([jax.numpy.asarray(prompt)] * 2, 2),
                           ({"prompt_token_ids": prompt}, 1), ([{"prompt_token_ids": list(prompt)}] * 2, 2)):
        outs = ouro_llm.generate(prompts, max_new_tokens=3, ignore_eos=True)
        assert [o.token_ids for o in outs] == [golden] * count
        assert outs[0].prompt_token_ids == prompt.tolist()
    for prompts, message in (
            (None, "prompts must be a string, token ids or a list of them, got NoneType"),
            ([prompt, None], "prompt 1: prompt_token_ids must be a list of token ids, got NoneType"),
            ([prompt, [1.5]], "prompt 1: prompt_token_ids must be a flat list of integer token ids"),
            ([prompt, [5, True]], "prompt 1: prompt_token_ids must be a flat list of integer token ids"),
            ([prompt, np.array(5)], "prompt 1: prompt_token_ids must be a list of token ids, got ndarray"),
            ([[1, 2], [3], [4, 300]], r"prompt 2: token id 300 is outside the vocabulary \[0, 256\)"),
            ([prompt, {"prompt_token_ids": [1], "multi_modal_data": {}}],
             r"prompt 1: a prompt dict holds one key, 'prompt' \(text\) or 'prompt_token_ids', got "
             r"\['multi_modal_data', 'prompt_token_ids'\]"),
            ({"prompt": "a b"}, "this model has no tokenizer .*")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            ouro_llm.generate(prompts, max_new_tokens=3)
    assert not ouro_llm.engine.has_unfinished()
    # a refusal names the prompt (not a random request id)
    message = r"^request 'prompt 1 sample 0': prompt of 69 tokens leaves no room to generate within"
    with pytest.raises(ValueError, match=message):
        ouro_llm.generate([[1, 2], list(range(1, 70))], SamplingParams(max_tokens=3, n=2))
    with pytest.raises(ValueError, match="^request 'prompt 1': prompt of 69 tokens"):
        ouro_llm.generate([[1, 2], list(range(1, 70))], max_new_tokens=3)
    assert not ouro_llm.engine.has_unfinished()


@pytest.fixture
def engines_built(monkeypatch):
    """loopjax.generate's LLM replaced by one that compiles nothing: it records each engine's
    options (the list returned) and its generate returns [(model, SamplingParams)]."""
    from loopjax import llm as llm_module

    built = []

    class NoEngine:
        def __init__(self, model, **options):
            self.model = model
            built.append(options)

        def generate(self, prompts, params=None, **kwargs):
            return [(self.model, params)]

    monkeypatch.setattr(llm_module, "LLM", NoEngine)
    monkeypatch.setattr(llm_module, "_CACHE", {})
    return built


def test_generate_keeps_a_model_loaded_by_name(monkeypatch, tmp_path, engines_built):
    """loopjax.generate given a folder loads it once for later calls with it (it loaded and
    compiled anew at every call); a folder whose files change is loaded again."""
    import os
    import shutil

    from loopjax import model as model_module

    loads, real_load = [], model_module.load

    def load(path, dtype=None):
        loads.append(path)
        return real_load(path, dtype)

    monkeypatch.setattr(model_module, "load", load)
    folder = tmp_path / "ouro"
    folder.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{OURO}/{name}", folder / name)
    first, again = (loopjax.generate(folder, [1, 2], max_new_tokens=2)[0][0] for _ in range(2))
    assert again is first and len(loads) == 1
    stat = os.stat(folder / "config.json")
    os.utime(folder / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # written again
    assert loopjax.generate(str(folder), [1, 2], max_new_tokens=2)[0][0] is not first and len(loads) == 2


def test_generate_checks_its_arguments_before_building_an_engine(ouro_model, engines_built):
    """loopjax.generate refuses bad sampling settings and prompts in one line before it builds
    (compiles) an engine, and leaves the caller's engine_options as given."""
    built = engines_built
    for prompt, kwargs, message in (
            ([1, 2], dict(max_new_tokens=0), r"max_new_tokens must be >= 1, got 0"),  # named as given
            ([1, 2], dict(max_new_tokens=1.5), r"max_new_tokens must be an integer >= 1, got 1.5"),
            # n requests are sized for: a huge n was a huge engine
            ([1, 2], dict(max_new_tokens=4, n=17, temperature=0.5),
             r"n must be in \[1, 16\] \(LLM's max_n\), got 17"),
            ([1, 2], dict(max_new_tokens=4, temperature=-1), r"temperature must be in \[0, 2.0\], got -1"),
            ([1, 2], dict(max_new_tokens=4, loops=0), r"loops must be >= 1, got 0"),
            ([1, 300], dict(max_new_tokens=4), r"prompt 0: token id 300 is outside the vocabulary "
                                                r"\[0, 256\)"),
            ([1] * 512, dict(max_new_tokens=4), "a prompt of 512 tokens leaves no room to generate within "
                                                "the model's context of 512 tokens"),
            # the model's own refusals (sampling_params.check_for_model), before the compile too
            ([1, 2], dict(max_new_tokens=4, exit_criterion="kl"), "exit_criterion applies to Huginn models; "
                                                                  "Ouro exits by exit_threshold"),
            ([1, 2], dict(max_new_tokens=4, warm_start=True), "warm_start applies to Huginn models only"),
            ([1, 2], dict(max_new_tokens=4, warm_start="no"), "warm_start must be true or false, got 'no'"),
            ([1, 2], dict(max_new_tokens=4, logit_bias={300: 1}), "logit_bias token id 300 is outside the "
                                                                  "vocabulary of 256"),
            ([1, 2], dict(max_new_tokens=4, stop=["x"]), r"stop strings need a tokenizer; this model has "
                                                         r"none \(use stop_token_ids\)"),
            ([1, 2], dict(max_new_tokens=4, max_tokens=4),  # a TypeError of SamplingParams before
             r"generate takes max_new_tokens \(SamplingParams' max_tokens\); give it alone")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            loopjax.generate(ouro_model, prompt, **kwargs)
    for kwargs, message in ((dict(exit_step=4), "exit_step=4 must be below the depth 4"),  # the engine's
                            (dict(exit_trace=(2, 5)), "exit_trace entry 5 exceeds the depth 4")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            loopjax.generate(ouro_model, [1, 2], max_new_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="^exit_step applies to Ouro models only$"):
        loopjax.generate(loopjax.load(HUGINN), [1, 2], max_new_tokens=4, exit_step=1)
    # the engine's initial_state checks too (they came after the compile)
    with pytest.raises(ValueError, match="^initial_state applies to Huginn models only$"):
        loopjax.generate(ouro_model, [1, 2], max_new_tokens=4, initial_state="zero")
    with pytest.raises(ValueError, match=r"^initial_state must have shape \[>= 3, 64\]"):
        loopjax.generate(loopjax.load(HUGINN), [[1, 2], [1, 2, 3]], max_new_tokens=1,
                         initial_state=[None, np.zeros((2, 64))])
    # a malformed array names its shape, not a row count (it said ">= 3" where 8 are needed)
    with pytest.raises(ValueError, match=r"^initial_state must be an array \[positions, 64\] .*got shape "
                                         r"\(1, 8, 64\)$"):
        loopjax.generate(loopjax.load(HUGINN), [1, 2, 3], max_new_tokens=6,
                         initial_state=np.zeros((1, 8, 64)))
    assert built == []
    options = dict(SMALL)
    (_, params), = loopjax.generate(ouro_model, [1, 2], max_new_tokens=4, engine_options=options)
    assert params.max_tokens == 4
    assert options == SMALL and len(built) == 1


def test_generate_sizes_its_engine_for_every_sample(ouro_model, engines_built):
    """n samples of a prompt are n requests: the engine generate builds decodes them side by
    side (rows for all of them), not one after another in a one-row engine."""
    loopjax.generate(ouro_model, [1, 2], max_new_tokens=4, temperature=1.0, n=4)
    assert engines_built[-1]["max_num_rows"] == 4 and engines_built[-1]["decode_row_buckets"] == (4,)
    # numpy integers as SamplingParams takes them (an AttributeError: no bit_length)
    loopjax.generate(ouro_model, [1, 2], max_new_tokens=np.int64(4), n=np.int64(2), loops=np.int32(3))
    assert engines_built[-1] == engines_built[0] | {"max_num_rows": 2, "decode_row_buckets": (2,),
                                                    "max_prefill_rows": 2, "max_loops": 3,
                                                    "loop_buckets": (3,)}


@pytest.mark.parametrize("method", ["read", "dispatch"])
def test_interrupt_while_generating_leaves_the_llm_usable(ouro_llm, ouro_ref, monkeypatch, method):
    """Ctrl-C while the host waits for a step's result (read) or while a step is dispatched
    (it may be compiling; that plan never ran, so it is dropped): the call's requests are
    aborted (no page held, none left to run in the next call), and the next call generates
    as before."""
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    engine = ouro_llm.engine
    original, calls = getattr(engine.runner, method), []

    def interrupted(*args, **kwargs):
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, method, interrupted)
    with pytest.raises(KeyboardInterrupt):
        ouro_llm.generate(ids, max_new_tokens=24, ignore_eos=True)
    monkeypatch.undo()
    stats = engine.stats()
    assert not engine.has_unfinished() and stats["pages_free"] == stats["pages_total"]
    engine.scheduler.block_manager.check([])
    out = ouro_llm.generate(ids[0], max_new_tokens=5, ignore_eos=True)[0]
    assert out.token_ids == ouro_ref["p0_greedy_tokens"][:5].tolist()
    assert engine.stats()["generated_tokens"] == stats["generated_tokens"] + 5


def test_a_device_error_while_reading_leaves_the_llm_usable(ouro_llm, ouro_ref, monkeypatch):
    """A read that raises (a device error) is one line; the call's requests are aborted, the
    device state made anew (same shapes: nothing compiles in this strict engine) and the next
    call gives the golden tokens."""
    ids = [ouro_ref[f"{k}_input_ids"].tolist() for k in PROMPTS]
    engine = ouro_llm.engine
    original, calls = engine.runner.read, []

    def failing(pending):
        calls.append(pending)
        if len(calls) == 3:
            raise RuntimeError("INTERNAL: CUDA error: an illegal memory access was encountered")
        return original(pending)

    monkeypatch.setattr(engine.runner, "read", failing)
    with pytest.raises(RuntimeError, match=r"^a step failed on the device \(RuntimeError: INTERNAL: CUDA "):
        ouro_llm.generate(ids, max_new_tokens=24, ignore_eos=True)
    monkeypatch.undo()
    stats = engine.stats()
    assert not engine.has_unfinished() and stats["pages_free"] == stats["pages_total"]
    out = ouro_llm.generate(ids, max_new_tokens=5, ignore_eos=True)
    assert [o.token_ids for o in out] == [ouro_ref[f"{k}_greedy_tokens"][:5].tolist() for k in PROMPTS]
    assert engine.stats()["compilations"] == stats["compilations"]


def test_model_given_as_a_path_object(ouro_model, monkeypatch):
    """LLM and generate load a model folder given as a pathlib.Path as they do a str; a value
    that is no model is a one-line ValueError (an AttributeError before)."""
    import pathlib

    from loopjax import llm as llm_module

    monkeypatch.setattr(llm_module, "Engine", lambda model, config: None)  # no compile
    assert loopjax.LLM(pathlib.Path(OURO)).model.cfg == ouro_model.cfg
    with pytest.raises(ValueError, match="^model must be a loopjax Model, a model folder or a preset "
                                         "name, got NoneType$"):
        loopjax.LLM(None)
    with pytest.raises(ValueError, match="got int$"):
        loopjax.generate(3, [1, 2], max_new_tokens=2)
    # dtype loads a model by name; a Model given is used as it is: another dtype is refused, not ignored
    assert loopjax.LLM(ouro_model, dtype="float32").model is ouro_model
    with pytest.raises(ValueError, match="^dtype bfloat16 differs from the given Model's float32: "):
        loopjax.LLM(ouro_model, dtype="bfloat16")


def test_generate_cli(capsys):
    import argparse

    from loopjax import generate_cli
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "28,72,220,249,138",
                                               "--max-tokens", "6", "--ignore-eos", "--json"])) == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == [138, 138, 111, 111, 138, 138]
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "28,72,220,249,138", "--max-tokens",
                                               "6", "--ignore-eos", "--json", "--repetition-penalty", "1.5",
                                               "--presence-penalty", "0.5"])) == 0
    penalized = json.loads(capsys.readouterr().out)["token_ids"]
    assert len(penalized) == 6 and penalized != out["token_ids"]  # tests/test_penalties.py: the values
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "1,x"])) == 2
    assert generate_cli.run(parser.parse_args(["no-such-model", "--prompt-ids", "1"])) == 2
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "1", "--frequency-penalty", "3"])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("loopjax generate: error:") for line in err)
    assert "--frequency-penalty must be in [-2.0, 2.0], got 3.0" in err[2]


def test_generate_cli_exit_flags(capsys):
    """Exit settings reach the engine from the CLI: a replayed trace sets each token's loops
    (Ouro's first token, sampled at prefill, where every loop runs for the prompt's KV, takes
    the traced loop's logits: it reported 4 loops, ignoring trace[0])."""
    import argparse
    import json

    from loopjax import generate_cli
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "28,72,220", "--max-tokens", "4",
                                               "--exit-trace", "1,2,3,1", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exit_loops"] == [1, 2, 3, 1]
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "28,72,220", "--max-tokens", "3",
                                               "--exit-step", "1", "--json"])) == 0
    assert json.loads(capsys.readouterr().out)["exit_loops"] == [2, 2, 2]
    assert generate_cli.run(parser.parse_args([OURO, "--prompt-ids", "1", "--exit-trace", "1,x"])) == 2
    assert "--exit-trace must be comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize("share", [True, False])
def test_prefill_share_first_token_step_and_chunked_prefill(ouro_engine, ouro_model, share):
    """A (5 tokens) decodes; B (40 tokens = chunks of 32 + 8) arrives before step 2.
    By hand: step 0 prefills A, step 1 decodes A (4 fused loops), step 2 prefills B[0:32].
    Share on: 4 x 1 prefill batches may follow a 4-loop decode, so step 3 prefills B[32:40]
    and B's first token comes at step 3. Share off: one prefill batch per decode, so step 3
    decodes A and step 4 finishes B. B's tokens equal the identity path's greedy. (Step
    numbers of the synchronous loop: async scheduling is off here.)"""
    import dataclasses

    from loopjax.models import ouro
    sched = ouro_engine.scheduler
    saved, saved_engine = sched.config, ouro_engine.config
    sched.config = dataclasses.replace(saved, prefill_share_per_loop=share)
    ouro_engine.config = dataclasses.replace(saved_engine, async_scheduling=False)
    try:
        rng = np.random.default_rng(7)
        prompt_b = rng.integers(3, 256, size=40).tolist()
        first_token_step, kinds = None, []
        arrivals = {0: [([28, 72, 220, 249, 138], greedy(12), "A")], 2: [(prompt_b, greedy(6), "B")]}
        finals, step = {}, 0
        while ouro_engine.has_unfinished() or arrivals:
            for prompt, params, rid in arrivals.pop(step, []):
                ouro_engine.add_request(prompt, params, rid)
            before = sched.num_decode_steps
            for out in ouro_engine.step():
                if out.request_id == "B" and out.new_token_ids and first_token_step is None:
                    first_token_step = step
                if out.finished:
                    finals[out.request_id] = out
            kinds.append("D" if sched.num_decode_steps > before else "P")
            step += 1
    finally:
        sched.config, ouro_engine.config = saved, saved_engine
    assert first_token_step == (3 if share else 4)
    assert "".join(kinds[:5]) == ("PDPPD" if share else "PDPDP")
    expected = ouro.greedy_nocache(ouro_model.params, ouro_model.cfg, prompt_b, 6)
    assert finals["B"].token_ids == expected.tolist()


def test_fewer_loops_run_in_the_compiled_loop_count(ouro_engine, ouro_model, huginn):
    """loops=2 (Ouro) / 5 (Huginn) run inside the compiled max-loop step, rows stopping at
    their own depth (strict engines: nothing compiles), equal to the identity path."""
    from loopjax.models import huginn as hm
    from loopjax.models import ouro
    prompt = [28, 72, 220, 249, 138]
    out = run_all(ouro_engine, {0: [(prompt, greedy(4, loops=2), "short")],
                                1: [(prompt, greedy(4), "full")]})
    ids = np.zeros(16, np.int32)
    ids[:5] = prompt
    for i in range(4):
        ids[5 + i] = int(np.argmax(ouro.forward(ouro_model.params, ouro_model.cfg, ids,
                                                loops=2).logits[4 + i]))
    assert out["short"].token_ids == ids[5:9].tolist() and out["short"].exit_loops == [2] * 4
    assert out["full"].exit_loops == [4] * 4
    model, gen, hprompt = huginn
    engine = _huginn_engine(model, "per_loop")
    states = gen["gen_init_states"][0]
    rid = engine.add_request(hprompt, greedy(5, loops=5), initial_state=states)
    result = run_all(engine)[rid]
    expected, _, _ = hm.generate_greedy_recompute(model.params, model.cfg, hprompt, 5,
                                                  initial_states=states, loops=5)
    assert result.token_ids == np.asarray(expected).tolist() and result.exit_loops == [5] * 5


def test_prefix_cache_hits_keep_tokens(ouro_model, ouro_ref):
    """A repeated prompt reuses its full KV pages (prefill starts after them) and still gives
    the golden tokens; so does a prompt that shares only the first page."""
    engine = Engine(ouro_model, EngineConfig(**SMALL, enable_prefix_caching=True))
    prompt = ouro_ref["p2_input_ids"].tolist()  # 17 tokens: 2 full pages of 8
    first = run_all(engine, {0: [(prompt, greedy(24), "first")]})["first"]
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    again = run_all(engine, {0: [(prompt, greedy(24), "again")]})["again"]
    assert engine.stats()["prefix_cache_hit_tokens"] == 16
    assert first.token_ids == again.token_ids == ouro_ref["p2_greedy_tokens"].tolist()
    other = prompt[:8] + [5] * 9
    shared = run_all(engine, {0: [(other, greedy(6), "shared")]})["shared"]
    assert engine.stats()["prefix_cache_hit_tokens"] == 24
    from loopjax.models import ouro
    assert shared.token_ids == ouro.greedy_nocache(ouro_model.params, ouro_model.cfg, other, 6).tolist()
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"]  # parked cached pages count as free


def _one_row_engine(model, matmul="streaming", **kw):
    return Engine(model, EngineConfig(page_size=8, max_num_rows=1, decode_row_buckets=(1,),
                                      max_prefill_tokens=16, prefill_token_buckets=(16,),
                                      max_prefill_rows=1, max_context_len=32,
                                      matmul=matmul, warmup=False, verbose=False, **kw))


def test_streaming_matmul_ops_keep_golden_tokens(ouro_model, ouro_ref):
    """EngineConfig.matmul='streaming' swaps the Pallas weight-streaming kernel into every
    dense product of the step (layers.Ops; interpret mode on CPU), the RMSNorm before wqkv
    and w_gate_up fused into its prologue and SiLU*up into its epilogue: same greedy tokens."""
    from loopjax.matmul_ops import matmul_ops
    ops = matmul_ops("streaming")
    assert "streaming_norm_linear" in ops.norm_linear.__name__
    assert "streaming_norm_linear_silu_mul" in ops.norm_linear_silu_mul.__name__
    engine = _one_row_engine(ouro_model)
    out = run_all(engine, {0: [(ouro_ref["p0_input_ids"].tolist(), greedy(3), "s")]})["s"]
    assert out.token_ids == ouro_ref["p0_greedy_tokens"][:3].tolist()
    with pytest.raises(ValueError, match="^EngineConfig.matmul must be one of auto, xla, streaming, "
                                         "persistent, got 'cublas'$"):
        Engine(ouro_model, EngineConfig(**SMALL, matmul="cublas"))


def test_streaming_matmul_ops_fuse_ouro_rope(ouro_model):
    """The golden checkpoint's D = 16 keeps the RoPE out of the qkv product (D/2 is below a
    Triton dot tile); at D = 32 with GQA (random weights) the product writes q, k, v itself
    (tests/test_streaming_matmul_rope.py): the XLA products' tokens, and their log-probs up
    to fp32 accumulation order."""
    import dataclasses

    from loopjax.model import Model
    from loopjax.models import ouro
    cfg = dataclasses.replace(ouro_model.cfg, head_dim=32, num_kv_heads=2)
    model = Model(cfg=cfg, params=ouro.init_params(cfg, jax.random.key(0), np.float32))
    outs = {}
    for matmul in ("streaming", "xla"):
        engine = _one_row_engine(model, matmul, max_logprobs=1)
        rid = engine.add_request(list(range(3, 12)), greedy(3, logprobs=0))
        outs[matmul] = run_all(engine)[rid]
    assert outs["streaming"].token_ids == outs["xla"].token_ids
    np.testing.assert_allclose(outs["streaming"].logprobs, outs["xla"].logprobs, rtol=1e-4, atol=1e-5)


def test_streaming_matmul_ops_keep_huginn_golden_tokens(huginn):
    """Huginn with matmul='streaming' (norm_1 -> wqkv and norm_3 -> w_gate_up fused): the
    golden tokens, and the chosen tokens' log-probs of the XLA products up to fp32
    accumulation order (the tokens alone would not notice a skipped norm here)."""
    model, gen, prompt = huginn
    outs = {}
    for matmul in ("streaming", "xla"):
        engine = _one_row_engine(model, matmul, kv_layout="per_loop", max_logprobs=1)
        rid = engine.add_request(prompt, greedy(3, logprobs=0), initial_state="zero")
        outs[matmul] = run_all(engine)[rid]
    assert outs["streaming"].token_ids == gen["gen_zero_state_tokens"][0][:3].tolist()
    np.testing.assert_allclose(outs["streaming"].logprobs, outs["xla"].logprobs, rtol=1e-4, atol=1e-5)
