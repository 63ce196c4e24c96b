"""The host-driven adaptive references (loopjax.adaptive_reference) against the PyTorch
reference's goldens (tests/data/huginn/huginn_shape_242, README there) and against the
identity paths.

Huginn: every run of adaptive.safetensors (generate_with_adaptive_compute, num_steps=16,
8 new tokens) with its stored per-position s_0 and cache rule: the tokens and the loops of
every call must match exactly. generate.safetensors (num_steps=8, no exits) checks the ring
rules (compress-s4/s8/s16, latest-m4) and the warm start, with the loop count replayed by
the "steps" criterion so every run shares one compiled store of 16 planes.
Select mode equals an oracle built from the identity forward (per-position selection).
Ouro: "select" equals the no-cache identity greedy at the same threshold; "skip" does less
work and its loop counts are the rule's; a forced trace equals the skip reference.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from loopjax import exits
from loopjax.adaptive_reference import huginn_generate, ouro_generate, parse_cache_rule
from loopjax.config import read_hf_config
from loopjax.convert.huginn_keys import to_params
from loopjax.layers import DenseCausal, rope_angles
from loopjax.models import huginn, ouro

FOLDER = os.path.join(os.path.dirname(__file__), "data", "huginn", "huginn_shape_242")
MAX_LOOPS = 16   # the adaptive goldens' num_steps
NEW_TOKENS = 8
ATOL = 1e-4

# (criterion, threshold as passed, cache rule) of every stored run (README table).
RUNS = [("kl", 5e-4, "latest-m4"), ("kl", "auto", "latest-m4"),
        ("entropy-diff", "auto", "latest-m4"), ("latent-diff", "auto", "latest-m4"),
        ("argmax-stability", "auto", "latest-m4"), ("cosine", "auto", "latest-m4"),
        ("minp-kl", "auto", "latest-m4"), ("kl", 5e-4, "latest-m4-compress-s8"),
        ("none", "auto", "full")]


def golden_key(criterion, threshold, rule):
    x = "auto" if threshold == "auto" else format(threshold, "f").rstrip("0")
    name = f"adaptive_{criterion}_{x}_{rule}"
    return name.replace(".", "p").replace("-", "_")


@pytest.fixture(scope="module")
def huginn_golden():
    cfg = read_hf_config(FOLDER)
    params = jax.tree.map(jnp.asarray, to_params(cfg, load_file(os.path.join(FOLDER, "model.safetensors"))))
    data = {name: load_file(os.path.join(FOLDER, f"{name}.safetensors"))
            for name in ("inputs", "adaptive", "generate")}
    return cfg, params, data


def test_every_stored_run_is_listed(huginn_golden):
    stored = {k[:-len("_tokens")] for k in huginn_golden[2]["adaptive"] if k.endswith("_tokens")}
    assert stored == {golden_key(*run) for run in RUNS}


@pytest.mark.parametrize("criterion,threshold,rule", RUNS)
def test_adaptive_golden_tokens_and_loops(huginn_golden, criterion, threshold, rule):
    cfg, params, data = huginn_golden
    gold, key = data["adaptive"], golden_key(criterion, threshold, rule)
    # The reference's min_steps=0, check every step = loopjax's min_loops 1, check_every 1.
    spec = exits.ExitSpec(criterion, threshold, min_loops=1, check_every=1)
    out = huginn_generate(params, cfg, data["inputs"]["prompt_ids"][0], NEW_TOKENS,
                          max_loops=MAX_LOOPS, init_states=gold[f"{key}_init_states"][0],
                          exit_spec=spec, cache_rule=rule)
    np.testing.assert_array_equal(out.loops, gold[f"{key}_steps_per_token"])
    np.testing.assert_array_equal(out.tokens, gold[f"{key}_tokens"][0])
    np.testing.assert_array_equal(out.tokens, np.argmax(out.logits, axis=-1))


def _fixed_depth(params, cfg, data, rule, loops, **kw):
    """A no-exit run at `loops` loops, replayed with the "steps" criterion."""
    spec = exits.ExitSpec("steps", loops)
    return huginn_generate(params, cfg, data["inputs"]["prompt_ids"][0], NEW_TOKENS,
                           max_loops=MAX_LOOPS, exit_spec=spec, cache_rule=rule, **kw)


@pytest.mark.parametrize("rule", ["full", "latest-m4", "compress-s4", "compress-s8",
                                  "compress-s16", "latest-m4-compress-s8"])
def test_cache_rules_without_exits_match_generate_golden(huginn_golden, rule):
    cfg, params, data = huginn_golden
    gen = data["generate"]
    name = "gen" if rule == "full" else "gen_" + rule.replace("-", "_")
    out = _fixed_depth(params, cfg, data, rule, cfg.mean_recurrence,
                       init_states=gen["gen_init_states"][0])
    assert (out.loops == cfg.mean_recurrence).all()
    np.testing.assert_array_equal(out.tokens, gen[f"{name}_tokens"][0])
    np.testing.assert_allclose(out.logits, gen[f"{name}_logits"], rtol=0, atol=ATOL)


def test_warm_start_ln_f_matches_continuous_compute_golden(huginn_golden):
    cfg, params, data = huginn_golden
    gen = data["generate"]
    out = _fixed_depth(params, cfg, data, "full", cfg.mean_recurrence, warm_start="ln_f",
                       init_states=gen["gen_cc_prefill_init_state"][0])
    np.testing.assert_array_equal(out.tokens, gen["gen_cc_tokens"][0])
    np.testing.assert_allclose(out.logits, gen["gen_cc_logits"], rtol=0, atol=ATOL)
    raw = _fixed_depth(params, cfg, data, "full", cfg.mean_recurrence, warm_start="raw",
                       init_states=gen["gen_cc_prefill_init_state"][0])
    assert np.abs(raw.logits[1:] - out.logits[1:]).max() > 1e-3  # the two starts differ
    np.testing.assert_allclose(raw.logits[0], out.logits[0], rtol=0, atol=ATOL)


def test_latest_differs_from_full_once_tokens_exit_early(huginn_golden):
    """With early exits the two rules read different keys, so the logits must differ (the
    golden runs above pin which one the reference uses)."""
    cfg, params, data = huginn_golden
    trace = [exits.ExitSpec("steps", n) for n in (16, 3, 16, 5, 16, 16, 16, 16)]
    init = data["adaptive"][golden_key("none", "auto", "full") + "_init_states"][0]
    runs = {rule: huginn_generate(params, cfg, data["inputs"]["prompt_ids"][0], NEW_TOKENS,
                                  max_loops=MAX_LOOPS, init_states=init, exit_spec=trace,
                                  cache_rule=rule) for rule in ("full", "latest-m4")}
    np.testing.assert_array_equal(runs["full"].loops, [16, 3, 16, 5, 16, 16, 16, 16])
    np.testing.assert_allclose(runs["full"].logits[:2], runs["latest-m4"].logits[:2], atol=ATOL)
    assert np.abs(runs["full"].logits[2:] - runs["latest-m4"].logits[2:]).max() > 1e-3


def test_select_mode_equals_forward_with_per_position_selection(huginn_golden):
    """In select mode every loop runs, so the core trajectory is the full forward's; the
    coda sees each position's exit-loop state. Oracle: forward at 16 loops over the whole
    sequence, select each position's state, one cache-free coda."""
    cfg, params, data = huginn_golden
    trace = (5, 16, 2, 9, 1, 16, 7, 3)
    prompt = data["inputs"]["prompt_ids"][0]
    init = data["adaptive"][golden_key("none", "auto", "full") + "_init_states"][0]
    specs = [exits.ExitSpec("steps", n) for n in trace]
    out = huginn_generate(params, cfg, prompt, NEW_TOKENS, max_loops=MAX_LOOPS, init_states=init,
                          exit_spec=specs, cache_rule="latest-m4", mode="select")
    np.testing.assert_array_equal(out.loops, trace)
    assert (out.loops_run == MAX_LOOPS).all()
    seq = np.concatenate([prompt, out.tokens[:-1]])
    fw = huginn.forward(params, cfg, seq, loops=MAX_LOOPS, initial_state=init[:len(seq)])
    exit_loop = np.concatenate([np.full(len(prompt), trace[0]), trace[1:]]) - 1
    selected = fw.loop_hidden[exit_loop, np.arange(len(seq))]
    cos, sin = rope_angles(jnp.arange(len(seq)), cfg.head_dim, cfg.rope_base)
    logits, _ = huginn.coda(params, cfg, selected, cos, sin, DenseCausal(), None)
    np.testing.assert_allclose(out.logits, np.asarray(logits)[len(prompt) - 1:], rtol=0, atol=ATOL)
    skip = huginn_generate(params, cfg, prompt, NEW_TOKENS, max_loops=MAX_LOOPS, init_states=init,
                           exit_spec=specs, cache_rule="latest-m4")
    np.testing.assert_array_equal(skip.loops_run, trace)
    np.testing.assert_allclose(skip.logits[0], out.logits[0], rtol=0, atol=ATOL)
    assert np.abs(skip.logits[1:] - out.logits[1:]).max() > 1e-3


def test_parse_cache_rule_and_errors(huginn_golden):
    cfg = huginn_golden[0]
    assert parse_cache_rule("full", cfg) == (False, None)
    assert parse_cache_rule("latest-m4", cfg) == (True, None)
    assert parse_cache_rule("compress-s8", cfg) == (False, 2)
    assert parse_cache_rule("latest-m4-compress-s16", cfg) == (True, 4)
    for bad in ("", "compress-r2", "full-compress-s8", "latest-m4-compress-s6", "skip"):
        with pytest.raises(ValueError, match="cache rule"):
            parse_cache_rule(bad, cfg)
    with pytest.raises(ValueError, match="one\\s+exit spec per call"):
        huginn_generate(None, cfg, [1, 2], 2, max_loops=4, init_states=np.zeros((3, 64)),
                        exit_spec=[exits.ExitSpec()])


# ------------------------------------------------------------------------------------ Ouro

@pytest.fixture(scope="module")
def ouro_model():
    from ouro_helpers import golden_config, golden_params
    cfg = golden_config()
    return cfg, golden_params(cfg, jnp.float32)


def test_ouro_select_equals_identity_greedy_and_skip_saves_work(ouro_model):
    cfg, params = ouro_model
    prompt = np.arange(3, 11, dtype=np.int32)
    threshold = 0.5
    select = ouro_generate(params, cfg, prompt, 6, threshold=threshold)
    identity_cfg = dataclasses.replace(cfg, early_exit_threshold=threshold, early_exit_step=None)
    expected = ouro.greedy_nocache(params, identity_cfg, prompt, 6)
    np.testing.assert_array_equal(select.tokens, expected)
    assert (select.loops_run == cfg.total_ut_steps).all()
    skip = ouro_generate(params, cfg, prompt, 6, threshold=threshold, mode="skip")
    assert skip.tokens[0] == select.tokens[0] and skip.loops[0] == select.loops[0]
    np.testing.assert_array_equal(skip.loops_run[1:], skip.loops[1:])  # stops at the exit
    assert skip.loops_run.sum() < select.loops_run.sum()
    assert ((skip.loops >= 1) & (skip.loops <= cfg.total_ut_steps)).all()
