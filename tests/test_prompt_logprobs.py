"""`SamplingParams.prompt_logprobs` in `LLM.generate`: the prompt's log-probabilities are
`loopjax.score`'s at the depth, Ouro exit rule and Huginn s_0 the request runs with (position
0 None), scored once per distinct prompt however many samples fan out; requests that do not
ask get None and the same tokens; bad values and unscorable requests are one-line errors
raised before anything is queued. One engine per model (module fixtures; the Huginn one
never steps)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import loopjax
import loopjax.llm
from loopjax.sampling_params import SamplingParams

DATA = os.path.join(os.path.dirname(__file__), "data")
OURO = os.path.join(DATA, "ouro")
HUGINN = os.path.join(DATA, "huginn", "huginn_shape_242")
SMALL = dict(page_size=8, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
             prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=64, max_logprobs=2,
             warmup=False, verbose=False)


@pytest.fixture(scope="module")
def ouro():
    ref = np.load(os.path.join(OURO, "reference_fp32.npz"))
    return loopjax.LLM(loopjax.load(OURO), **SMALL), [ref[f"p{k}_input_ids"].tolist() for k in range(2)]


@pytest.fixture(scope="module")
def huginn():
    prompt = load_file(os.path.join(HUGINN, "inputs.safetensors"))["prompt_ids"][0].tolist()
    return loopjax.LLM(loopjax.load(HUGINN), **SMALL), prompt


@pytest.fixture
def count_scores(monkeypatch):
    """The prompts `LLM.generate` scores, one list per `score` call."""
    calls = []

    def counted(model, sequences, **kw):
        calls.append([list(s) for s in sequences])
        return loopjax.score(model, sequences, **kw)

    monkeypatch.setattr(loopjax.llm, "score", counted)
    return calls


class Queued(Exception):  # a request reached the engine (its add_request, patched)
    pass


def _raise(e):
    raise e


def as_pairs(scored):
    """GenerateOutput.prompt_logprobs of a ScoreOutput: None, then (log p, top) per position."""
    return [None] + [(lp, top) for lp, top in zip(scored.token_logprobs, scored.top_logprobs, strict=True)]


def test_values_are_the_scores_at_the_requests_depth(ouro):
    llm, prompts = ouro
    outs = llm.generate(prompts, max_tokens=2, ignore_eos=True, loops=2, prompt_logprobs=3)
    for prompt, out in zip(prompts, outs, strict=True):
        want, = loopjax.score(llm.model, prompt, loops=2, top_k=3)
        assert out.prompt_logprobs == as_pairs(want)  # exact: the same forward
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for token, (lp, top) in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
            ids, lps = [i for i, _ in top], [v for _, v in top]
            assert len(set(ids)) == 3 and all(0 <= i < llm.model.cfg.vocab_size for i in ids)
            assert lps == sorted(lps, reverse=True) and lp <= lps[0] + 1e-6
            if token in ids:  # the prompt token among the top: its own log-probability
                assert top[ids.index(token)][1] == pytest.approx(lp, abs=1e-6)
        # vLLM's rank: its place among the top 3 when listed there, else its rank over the vocabulary
        listed = [[i for i, _ in top] for top in want.top_logprobs]
        assert out.prompt_ranks == [None] + [ids.index(t) + 1 if t in ids else r
                                             for t, r, ids in zip(prompt[1:], want.ranks, listed)]
        assert any(r > 3 for r in out.prompt_ranks[1:])
    # the request's depth matters: the model's default depth scores otherwise
    default, = loopjax.score(llm.model, prompts[1], top_k=3)
    assert outs[1].prompt_logprobs[1:] != as_pairs(default)[1:]
    # and so does Ouro's exit threshold (the default depth: within 2 loops none exits here)
    gated, = llm.generate(prompts[1], max_tokens=2, exit_threshold=0.5, prompt_logprobs=3)
    assert gated.prompt_logprobs == as_pairs(loopjax.score(llm.model, prompts[1], exit_threshold=0.5,
                                                           top_k=3)[0])
    assert gated.prompt_logprobs[1:] != as_pairs(default)[1:]
    # and Ouro's other gate rules, the reference's exit_at_step and use_weighted_exit (refused before)
    stepped, = llm.generate(prompts[1], max_tokens=2, exit_step=1, prompt_logprobs=3)
    assert stepped.prompt_logprobs == as_pairs(loopjax.score(llm.model, prompts[1], exit_step=1, top_k=3)[0])
    assert stepped.prompt_logprobs[1:] != as_pairs(default)[1:]


def test_skip_mode_scores_the_prompt_as_select_mode(ouro):
    """exit_mode='skip' computes every prompt position as 'select' does (an Ouro prompt token runs
    every loop; a position's exit loop has the same logits whether later loops run): its
    prompt_logprobs are select mode's, as is the token the engine samples at the prompt's end."""
    llm, prompts = ouro
    kw = dict(max_tokens=1, exit_threshold=0.5, prompt_logprobs=3)
    skip, select = (llm.generate(prompts[1], exit_mode=mode, **kw)[0] for mode in ("skip", "select"))
    assert skip.prompt_logprobs == select.prompt_logprobs == as_pairs(
        loopjax.score(llm.model, prompts[1], exit_threshold=0.5, top_k=3)[0])
    assert skip.token_ids == select.token_ids and skip.exit_loops == select.exit_loops


def test_samples_share_one_scoring_and_others_get_none(ouro, count_scores):
    llm, prompts = ouro
    # NOTE: greedy samples (identical tokens) keep to the greedy sampler's compiled steps
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, loops=2)
    fanned = dataclasses.replace(greedy, n=3, prompt_logprobs=3)
    outs = llm.generate([prompts[0], prompts[1], prompts[0]], fanned)
    assert count_scores == [[prompts[0]], [prompts[1]]]  # each distinct prompt once
    assert len(outs) == 9 and [o.prompt_token_ids for o in outs[:4]] == [prompts[0]] * 3 + [prompts[1]]
    first = outs[0].prompt_logprobs
    assert first == as_pairs(loopjax.score(llm.model, prompts[0], loops=2, top_k=3)[0])
    assert all(o.prompt_logprobs == first for o in outs[:3] + outs[6:])
    assert outs[3].prompt_logprobs != first and len(outs[3].prompt_logprobs) == len(prompts[1])
    assert outs[1].prompt_logprobs[1][1] is not first[1][1]  # each sample holds its own lists
    # per-request params: only the request that asks is scored; the tokens stay the same
    count_scores.clear()
    asked, plain = llm.generate(prompts, [dataclasses.replace(greedy, prompt_logprobs=0), greedy])
    assert count_scores == [[prompts[0]]]
    assert plain.prompt_logprobs is None and all(top == [] for _, top in asked.prompt_logprobs[1:])
    alone = llm.generate(prompts, greedy)
    assert [o.token_ids for o in alone] == [asked.token_ids, plain.token_ids]
    assert alone[0].prompt_logprobs is None
    one, = llm.generate(prompts[0][:1], dataclasses.replace(greedy, prompt_logprobs=3))
    assert one.prompt_logprobs == [None]  # one token: no prefix to score


@pytest.mark.parametrize("value", [21, -1, True, 1.5, "2"])
def test_bad_values_are_one_line_errors(value):
    with pytest.raises(ValueError, match="prompt_logprobs") as err:
        SamplingParams(prompt_logprobs=value)
    assert "\n" not in str(err.value)


def test_params_behave_as_before():
    a, b = SamplingParams(seed=3, prompt_logprobs=20), SamplingParams(seed=3, prompt_logprobs=20)
    assert a == b and hash(a) == hash(b) and a != dataclasses.replace(a, prompt_logprobs=0)
    assert SamplingParams(temperature=0.0, prompt_logprobs=5).is_plain_greedy
    assert not SamplingParams(temperature=0.0, logprobs=5, prompt_logprobs=5).is_plain_greedy
    samples = SamplingParams(n=2, seed=3, prompt_logprobs=4).fan_out()
    assert [(s.n, s.seed, s.prompt_logprobs) for s in samples] == [(1, 3, 4), (1, 4, 4)]
    assert SamplingParams.from_openai({"prompt_logprobs": 1}).prompt_logprobs == 1  # the server's field
    with pytest.raises(ValueError, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams.from_openai({"prompt_logprobs": 21})


def test_unscorable_requests_are_refused_before_queueing(ouro, huginn, monkeypatch):
    llm, prompts = ouro
    hllm, prompt = huginn
    queued = []
    for engine in (llm.engine, hllm.engine):
        monkeypatch.setattr(engine, "add_request", lambda *a, **k: queued.append(a) or _raise(Queued()))
    explicit = np.zeros((len(prompt) + 1, hllm.model.cfg.hidden_size), np.float32)
    for target, extra, words in [
        (llm, dict(exit_trace=(2, 1)), "exit_trace is not supported"),
        # the first prompt (engine default s_0) is fine; the second's explicit s_0 is refused
        (hllm, dict(initial_state=[None, explicit]), "explicit initial_state"),
    ]:
        ps = prompts if target is llm else [prompt, prompt]
        with pytest.raises(ValueError, match=words) as err:
            target.generate(ps, max_tokens=2, prompt_logprobs=1, **extra)
        assert "\n" not in str(err.value) and str(err.value).startswith("prompt_logprobs: ")
    assert queued == []  # all or nothing: refused before the first request was queued
    with pytest.raises(Queued):  # the same requests without prompt_logprobs reach the engine
        hllm.generate([prompt, prompt], max_tokens=2, initial_state=[None, explicit])
    assert len(queued) == 1


def test_score_options_follow_the_engine(ouro, huginn):
    from loopjax.engine import EngineConfig
    from loopjax.scoring import score_options, score_state

    ouro_model, huginn_model = ouro[0].model, huginn[0].model
    params = SamplingParams(exit_threshold=0.5)
    assert score_options(ouro_model, params, num_loops=3) == dict(loops=3, exit_threshold=0.5,
                                                                    initial_state=None)
    assert score_options(huginn_model, dataclasses.replace(params, loops=5), num_loops=3,
                         engine_config=EngineConfig(huginn_init="zero")) == dict(
        loops=5, exit_threshold=None, initial_state="zero")
    assert score_state(huginn_model, EngineConfig(huginn_init="zero"), "seeded") is None  # the request's
    with pytest.raises(ValueError, match="huginn_seed is 1"):
        score_state(huginn_model, EngineConfig(huginn_seed=1))
    with pytest.raises(ValueError, match="Huginn models only"):
        score_state(ouro_model, None, "zero")
    with pytest.raises(ValueError, match="weights"):
        score_state(object())
    # LLM.generate's options: the engine's depth and s_0 rule, the request's state first
    llm = huginn[0]
    asked = SamplingParams(prompt_logprobs=2)
    depth = llm.engine.scheduler.config.num_loops
    assert llm._score_options(asked, None) == dict(loops=depth, exit_threshold=None,
                                                   initial_state=None, top_k=2)
    assert llm._score_options(asked, "zero")["initial_state"] == "zero"
    assert llm._score_options(SamplingParams(), "zero") is None
