"""Ouro's fixed-loop and weighted exits as per-request engine options (issue 5 item 3):
`exit_step` (select and skip) and `exit_weighted` give the tokens and exit loops of a slow
recompute over the growing sequence with the identity path (`ouro.forward(exit_step=k)` /
`forward(weighted=True)`), mixed in one batch; bad combinations are refused with one line;
a default engine compiles no weighted step and nothing in steady state (strict engines)."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import run_requests

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.models import ouro
from loopjax.sampling_params import SamplingParams

OURO = "tests/data/ouro"
SMALL = dict(page_size=8, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
             prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64,
             strict_compile=True, verbose=False)
NEW = 6


def greedy(**kw):
    return SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, **kw)


def reference(model, prompt, **rule):
    """Greedy by full recomputation with the identity forward's exit rule (exit_step=k or
    weighted=True): tokens and the forward's exit loops (1-based) of each generated token."""
    ids = np.zeros(32, np.int32)
    ids[:len(prompt)] = prompt
    tokens, loops = [], []
    for i in range(NEW):
        pos = len(prompt) + i
        out = ouro.forward(model.params, model.cfg, ids, **rule)
        ids[pos] = int(np.argmax(np.asarray(out.logits[pos - 1])))
        tokens.append(int(ids[pos]))
        loops.append(int(out.exit_loop[pos - 1]) + 1)
    return tokens, loops


@pytest.fixture(scope="module")
def model():
    return loopjax.load(OURO)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, EngineConfig(**SMALL, adaptive_exit=True, enable_weighted_exit=True))


PROMPTS = [[5, 17, 42, 9, 100], [3, 77, 12, 250, 31, 8, 64, 199, 2]]


def test_exit_step_and_weighted_equal_recompute(model, engine):
    requests, rules = {}, {}
    for p, prompt in enumerate(PROMPTS):
        for k in (0, 2):
            for mode in ("select", "skip"):
                requests[f"step{k}-{mode}-{p}"] = (prompt, greedy(exit_step=k, exit_mode=mode))
                rules[f"step{k}-{mode}-{p}"] = dict(exit_step=k)
        requests[f"weighted-{p}"] = (prompt, greedy(exit_weighted=True))
        rules[f"weighted-{p}"] = dict(weighted=True)
    finals = run_requests(engine, requests)  # mixed batches: rows of every rule side by side
    for rid, (prompt, _) in requests.items():
        tokens, loops = reference(model, prompt, **rules[rid])
        assert finals[rid].token_ids == tokens, rid
        assert finals[rid].exit_loops == loops, rid
    # the rules differ from each other on this model (the test would notice a mix-up)
    assert len({tuple(finals[r].token_ids) for r in ("step0-select-1", "step2-select-1",
                                                     "weighted-1")}) == 3


def test_a_configs_early_exit_step_comes_before_its_threshold(model):
    """An Ouro config with early_exit_step k (and the released early_exit_threshold 1.0): the
    engine's default request selects loop k's logits, as the reference's exit_at_step (tried
    before the threshold) and the identity forward (and scoring) do."""
    import dataclasses

    cfg = dataclasses.replace(model.cfg, early_exit_step=2)
    stepped = dataclasses.replace(model, cfg=cfg)
    engine = Engine(stepped, EngineConfig(**SMALL))
    finals = run_requests(engine, {f"p{p}": (prompt, greedy()) for p, prompt in enumerate(PROMPTS)})
    for p, prompt in enumerate(PROMPTS):
        tokens, loops = reference(stepped, prompt)  # forward's default: the config's step
        assert (finals[f"p{p}"].token_ids, finals[f"p{p}"].exit_loops) == (tokens, loops)
        assert (tokens, loops) == reference(model, prompt, exit_step=2)
        assert tokens != reference(model, prompt)[0]  # the released rule differs here (not a no-op)
    # a request shallower than the config's step takes its threshold rule (1.0: the last loop); the
    # identity path (and so LLM.generate's prompt_logprobs, scored after the generation) must too
    shallow = run_requests(engine, {"s": (PROMPTS[0], greedy(loops=2))})["s"]
    assert (shallow.token_ids, shallow.exit_loops) == reference(stepped, PROMPTS[0], loops=2, exit_step=1)
    assert (shallow.token_ids, shallow.exit_loops) == reference(stepped, PROMPTS[0], loops=2)
    llm = loopjax.LLM(stepped, **{**SMALL, "warmup": False, "strict_compile": False})
    out, = llm.generate(PROMPTS[0], greedy(loops=2, prompt_logprobs=0))
    assert out.token_ids == shallow.token_ids and len(out.prompt_logprobs) == len(PROMPTS[0])


def test_bad_combinations_are_one_line(model, engine):
    bad = [dict(exit_step=-1), dict(exit_step=True), dict(exit_step=4, loops=4),
           dict(exit_step=1, exit_weighted=True), dict(exit_step=1, exit_trace=(2, 2)),
           dict(exit_weighted=True, exit_criterion="kl"), dict(exit_weighted=True, exit_trace=(4,)),
           dict(exit_weighted=1), dict(exit_weighted=True, exit_mode="skip")]
    for kw in bad:
        with pytest.raises(ValueError) as err:
            SamplingParams(**kw)
        assert "\n" not in str(err.value), kw
    assert SamplingParams.from_openai({"exit_step": 2, "exit_mode": "skip"}).exit_step == 2
    assert SamplingParams.from_openai({"exit_weighted": True}).exit_weighted
    with pytest.raises(ValueError, match="exclude each other"):
        SamplingParams.from_openai({"exit_step": 2, "exit_weighted": True})
    with pytest.raises(ValueError, match="below the depth"):
        engine.add_request([1, 2], greedy(exit_step=4))  # the default depth is 4
    huginn = Engine(loopjax.load("tests/data/huginn/huginn_shape_242"),
                    EngineConfig(**{**SMALL, "warmup": False, "strict_compile": False}))
    for params in (greedy(exit_step=1), greedy(exit_weighted=True)):
        with pytest.raises(ValueError, match="Ouro models only"):
            huginn.add_request([1, 2], params)
    with pytest.raises(ValueError, match="give an exit_criterion"):  # no threshold exit of its own
        huginn.add_request([1, 2], greedy(exit_threshold=0.5))
    # a criterion first checked past the depth never exits: refused, as with loops given
    depth = huginn.scheduler.config.num_loops
    with pytest.raises(ValueError, match=rf"^exit_min_loops={depth + 1} exceeds the depth {depth}"):
        huginn.add_request([1, 2], greedy(exit_criterion="kl", exit_min_loops=depth + 1))
    with pytest.raises(ValueError, match=rf"^exit_min_loops must be in \[1, {depth}\]"):
        greedy(exit_criterion="kl", exit_min_loops=depth + 1, loops=depth)
    assert not engine.has_unfinished() and not huginn.has_unfinished()


def test_default_engine_compiles_no_weighted_step(model):
    engine = Engine(model, EngineConfig(**SMALL))
    assert not any(key[0].weighted for key in engine.runner._compiled)
    compiled = engine.stats()["compilations"]
    with pytest.raises(ValueError, match="enable_weighted_exit"):
        engine.add_request(PROMPTS[0], greedy(exit_weighted=True))
    # exit_step in select mode runs in the default steps: nothing compiles (strict engine)
    finals = run_requests(engine, {"a": (PROMPTS[0], greedy(exit_step=1)), "b": (PROMPTS[1], greedy())})
    assert finals["a"].token_ids == reference(model, PROMPTS[0], exit_step=1)[0]
    assert finals["a"].exit_loops == [2] * NEW
    assert engine.stats()["compilations"] == compiled


def test_skip_runs_only_k_plus_one_loops(model, engine, monkeypatch):
    seen, dispatch = [], engine.runner.dispatch

    def spy(rows, *, decode, **kw):
        if decode:
            seen.extend(r.loops for r in rows)
        return dispatch(rows, decode=decode, **kw)
    monkeypatch.setattr(engine.runner, "dispatch", spy)
    finals = run_requests(engine, {"s": (PROMPTS[1], greedy(exit_step=1, exit_mode="skip"))})
    assert seen == [2] * (NEW - 1)  # decode tokens run loops 0..1 (the prompt runs every loop)
    assert finals["s"].token_ids == reference(model, PROMPTS[1], exit_step=1)[0]


def test_generate_builds_an_engine_for_the_weighted_exit(model, monkeypatch):
    """loopjax.generate(..., exit_weighted=True) sizes its own engine: it compiles the weighted
    steps (a default engine refuses the request) and gives the recompute's tokens."""
    from loopjax import llm as llm_module

    monkeypatch.setattr(llm_module, "_CACHE", {})
    out, = loopjax.generate(model, PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, exit_weighted=True)
    assert (out.token_ids, out.exit_loops) == reference(model, PROMPTS[0], weighted=True)
