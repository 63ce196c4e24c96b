"""Adaptive exits decided on device inside one submission (a while_loop over depth that ends
when every row exited): Huginn's adaptive goldens (every stored run: tokens and loops per
call, "last exited" planes via the fill, the compress-s8 ring), Ouro's Q-exit in skip mode
against the host-driven reference, and batch-composition independence of mixed exits."""

import dataclasses

import numpy as np
import pytest
from safetensors.numpy import load_file

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

HUGINN = "tests/data/huginn/huginn_shape_242"
OURO = "tests/data/ouro"
# Engines compile only the shapes these tests use (warmup off, no strict guard).
CFG = dict(page_size=8, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
           prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64, warmup=False,
           verbose=False)
RUNS = [("kl", 5e-4, "latest_m4"), ("kl", None, "latest_m4"), ("entropy-diff", None, "latest_m4"),
        ("latent-diff", None, "latest_m4"), ("argmax-stability", None, "latest_m4"),
        ("cosine", None, "latest_m4"), ("minp-kl", None, "latest_m4"),
        ("kl", 5e-4, "latest_m4_compress_s8"), (None, None, "full")]


def key(criterion, threshold, rule):
    thr = "auto" if threshold is None else str(threshold).replace(".", "p")
    return f"adaptive_{(criterion or 'none').replace('-', '_')}_{thr}_{rule}"


def finish(engine):
    finals = {}
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return finals


@pytest.fixture(scope="module")
def huginn_engines():
    model = loopjax.load(HUGINN)
    return {"per_loop": Engine(model, EngineConfig(**CFG, max_loops=16)),
            "shared": Engine(model, EngineConfig(**CFG, max_loops=16, kv_layout="shared",
                                                 shared_kv_slots=8))}


def test_huginn_adaptive_goldens(huginn_engines):
    gold = load_file(f"{HUGINN}/adaptive.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    ids = {}
    for criterion, threshold, rule in RUNS:  # all runs at once: rows exit at different loops
        engine = huginn_engines["shared" if rule.endswith("s8") else "per_loop"]
        # NOTE: the "full" run (no criterion) replays 16 loops per token: skip alone is refused
        rule_kw = dict(exit_criterion=criterion) if criterion else dict(exit_trace=(16,))
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, loops=16,
                                exit_threshold=threshold, exit_mode="skip", **rule_kw)
        k = key(criterion, threshold, rule)
        ids[k] = (engine, engine.add_request(prompt, params, k,
                                             initial_state=gold[f"{k}_init_states"][0]))
    finals = {**finish(huginn_engines["per_loop"]), **finish(huginn_engines["shared"])}
    for k, (_, rid) in ids.items():
        assert finals[rid].token_ids == gold[f"{k}_tokens"][0].tolist(), k
        assert finals[rid].exit_loops == gold[f"{k}_steps_per_token"].tolist(), k
    stats = huginn_engines["per_loop"].stats()
    assert stats["mean_loops_per_token"] < 16 and stats["pages_free"] == stats["pages_total"]


def test_huginn_exit_trace_replays_loops(huginn_engines):
    """exit_trace = the kl run's loops reproduces its tokens (same exits, no criterion)."""
    gold = load_file(f"{HUGINN}/adaptive.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    k = key("kl", 5e-4, "latest_m4")
    trace = tuple(gold[f"{k}_steps_per_token"].tolist())
    engine = huginn_engines["per_loop"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, loops=16,
                            exit_trace=trace)
    rid = engine.add_request(prompt, params, initial_state=gold[f"{k}_init_states"][0])
    out = finish(engine)[rid]
    assert out.token_ids == gold[f"{k}_tokens"][0].tolist() and out.exit_loops == list(trace)


def test_huginn_exit_in_prefill_false_runs_the_prompt_to_depth(huginn_engines):
    """exit_in_prefill=False (the reference's do_not_exit_in_prefill): the prompt runs all 16
    loops (the criterion exits it at 11 otherwise), each decoded token exits by the criterion.
    The host-driven reference (adaptive_reference.huginn_generate with no exit spec for its
    prefill call) gives these tokens and loops: the golden run's, its prefill at 16 loops."""
    gold = load_file(f"{HUGINN}/adaptive.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    k = key("kl", 5e-4, "latest_m4")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, loops=16, exit_criterion="kl",
                            exit_threshold=5e-4, exit_mode="skip", exit_in_prefill=False)
    rid = huginn_engines["per_loop"].add_request(prompt, params, initial_state=gold[f"{k}_init_states"][0])
    out = finish(huginn_engines["per_loop"])[rid]
    loops = gold[f"{k}_steps_per_token"].tolist()
    assert loops[0] == 11 and out.exit_loops == [16] + loops[1:]
    assert out.token_ids == gold[f"{k}_tokens"][0].tolist()


def test_ouro_skip_mode_equals_reference():
    from loopjax.adaptive_reference import ouro_generate
    model = loopjax.load(OURO)
    engine = Engine(model, EngineConfig(**CFG))
    ref = np.load(f"{OURO}/reference_fp32.npz")
    prompts = {k: ref[f"{k}_input_ids"].tolist() for k in ("p0", "p1", "p2")}
    finals = {}
    for mode in ("skip", "select"):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5,
                                exit_mode=mode)
        for k, prompt in prompts.items():
            engine.add_request(prompt, params, f"{mode}-{k}")
        finals.update(finish(engine))
        for k, prompt in prompts.items():
            expected = ouro_generate(model.params, model.cfg, prompt, 8, threshold=0.5, mode=mode)
            out = finals[f"{mode}-{k}"]
            assert out.token_ids == expected.tokens.tolist(), (mode, k)
            assert out.exit_loops == expected.loops.tolist(), (mode, k)
    # exit_trace replays the skip runs, their first (prefill) tokens' early exits included
    assert any(finals[f"skip-{k}"].exit_loops[0] < 4 for k in prompts)
    for k, prompt in prompts.items():
        trace = finals[f"skip-{k}"].exit_loops
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                  exit_trace=trace), f"trace-{k}")
    replays = finish(engine)
    for k in prompts:
        assert (replays[f"trace-{k}"].token_ids, replays[f"trace-{k}"].exit_loops) == \
            (finals[f"skip-{k}"].token_ids, finals[f"skip-{k}"].exit_loops), k
    assert engine.stats()["pages_free"] == engine.stats()["pages_total"]


def test_huginn_warm_start_golden(huginn_engines):
    """Continuous compute: each decoded token starts from ln_f of the previous token's final
    state (generate.safetensors gen_cc_*, 8 loops, the prompt's s0 given)."""
    gen = load_file(f"{HUGINN}/generate.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    engine = huginn_engines["per_loop"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, loops=8)
    cold = engine.add_request(prompt, params, initial_state=gen["gen_init_states"][0])
    warm = engine.add_request(prompt, params, initial_state=gen["gen_cc_prefill_init_state"][0],
                              warm_start=True)
    finals = finish(engine)
    assert finals[warm].token_ids == gen["gen_cc_tokens"][0].tolist()
    assert finals[cold].token_ids == gen["gen_tokens"][0].tolist()
    assert len(engine._free_carry) == engine.runner.max_rows  # the warm row's slot came back


def test_huginn_warm_start_with_prompt_states_survives_preemption():
    """A warm-start request gives s0 for its prompt only; preempted, it re-prefills its decoded
    tokens too (they start from zero then, docs/semantics.md) instead of failing the step on
    the missing states. Until the preemption it follows the golden warm run."""
    gen = load_file(f"{HUGINN}/generate.safetensors")
    prompts = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"].tolist()
    # 8 pages of 4 tokens: the older request grows to 24 positions (6 pages), so the warm one
    # (12 + 8) is preempted and recomputed after it.
    engine = Engine(loopjax.load(HUGINN), EngineConfig(**{**CFG, "page_size": 4, "max_num_rows": 2,
                                                          "decode_row_buckets": (2,), "max_context_len": 24},
                                                       num_pages=8, max_loops=8))
    greedy = dict(temperature=0.0, ignore_eos=True, loops=8)
    engine.add_request(prompts[1], SamplingParams(max_tokens=12, **greedy), "old")
    engine.add_request(prompts[0], SamplingParams(max_tokens=8, **greedy), "warm",
                       initial_state=gen["gen_cc_prefill_init_state"][0], warm_start=True)
    finals, before = {}, None  # before: the warm request's tokens when it was preempted
    while engine.has_unfinished():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
        warm = engine.scheduler.get("warm")
        if before is None and warm is not None and warm.num_preemptions:
            before = list(warm.output_token_ids)
    assert finals["warm"].metrics["num_preemptions"] == 1 and len(finals["warm"].token_ids) == 8
    assert 0 < len(before) < 8 and before == gen["gen_cc_tokens"][0].tolist()[:len(before)]
    assert len(finals["old"].token_ids) == 12
    assert engine.stats()["pages_free"] == engine.stats()["pages_total"]
    assert len(engine._free_carry) == len(engine._free_token_slots) == engine.runner.max_rows


def test_huginn_async_scheduling_equals_synchronous(huginn_engines):
    """Pipelined steps (async scheduling) keep Huginn's carried state right: warm start, an
    exit criterion (device exits), position-keyed and explicit s0, seeded sampling."""
    gen = load_file(f"{HUGINN}/generate.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    engine = huginn_engines["per_loop"]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [("warm", prompt, SamplingParams(**greedy, loops=8),
                 dict(initial_state=gen["gen_cc_prefill_init_state"][0], warm_start=True)),
                ("kl", prompt[:9], SamplingParams(**greedy, loops=16, exit_criterion="kl",
                                                  exit_mode="skip"), {}),
                ("explicit", prompt, SamplingParams(**greedy, loops=8),
                 dict(initial_state=gen["gen_init_states"][0])),
                ("sampled", prompt[:5], SamplingParams(max_tokens=6, temperature=1.0, seed=11,
                                                       ignore_eos=True, loops=8), {})]
    runs = []
    for pipelined in (False, True):
        engine.config = dataclasses.replace(engine.config, async_scheduling=pipelined)
        for rid, ids, params, kw in requests:
            engine.add_request(ids, params, rid, **kw)
        runs.append({rid: (o.token_ids, o.exit_loops) for rid, o in finish(engine).items()})
    assert runs[0] == runs[1]
    assert runs[1]["warm"][0] == gen["gen_cc_tokens"][0].tolist()
    assert min(runs[1]["kl"][1]) < 16  # the criterion exited early on the device
    assert engine.stats()["pages_free"] == engine.stats()["pages_total"]


def test_huginn_latent_exits_ignore_padding_tokens(huginn_engines):
    """latent-diff and cosine average a row's real tokens only: the bucket's padding tokens
    (prefill and decode) carry row 0's id and made a request in row 0 exit otherwise than
    in an engine whose buckets it fills exactly."""
    model = loopjax.load(HUGINN)
    exact = Engine(model, EngineConfig(**{**CFG, "max_num_rows": 1, "decode_row_buckets": (1,),
                                          "max_prefill_tokens": 25, "prefill_token_buckets": (25,),
                                          "max_prefill_rows": 1}, max_loops=16))
    rng = np.random.default_rng(0)
    for criterion, threshold in (("latent-diff", 0.3), ("cosine", 5e-2)):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, loops=8,
                                exit_criterion=criterion, exit_threshold=threshold)
        for _ in range(2):
            prompt = rng.integers(0, 256, 25).tolist()
            runs = []
            for engine in (exact, huginn_engines["per_loop"]):  # row 0 of 4 rows, 25 of 32 tokens
                engine.add_request(prompt, params, "x")
                out = finish(engine)["x"]
                runs.append((out.token_ids, out.exit_loops))
            assert runs[0] == runs[1], criterion


def test_huginn_adaptive_prompt_is_not_split_by_a_batch_mate(huginn_engines):
    """A Huginn prompt with an exit criterion exits as one (the reference's adaptive prefill):
    a batch-mate that takes part of the prefill budget must not split it into chunks that
    exit separately. It gave other greedy tokens with a mate than alone."""
    engine = huginn_engines["per_loop"]
    rng = np.random.default_rng(0)
    for criterion, threshold in (("kl", 5e-2), ("latent-diff", 0.3), ("cosine", 5e-2)):
        for _ in range(2):
            prompt, mate = rng.integers(0, 256, 25).tolist(), rng.integers(0, 256, 20).tolist()
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, loops=8,
                                    exit_criterion=criterion, exit_threshold=threshold)
            engine.add_request(prompt, params, "alone")
            alone = finish(engine)["alone"]
            engine.add_request(mate, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), "mate")
            engine.add_request(prompt, params, "mixed")  # 32 - 20 tokens of the budget left
            mixed = finish(engine)["mixed"]
            assert (mixed.token_ids, mixed.exit_loops) == (alone.token_ids, alone.exit_loops), criterion
    assert engine.stats()["pages_free"] == engine.stats()["pages_total"]


def test_adaptive_exits_with_the_pallas_decode_kernel():
    """The GPU default reads decode attention through the Pallas kernel (interpret mode here):
    inside the adaptive while_loop with the "last exited" fill it gives the golden tokens and
    loops (Huginn kl run) and the skip reference (Ouro Q-exit)."""
    from loopjax.adaptive_reference import ouro_generate
    gold = load_file(f"{HUGINN}/adaptive.safetensors")
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    k = key("kl", 5e-4, "latest_m4")
    engine = Engine(loopjax.load(HUGINN), EngineConfig(**CFG, max_loops=16, attention_backend="pallas"))
    # NOTE: 4 tokens (the interpreter is slow): exits at 11, 12, 7, 12 loops, so the 4th token
    # reads the planes its 7-loop predecessor filled
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, loops=16,
                            exit_criterion="kl", exit_threshold=5e-4, exit_mode="skip")
    rid = engine.add_request(prompt, params, initial_state=gold[f"{k}_init_states"][0])
    out = finish(engine)[rid]
    assert out.token_ids == gold[f"{k}_tokens"][0].tolist()[:4]
    assert out.exit_loops == gold[f"{k}_steps_per_token"].tolist()[:4]
    model = loopjax.load(OURO)
    engine = Engine(model, EngineConfig(**CFG, attention_backend="pallas"))
    prompt = np.load(f"{OURO}/reference_fp32.npz")["p1_input_ids"].tolist()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, exit_threshold=0.5,
                            exit_mode="skip")
    rid = engine.add_request(prompt, params)
    out = finish(engine)[rid]
    expected = ouro_generate(model.params, model.cfg, prompt, 4, threshold=0.5, mode="skip")
    assert len(set(out.exit_loops)) > 1, out.exit_loops  # its tokens exit at different depths
    assert out.token_ids == expected.tokens.tolist() and out.exit_loops == expected.loops.tolist()


def test_huginn_ring_token_exiting_before_the_ring_wraps(huginn_engines):
    """In the compress-s8 ring (2 planes per core layer) a token that stops after one loop
    wrote plane 0 only; later tokens read it at plane 1 too, where "last exited" finds its
    plane-0 entry (the reference's latest-m4-compress-s8). The fill skipped ring layers, so
    they read whatever the page held before (here another request's KV)."""
    import jax

    from loopjax import exits
    from loopjax.adaptive_reference import huginn_generate
    gold = load_file(f"{HUGINN}/adaptive.safetensors")
    model, init = loopjax.load(HUGINN), gold[f"{key('kl', 5e-4, 'latest_m4_compress_s8')}_init_states"][0]
    prompt = load_file(f"{HUGINN}/inputs.safetensors")["prompt_ids"][0].tolist()
    engine, trace = huginn_engines["shared"], (1, 2, 1, 3, 1, 2, 2, 1)
    engine.add_request(prompt[::-1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    loops=16, exit_trace=(16,)), "before")  # its KV stays
    finish(engine)
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, loops=16,
                                              exit_trace=trace, logprobs=0), "ring", initial_state=init)
    out = finish(engine)["ring"]
    ref = huginn_generate(model.params, model.cfg, prompt, 8, max_loops=16, init_states=init,
                          exit_spec=[exits.ExitSpec("steps", t) for t in trace],
                          cache_rule="latest-m4-compress-s8")
    logprobs = [float(jax.nn.log_softmax(row)[t]) for row, t in zip(ref.logits, ref.tokens)]
    assert out.token_ids == ref.tokens.tolist() and out.exit_loops == list(trace)
    np.testing.assert_allclose(out.logprobs, logprobs, atol=1e-5)


def test_prompt_chunk_beside_an_adaptive_row_runs_all_its_loops(huginn_engines):
    """A prefill step with an adaptive row is a while_loop over depth; it counted a prompt
    chunk that samples nothing (not the prompt's last) as done, so it ended with the adaptive
    row (here after its one traced loop): the chunk's tokens kept whatever their pages held
    at the deeper planes, which the prompt's later chunks and tokens read (the fuzz found it:
also an adaptive prompt chunked alone ran no loop on its first chunk)."""
    engine = huginn_engines["per_loop"]
    rng = np.random.default_rng(1)
    long, short = rng.integers(0, 256, 40).tolist(), rng.integers(0, 256, 5).tolist()
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0)
    engine.add_request(short, SamplingParams(max_tokens=1, temperature=0.0, exit_trace=(1,)), "traced")
    engine.add_request(long, plain, "mixed")  # its first 27 tokens share the traced row's step
    mixed = finish(engine)["mixed"]
    engine.add_request(long, plain, "alone")  # NOTE: after: its pages then hold other KV than mixed's
    alone = finish(engine)["alone"]  # NOTE: the tiny model's tokens agree; its logprobs did not
    assert mixed.token_ids == alone.token_ids
    np.testing.assert_allclose(mixed.logprobs, alone.logprobs, rtol=0, atol=1e-5)
