"""Repetition, frequency and presence penalties and logit_bias (loopjax/penalties.py): the
device math against numpy, a slot's history started and counted, and the engine's tokens
(greedy, and a seeded draw) against the identity forward with the penalties applied in numpy,
through preemption and async scheduling, while a request without them keeps its golden tokens
beside them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from engine_helpers import greedy, run_all

import loopjax
from loopjax import penalties
from loopjax.engine import Engine, EngineConfig
from loopjax.model import forward
from loopjax.sampling_params import SamplingParams

OURO = "tests/data/ouro"
# 8 pages of 8 tokens: the three golden prompts with 20 tokens each cannot all fit (preemption).
CONFIG = EngineConfig(page_size=8, num_pages=8, max_num_rows=4, decode_row_buckets=(4,),
                      max_prefill_tokens=32, prefill_token_buckets=(32,), max_prefill_rows=2,
                      max_context_len=48, enable_prefix_caching=True, strict_compile=True, verbose=False)


def np_penalize(scores, prompt, outputs, params: SamplingParams):
    """The reference of one row: numpy f32, vLLM v1's order (allowed_token_ids, bias, repetition,
    frequency and presence)."""
    x = np.array(scores, np.float32)
    if params.allowed_token_ids is not None:
        x = np.where(np.isin(np.arange(x.shape[-1]), params.allowed_token_ids), x, -np.inf).astype(np.float32)
    for token, bias in params.logit_bias:
        x[token] += np.float32(bias)
    counts = np.bincount(np.asarray(outputs, np.int64), minlength=x.shape[-1]).astype(np.float32)
    seen = counts > 0
    either = seen.copy()
    either[list(prompt)] = True
    r = np.where(either, np.float32(params.repetition_penalty), np.float32(1.0))
    x = np.where(x > 0, x / r, x * r)
    return (x - np.float32(params.frequency_penalty) * counts
            - np.float32(params.presence_penalty) * seen.astype(np.float32))


def test_apply_matches_numpy_and_keeps_unprocessed_rows_bitwise():
    rng = np.random.default_rng(0)
    vocab = 64
    scores = (rng.standard_normal((4, vocab)) * 4).astype(np.float32)
    scores[0, 3] = -np.inf  # a suppressed stop id stays suppressed
    prompts = [rng.choice(vocab, 5).tolist() for _ in range(4)]
    outputs = [rng.choice(vocab, 9).tolist() for _ in range(4)]
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                             logit_bias={3: 5.0, 7: -2.5}),
              SamplingParams(repetition_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(),  # processes nothing: its (stale) history must not touch it
              SamplingParams(presence_penalty=-1.0, logit_bias={0: 100.0}, allowed_token_ids=[0, 5, 7])]
    history = penalties.build_reset([(p, o, q.logit_bias, q.allowed_token_ids)
                                     for p, o, q in zip(prompts, outputs, params)], 4, 16)
    rows = penalties.reset(penalties.allocate(5, vocab), jnp.arange(4), history)
    rows = penalties.rows_of(rows, jnp.arange(4))
    column = lambda name: jnp.array([getattr(q, name) for q in params], jnp.float32)  # noqa: E731
    got = np.asarray(jax.jit(penalties.apply)(
        scores, rows, repetition=column("repetition_penalty"), frequency=column("frequency_penalty"),
        presence=column("presence_penalty"),
        processed=jnp.array([q.processes_logits for q in params])))
    for i in (0, 1, 3):
        np.testing.assert_allclose(got[i], np_penalize(scores[i], prompts[i], outputs[i], params[i]),
                                   rtol=1e-6, err_msg=f"row {i}")
    assert got[0, 3] == -np.inf and not np.array_equal(got[0], scores[0])
    assert np.flatnonzero(np.isfinite(got[3])).tolist() == [0, 5, 7]  # allowed_token_ids
    assert got[2].tobytes() == scores[2].tobytes()


def test_reset_writes_only_the_starting_rows_slots_and_record_counts():
    stale = jax.tree.map(lambda a: jnp.ones_like(a), penalties.allocate(5, 16))
    start = penalties.build_reset([None, ([1, 2, 2], [3, 3, 4], ((5, 1.5),), None)], 3, 8)
    slots = jnp.array([0, 2, 4])  # row 1 owns slot 2; the padding row the spare slot 4
    history = penalties.reset(stale, slots, start)
    counts, seen, bias = (np.asarray(a) for a in (history.counts, history.prompt_seen, history.bias))
    assert counts[2].tolist() == [0, 0, 0, 2, 1] + [0] * 11
    assert np.flatnonzero(seen[2]).tolist() == [1, 2]
    assert np.flatnonzero(bias[2]).tolist() == [5] and bias[2, 5] == 1.5
    for slot in (0, 1, 3):  # not starting: untouched
        assert counts[slot].tolist() == [1] * 16 and seen[slot].all() and (bias[slot] == 1).all()
    counted = np.asarray(penalties.record(history, jnp.array([2, 4]), jnp.array([3, 9])).counts)
    assert counted[2, 3] == 3 and counted[4, 9] == counts[4, 9] + 1
    assert (np.delete(counted, [2, 4], axis=0) == np.delete(counts, [2, 4], axis=0)).all()
    with pytest.raises(ValueError, match="row 0: 9 tokens of history exceed the context of 8"):
        penalties.build_reset([([1] * 5, [2] * 4, (), None)], 1, 8)


def test_sample_with_16_bit_logits_argmaxes_in_f32_and_draws_the_rounded_result():
    """bf16 logits: a processed greedy row takes the f32 argmax of its penalized logits; a
    processed drawing row draws what the sampler draws from those logits rounded to bf16; an
    unprocessed row samples what it samples without histories."""
    from loopjax.sampling import SamplingBatch, sample

    rng = np.random.default_rng(1)
    vocab = 512
    logits = jnp.asarray(rng.standard_normal((3, vocab)) * 3, jnp.bfloat16)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7, frequency_penalty=0.9),
              SamplingParams(temperature=0.7, seed=5, presence_penalty=1.5, logit_bias={9: 4.0}),
              SamplingParams(temperature=0.7, seed=6)]
    prompt, outputs = [int(i) for i in np.argsort(-np.asarray(logits[0], np.float32))[:6]], [3, 9, 9]
    start = penalties.build_reset([(prompt, outputs, q.logit_bias, None) for q in params], 3, 16)
    rows = penalties.rows_of(penalties.reset(penalties.allocate(4, vocab), jnp.arange(3), start),
                             jnp.arange(3))
    batch = SamplingBatch.from_params(params, 3, [3, 3, 3])
    tokens = np.asarray(sample(logits, batch, num_top_logprobs=0, history=rows)[0])
    f32 = np.asarray(logits, np.float32)
    assert tokens[0] == np.argmax(np_penalize(f32[0], prompt, outputs, params[0]))
    assert tokens[0] != np.argmax(f32[0])  # its prompt's best tokens are penalized
    rounded = jnp.asarray(np.stack([f32[0], np_penalize(f32[1], prompt, outputs, params[1]), f32[2]]),
                          jnp.bfloat16)
    plain = np.asarray(sample(rounded, batch, num_top_logprobs=0)[0])
    assert tokens[1:].tolist() == plain[1:].tolist()


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def model():
    return loopjax.load(OURO)


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, CONFIG)


def reference_tokens(model, prompt, params: SamplingParams):
    """The request's tokens from the identity forward (one sequence, no cache), each step's last
    logits through np_penalize, then the argmax or the seeded Gumbel draw the sampler makes
    (no filters): argmax(x / t + gumbel(fold_in(key(seed), index)))."""
    width = CONFIG.max_context_len  # one padded length: one compile (the model is causal)
    tokens: list[int] = []
    for index in range(params.max_tokens):
        ids = list(prompt) + tokens
        logits = np.asarray(forward(model, ids + [0] * (width - len(ids))).logits)[len(ids) - 1]
        x = np_penalize(logits, prompt, tokens, params)
        if not params.is_greedy:
            key = jax.random.fold_in(jax.random.key(params.seed, impl="threefry2x32"), index)
            x = x / np.float32(params.temperature) + np.asarray(jax.random.gumbel(key, x.shape, jnp.float32))
        tokens.append(int(np.argmax(x)))
    return tokens


def test_engine_tokens_equal_the_penalized_reference_through_preemption(model, engine):
    ref = np.load(f"{OURO}/reference_fp32.npz")
    p0, p1, p2 = (ref[f"{k}_input_ids"].tolist() for k in ("p0", "p1", "p2"))
    golden = {k: ref[f"{k}_greedy_tokens"].tolist() for k in ("p0", "p1", "p2")}
    requests = {  # the last admitted is preempted, with outputs whose history it must restore
        "plain": (p2, greedy(20)),
        "frequency": (p1, greedy(20, frequency_penalty=1.5, presence_penalty=0.5,
                                  logit_bias={golden["p1"][3]: 3.0})),
        "drawn": (p0, SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True,
                                     repetition_penalty=1.3, presence_penalty=0.4)),
        "repetition": (p2, greedy(20, repetition_penalty=1.2)),
    }
    compiled, preemptions = engine.runner.compilations, engine.stats()["preemptions"]
    finals = run_all(engine, {0: [(prompt, params, rid) for rid, (prompt, params) in requests.items()]})
    assert engine.stats()["preemptions"] > preemptions
    assert engine.runner.compilations == compiled
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"]
    assert len(engine._free_token_slots) == engine.runner.max_rows
    tokens = {rid: list(out.token_ids) for rid, out in finals.items()}
    assert tokens["plain"] == golden["p2"][:20]  # unprocessed beside them: its golden tokens
    for rid in ("repetition", "frequency"):
        assert tokens[rid] != golden["p2" if rid == "repetition" else "p1"][:20], rid
    for rid in ("repetition", "frequency", "drawn"):
        assert tokens[rid] == reference_tokens(model, *requests[rid]), rid
    # The draw depends on the request alone (seed, token index, its own history), not the batch.
    alone = run_all(engine, {0: [(*requests["drawn"], "drawn")]})
    assert list(alone["drawn"].token_ids) == tokens["drawn"]


def test_penalties_after_a_prefix_cache_hit_and_in_each_of_n_samples(model, engine):
    """A request whose prompt pages come from the prefix cache still penalizes its whole
    prompt (its history is the prompt, not the tokens it computed), and each of n samples
    (fan_out: its own seed and token slot) follows its own history."""
    prompt = np.load(f"{OURO}/reference_fp32.npz")["p2_input_ids"].tolist()  # 17 tokens: 2 full pages
    params = SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=5, ignore_eos=True,
                            repetition_penalty=1.5, presence_penalty=1.0)
    samples = params.fan_out()
    run_all(engine, {0: [(prompt, greedy(1), "warm")]})  # publishes the prompt's pages
    hits = engine.stats()["prefix_cache_hit_tokens"]
    finals = run_all(engine, {0: [(prompt, q, f"s{i}") for i, q in enumerate(samples)]})
    assert engine.stats()["prefix_cache_hit_tokens"] - hits == 2 * 16
    tokens = [list(finals[f"s{i}"].token_ids) for i in range(2)]
    assert tokens[0] != tokens[1]
    for got, q in zip(tokens, samples):
        assert got == reference_tokens(model, prompt, q)


def test_allowed_token_ids_mask_every_other_token(model, engine):
    """allowed_token_ids (vLLM's): only those tokens come out, greedy or drawn, each the
    reference's choice among them with their bias added (a bias on another id unmasks
    nothing); refused past the vocabulary, or when min_tokens suppresses every allowed id."""
    prompt = np.load(f"{OURO}/reference_fp32.npz")["p0_input_ids"].tolist()
    allowed = [5, 17, 40, 77, 130]
    requests = {"greedy": (prompt, greedy(10, allowed_token_ids=allowed, logit_bias={17: 1.0, 99: 50.0})),
                "drawn": (prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True,
                                                 allowed_token_ids=allowed))}
    finals = run_all(engine, {0: [(p, params, rid) for rid, (p, params) in requests.items()]})
    for rid, (p, params) in requests.items():
        tokens = list(finals[rid].token_ids)
        assert set(tokens) <= set(allowed) and tokens == reference_tokens(model, p, params), rid
    assert len(set(finals["drawn"].token_ids)) > 1
    assert len(engine._free_token_slots) == engine.runner.max_rows
    with pytest.raises(ValueError, match="^allowed_token_ids token id 256 is outside the vocabulary of 256$"):
        engine.add_request(prompt, greedy(4, allowed_token_ids=[3, 256]))
    with pytest.raises(ValueError, match="^allowed_token_ids holds only stop token ids"):  # 2: EOS
        engine.add_request(prompt, SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[2]))
    assert not engine.has_unfinished()


def test_engine_refuses_a_bias_outside_the_vocabulary(engine):
    with pytest.raises(ValueError, match="^logit_bias token id 256 is outside the vocabulary of 256$"):
        engine.add_request([1, 2, 3], greedy(4, logit_bias={256: 1.0}))
    assert not engine.has_unfinished()


def test_min_tokens_holds_back_a_biased_eos_and_logprobs_stay_the_models(model, engine):
    """A bias of 100 on EOS (2) makes it every token's choice: min_tokens=3 holds it back for 3
    tokens, then it ends the output ('stop', no stop_reason: an EOS); with ignore_eos it is
    generated to max_tokens. The logprobs are the model's (log_softmax of the forward's
    logits, vLLM's raw logprobs), not the biased distribution's (where EOS holds ~all mass)."""
    prompt = np.load(f"{OURO}/reference_fp32.npz")["p0_input_ids"].tolist()
    held = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=3, logit_bias={2: 100.0}, logprobs=1)
    finals = run_all(engine, {0: [(prompt, held, "held"),
                                  (prompt, greedy(4, logit_bias={2: 100.0}), "ignored")]})
    out = finals["held"]
    assert 2 not in out.token_ids[:3] and out.token_ids[3] == 2 and len(out.token_ids) == 4
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert list(finals["ignored"].token_ids) == [2] * 4 and finals["ignored"].finish_reason == "length"
    ids = prompt + list(out.token_ids[:3])
    logits = np.asarray(forward(model, ids + [0] * (CONFIG.max_context_len - len(ids))).logits)[len(ids) - 1]
    want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    np.testing.assert_allclose(out.logprobs[3], want[2], atol=1e-4)
    assert out.logprobs[3] < -1
    assert out.top_logprobs[3][0] == (int(np.argmax(want)), pytest.approx(want.max(), abs=1e-4))
