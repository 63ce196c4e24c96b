"""SamplingParams validation / OpenAI mapping, and on-device sampling semantics."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopjax.sampling import (
    TOP_K_CAP,
    SamplingBatch,
    check_suppressible,
    filter_threshold,
    row_keys,
    sample,
    sort_descending,
    top_k,
)
from loopjax.sampling_params import SamplingParams, listed_rank

_sample = jax.jit(sample, static_argnames=("num_top_logprobs", "greedy"))
_filter_threshold = jax.jit(filter_threshold)


def run(logits, params, steps=None, num_rows=None, k=0):
    """Sample rows of `logits` [n, V] with `params`; returns numpy outputs of the real rows.

    To bound compilations, rows are padded (greedy padding rows) to a power of two >= 8 and
    the vocabulary with -inf columns to 64 or 1024, which changes no token or logprob."""
    logits = np.asarray(logits, np.float32)
    n, vocab = logits.shape
    rows = max(8, 1 << (max(n, num_rows or 0) - 1).bit_length())
    padded = np.full((rows, 64 if vocab <= 64 else 1024), -np.inf, np.float32)
    padded[:, :vocab] = 0.0
    padded[:n, :vocab] = logits
    batch = SamplingBatch.from_params(params, rows, steps or [0] * n)
    out = _sample(jnp.asarray(padded), batch, num_top_logprobs=k)
    return [np.asarray(o)[:n] for o in out]


def kept_set(logits_row, **kw):
    """Indices the filter keeps for one row sampled with SamplingParams(**kw)."""
    p = SamplingParams(**kw)
    batch = SamplingBatch.from_params([p], 1, [0])
    scaled = jnp.asarray(np.asarray(logits_row, np.float32)[None] / p.temperature)
    thr = _filter_threshold(scaled, sort_descending(scaled), batch, jnp.asarray([False]))
    return set(np.nonzero(np.asarray(scaled >= thr)[0])[0].tolist())


PROBS = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))  # distinct, known mass


# ------------------------------------------------------------------ greedy

def test_greedy_is_argmax_first_index_on_ties():
    logits = np.array([[1, 3, 3, 0], [5, 5, 5, 5], [0, 0, 0, 7]], np.float32)
    tokens, *_ = run(logits, [SamplingParams(temperature=0.0)] * 3)
    assert tokens.tolist() == [1, 0, 3]
    rnd = np.random.default_rng(0).normal(size=(6, 50)).astype(np.float32)
    tokens, *_ = run(rnd, [SamplingParams(temperature=0.0, seed=i) for i in range(6)])
    np.testing.assert_array_equal(tokens, rnd.argmax(-1))


def test_greedy_rows_match_between_greedy_and_mixed_batches():
    """A greedy row's token and logprobs do not depend on whether another row samples (all-greedy
    and mixed batches take the same branch-free program), and the sampled row draws as alone."""
    logits = np.random.default_rng(7).normal(size=(6, 1024)).astype(np.float32)
    greedy = [SamplingParams(temperature=0.0)] * 6
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    all_greedy = run(logits, greedy, k=2)
    mixed = run(logits, greedy[:5] + [sampled], steps=[0] * 5 + [4], k=2)
    for a, b in zip(all_greedy, mixed):
        np.testing.assert_array_equal(a[:5], b[:5])
    np.testing.assert_array_equal(all_greedy[0], logits.argmax(-1))
    alone, *_ = run(logits[5:], [sampled], steps=[4])
    assert mixed[0][5] == alone[0]
    assert mixed[0][5] != logits[5].argmax()  # this seed draws off the argmax: the row did sample


def test_sampling_has_no_device_conditional():
    # XLA:GPU reads a cond / switch predicate back to the host mid-step.
    batch = SamplingBatch.from_params([SamplingParams(temperature=1.0, top_p=0.5)], 4, [0])
    jaxpr = str(jax.make_jaxpr(lambda x: sample(x, batch, num_top_logprobs=1))(jnp.zeros((4, 64))))
    assert " cond[" not in jaxpr and "switch" not in jaxpr


def test_temperature_to_zero_limit_equals_greedy():
    rnd = np.random.default_rng(1).permutation(64).astype(np.float32)[None].repeat(8, 0) * 0.5
    rnd += np.arange(8, dtype=np.float32)[:, None]  # same order per row, gaps of 0.5: 50 at t = 0.01
    params = [SamplingParams(temperature=0.01, seed=s) for s in range(8)]
    tokens, *_ = run(rnd, params, steps=list(range(8)))
    np.testing.assert_array_equal(tokens, rnd.argmax(-1))


def test_a_tiny_positive_temperature_is_raised_to_vllms_floor_and_drawn():
    """vLLM raises a temperature in (0, 0.01) to 0.01 (its guard against overflow): 1e-6 draws
    at 0.01, not greedy (it was greedy below 1e-5, drawn at its own value up to 0.01); from
    tied logits the draws spread, where a greedy row takes the first index."""
    tiny = [9.9999999e-6, 1e-6, 5e-3, 1e-9] * 2
    params = [SamplingParams(temperature=t, seed=s) for s, t in enumerate(tiny)]
    assert all(p.temperature == 0.01 and not p.is_greedy for p in params)
    assert SamplingParams(temperature=0.0).is_greedy and SamplingParams(temperature=0.02).temperature == 0.02
    tokens, *_ = run(np.zeros((8, 8), np.float32), params)
    assert len(set(tokens.tolist())) > 1


def test_top_k_one_equals_greedy():
    rnd = np.random.default_rng(2).normal(size=(8, 64)).astype(np.float32)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(8)]
    tokens, *_ = run(rnd, params, steps=[3] * 8)
    np.testing.assert_array_equal(tokens, rnd.argmax(-1))


# ------------------------------------------------------------------ reproducibility

def test_same_seed_same_tokens_whatever_batch_composition():
    rng = np.random.default_rng(3)
    vocab = 64
    reqs = {  # request -> (params, its logits, token index)
        "a": (SamplingParams(temperature=1.0, seed=11), rng.normal(size=vocab), 0),
        "b": (SamplingParams(temperature=0.8, top_k=5, seed=12), rng.normal(size=vocab), 4),
        "c": (SamplingParams(temperature=1.2, top_p=0.7, seed=13), rng.normal(size=vocab), 9),
        "d": (SamplingParams(temperature=0.0), rng.normal(size=vocab), 2),
        "e": (SamplingParams(temperature=1.0, min_p=0.1, top_k=3 * TOP_K_CAP, seed=2**40 + 5),
              rng.normal(size=vocab), 1),
    }

    def tokens_of(order, num_rows):
        tok, *_ = run(np.stack([reqs[r][1] for r in order]), [reqs[r][0] for r in order],
                      steps=[reqs[r][2] for r in order], num_rows=num_rows)
        return dict(zip(order, tok.tolist()))

    # "b" alone takes the top-k-cap branch; with "c" or "e" the batch takes the full sort.
    results = [tokens_of("abcde", 8), tokens_of("edcba", 8), tokens_of("b", 8),
               tokens_of("ca", 4), tokens_of("dbe", 4), tokens_of("abcdedcba", 16)]
    for name in reqs:
        seen = {res[name] for res in results if name in res}
        assert len(seen) == 1, (name, results)
    assert results[0]["d"] == int(np.argmax(reqs["d"][1]))  # greedy row inside a sampled batch


def test_token_index_and_seed_change_the_draw():
    logits = np.zeros((64, 1024), np.float32)  # uniform: draws are all noise
    same = [SamplingParams(temperature=1.0, seed=7)] * 64
    by_step, *_ = run(logits, same, steps=list(range(64)))
    assert len(set(by_step.tolist())) > 40
    by_seed, *_ = run(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(64)])
    assert len(set(by_seed.tolist())) > 40
    again, *_ = run(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(64)])
    np.testing.assert_array_equal(by_seed, again)


def test_row_key_is_fold_in_of_seed_and_token_index():
    params = [SamplingParams(seed=5), SamplingParams(seed=123456)]
    keys = row_keys(SamplingBatch.from_params(params, 3, [0, 17]))
    for i, (seed, t) in enumerate([(5, 0), (123456, 17)]):
        want = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), t)
        np.testing.assert_array_equal(jax.random.key_data(keys[i]), jax.random.key_data(want))


def test_from_params_pads_with_greedy_rows_and_checks_sizes():
    b = SamplingBatch.from_params([SamplingParams(temperature=0.5, top_k=-1, seed=-2)], 4, [3])
    assert b.temperature.tolist() == [0.5, 0, 0, 0] and b.top_k.tolist() == [0, 0, 0, 0]
    assert b.token_index.tolist() == [3, 0, 0, 0]
    assert b.seed[0].tolist() == [0xFFFFFFFF, 0xFFFFFFFE]  # -2 wraps mod 2**64
    with pytest.raises(ValueError, match="num_rows"):
        SamplingBatch.from_params([SamplingParams()] * 2, 1, [0, 0])
    with pytest.raises(ValueError, match="step_counts"):
        SamplingBatch.from_params([SamplingParams()], 2, [])


# ------------------------------------------------------------------ filters

@pytest.mark.parametrize("kw, want", [
    (dict(top_p=0.35), {0}),
    (dict(top_p=0.5), {0, 1}),
    (dict(top_p=0.75), {0, 1, 2}),
    (dict(top_p=0.95), {0, 1, 2, 3}),
    (dict(top_p=0.8, temperature=0.5), {0, 1}),  # p^2 / sum: .533 .3 .133 .033
    (dict(top_k=2), {0, 1}),
    (dict(top_k=2, top_p=0.5), {0}),  # renormalised over the top 2: .571 .429
    (dict(top_k=2, top_p=0.6), {0, 1}),
    (dict(top_k=3 * TOP_K_CAP), {0, 1, 2, 3}),  # k >= V is off
    (dict(min_p=0.6), {0, 1}),  # p >= 0.24
    (dict(min_p=0.3), {0, 1, 2}),  # p >= 0.12
    (dict(min_p=0.2), {0, 1, 2, 3}),
    (dict(min_p=0.6, temperature=2.0), {0, 1, 2}),  # sqrt(p): .632 .548 .447 .316
    (dict(top_p=0.95, min_p=0.6), {0, 1}),
    # min-p before top-p (vLLM's order): top-p renormalises over min-p's survivors .571 .429 (it
    # was top-p over all four, the mass before .3 being .4 < .55: both kept)
    (dict(top_p=0.55, min_p=0.6), {0}),
    (dict(top_k=3, top_p=0.55, min_p=0.6), {0}),
    (dict(top_k=1, min_p=0.3), {0}),
    (dict(), {0, 1, 2, 3}),
])
def test_filters_keep_exactly_the_right_set(kw, want):
    kw.setdefault("temperature", 1.0)
    order = np.array([2, 0, 3, 1])  # shuffle so the kept set is not a prefix of the ids
    got = kept_set(PROBS[order], **kw)
    assert {int(order[i]) for i in got} == want


def test_ties_at_the_boundary_are_kept():
    logits = np.log(np.array([0.5, 0.2, 0.2, 0.1], np.float32))
    assert kept_set(logits, top_k=2) == {0, 1, 2}


def test_top_p_renormalises_over_every_top_k_survivor_ties_included():
    # top_k=2 keeps 0 and the three ids tied at the 2nd value (probs 1/2, 1/6, 1/6, 1/6 once
    # renormalised, as HF's TopK / TopP warpers and vLLM's mask give): top_p=0.6 keeps them all.
    # Renormalised over the first k sorted entries only, id 0 would hold 3/4 and stand alone.
    logits = np.log(np.array([3.0, 1.0, 1.0, 1.0, 0.5], np.float32))
    assert kept_set(logits, top_k=2, top_p=0.6) == {0, 1, 2, 3}
    assert kept_set(logits, top_k=2, top_p=0.5) == {0}
    wide = np.tile(logits, 100)  # top_k > TOP_K_CAP: the full-sort path (400 survivors)
    assert kept_set(wide, top_k=200, top_p=0.6) == set(np.nonzero(wide >= 0)[0].tolist())


def test_top_p_one_never_drops_a_rounded_tail():
    logits = -np.arange(2 * TOP_K_CAP, dtype=np.float32)  # mass reaches 1.0 in f32 early
    assert kept_set(logits, top_k=TOP_K_CAP) == set(range(TOP_K_CAP))
    assert kept_set(logits, top_p=1.0) == set(range(2 * TOP_K_CAP))


def test_unfiltered_rows_keep_the_whole_vocab_beside_a_top_k_row():
    # The top-k row sends the batch down the lax.top_k(TOP_K_CAP) branch; the other rows
    # must still draw from all 1024 ids: about half their mass lies outside their top 128.
    params = [SamplingParams(temperature=1.0, top_k=5, seed=0)]
    params += [SamplingParams(temperature=1.0, seed=s) for s in range(1, 33)]
    logits = np.random.default_rng(5).normal(size=(33, 1024)).astype(np.float32)
    tokens, *_ = run(logits, params)
    rank = (logits > logits[np.arange(33), tokens][:, None]).sum(-1)  # 0 = the row's argmax
    assert rank[0] < 5 and rank[1:].max() >= TOP_K_CAP


def test_sampled_tokens_stay_inside_the_filter():
    logits = np.tile(PROBS, (64, 1))
    for kw, allowed in [(dict(top_p=0.5), {0, 1}), (dict(top_k=1), {0}), (dict(min_p=0.6), {0, 1})]:
        params = [SamplingParams(temperature=1.0, seed=s, **kw) for s in range(64)]
        tokens, *_ = run(logits, params)
        assert set(tokens.tolist()) == allowed, kw


def np_kept(x, p: SamplingParams):
    """vLLM's filters in numpy (f64) over one row's logits x: temperature, min-p, top-k over its
    survivors (ties with the k-th kept), top-p over the min-p and top-k survivors renormalised
    (a token stays iff the mass before it is < top_p; ties with the last kept stay); the mask."""
    x = x.astype(np.float64) / p.temperature
    keep = x >= x.max() + np.log(p.min_p) if p.min_p > 0 else np.ones(len(x), bool)
    if 0 < p.top_k < keep.sum():
        keep &= x >= np.sort(np.where(keep, x, -np.inf))[::-1][p.top_k - 1]
    if p.top_p < 1:
        vals = np.where(keep, x, -np.inf)
        order = np.argsort(-vals, kind="stable")
        probs = np.exp(vals[order] - vals.max())
        probs /= probs.sum()
        kept = max(1, int((np.cumsum(probs) - probs < p.top_p).sum()))
        keep &= x >= vals[order][kept - 1]
    return keep


def test_tokens_equal_a_numpy_reference_of_the_filters_and_the_draw():
    """Random mixed batches (greedy, top-k under and over TOP_K_CAP, top-p, min-p, ties): each
    token is the numpy reference's argmax(kept logits / t + the row's Gumbel noise)."""
    rng = np.random.default_rng(11)
    noise_of = jax.jit(jax.vmap(lambda k: jax.random.gumbel(k, (1024,), jnp.float32)))
    for trial in range(12):
        logits = (rng.standard_normal((8, 700)) * rng.choice([0.5, 2.0, 5.0])).astype(np.float32)
        if trial % 3 == 0:
            logits = np.round(logits * 2) / 2  # many ties
        params = []
        for _ in range(8):
            kw = dict(temperature=float(rng.choice([0.0, 0.3, 1.0, 1.7])), seed=int(rng.integers(2**40)))
            if rng.random() < 0.5:
                kw["top_k"] = int(rng.choice([1, 3, 50, 200, 600, -1]))
            if rng.random() < 0.5:
                kw["top_p"] = float(rng.choice([0.1, 0.5, 0.9, 0.99]))
            if rng.random() < 0.3:
                kw["min_p"] = float(rng.choice([0.01, 0.1, 0.5]))
            params.append(SamplingParams(**kw))
        steps = rng.integers(0, 50, 8).tolist()
        tokens, *_ = run(logits, params, steps=steps)
        noise = np.asarray(noise_of(row_keys(SamplingBatch.from_params(params, 8, steps))))[:, :700]
        for i, p in enumerate(params):
            if p.is_greedy:  # NOTE: temperature 0: no filters (they would divide by it)
                assert tokens[i] == np.argmax(logits[i]), (trial, i, p)
                continue
            kept = np.where(np_kept(logits[i], p), logits[i] / np.float32(p.temperature), -np.inf)
            want = np.argmax(kept.astype(np.float32) + noise[i])
            assert tokens[i] == want, (trial, i, p)


@pytest.mark.parametrize("kw", [dict(temperature=0.7), dict(temperature=1.3, top_k=3)])
def test_empirical_distribution_matches_softmax(kw):
    logits = np.array([1.0, 0.2, -0.5, 0.8, -1.5], np.float32)
    n = 4000
    params = [SamplingParams(seed=s % 97, **kw) for s in range(n)]
    tokens, *_ = run(np.tile(logits, (n, 1)), params, steps=[s // 97 for s in range(n)])
    scaled = logits / kw["temperature"]
    if "top_k" in kw:
        scaled = np.where(scaled >= np.sort(scaled)[-kw["top_k"]], scaled, -np.inf)
    want = np.exp(scaled - scaled.max())
    want /= want.sum()
    freq = np.bincount(tokens, minlength=5) / n
    np.testing.assert_allclose(freq, want, atol=0.03)  # ~4 standard deviations
    assert freq[want == 0].sum() == 0


@pytest.mark.parametrize("vocab, k", [(3000, 20), (4096, 17), (3000, 5), (700, 20)])
def test_top_k_equals_lax_top_k_ties_included(vocab, k):
    """sampling.top_k (two stages above TWO_STAGE_MIN_K over more than a chunk, the vocabulary
    padded to whole chunks) gives lax.top_k's values and ids, equal values lowest id first."""
    rng = np.random.default_rng(vocab + k)
    x = np.round(rng.normal(size=(3, vocab)) * 3).astype(np.float32)  # many ties
    x[1, ::7] = -np.inf
    x[2] = 1.0  # every value tied
    got = jax.jit(top_k, static_argnums=1)(jnp.asarray(x), k)
    want = jax.lax.top_k(jnp.asarray(x), k)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(got[1])[2], np.arange(k))


def test_logprobs_are_log_softmax_of_raw_logits():
    rnd = np.random.default_rng(4).normal(size=(5, 40)).astype(np.float32) * 3
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0, 0.5, 1, 1.5, 2])]
    tokens, lp, top_ids, top_lp, ranks = run(rnd, params, k=4)
    ref = rnd - np.log(np.exp(rnd).sum(-1, keepdims=True))
    np.testing.assert_allclose(lp, ref[np.arange(5), tokens], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-rnd, axis=-1)[:, :4])
    np.testing.assert_allclose(top_lp, np.sort(ref, axis=-1)[:, ::-1][:, :4], rtol=1e-5, atol=1e-5)
    assert top_ids.dtype == np.int32 and tokens.dtype == np.int32
    assert tokens[0] == rnd[0].argmax()  # the greedy row of a mixed batch
    # the rank: 1 + the tokens more likely than the chosen one (the greedy row's is 1)
    np.testing.assert_array_equal(ranks, 1 + (rnd > rnd[np.arange(5), tokens][:, None]).sum(-1))
    assert ranks[0] == 1 and ranks.max() > 1 and ranks.dtype == np.int32
    _, _, none_ids, none_lp, _ = run(rnd, params, k=0)
    assert none_ids.shape == (5, 0) and none_lp.shape == (5, 0)
    batch = SamplingBatch.from_params(params, 5, [0] * 5)
    with pytest.raises(ValueError, match=r"num_top_logprobs must be in \[0, 40\], got 41"):
        sample(jnp.asarray(rnd), batch, num_top_logprobs=41)


def test_a_token_tied_with_others_ranks_last_of_the_tie_as_vllm_ranks_it():
    """The sampled token's rank counts the log-probs >= its own (vLLM's rule, in both samplers):
    a greedy pick tied with two others ranks 3 over the vocabulary, 1 as listed first in its top
    logprobs (`listed_rank`: vLLM's top entries overwrite its own); a lone argmax ranks 1."""
    logits = np.zeros((2, 16), np.float32)
    logits[0, [4, 9, 11]] = 5.0
    logits[1, 6] = 5.0
    greedy = [SamplingParams(temperature=0.0)] * 2
    tokens, _, top_ids, _, ranks = run(logits, greedy, k=2)
    assert tokens.tolist() == [4, 6] and ranks.tolist() == [3, 1] and top_ids[0].tolist() == [4, 9]
    batch = SamplingBatch.from_params(greedy, 2, [0, 0])
    only_greedy = _sample(jnp.asarray(logits), batch, num_top_logprobs=0, greedy=True)
    assert np.asarray(only_greedy[-1]).tolist() == [3, 1]
    assert listed_rank(4, 3, [(4, -1.1), (9, -1.1)]) == 1 and listed_rank(11, 3, [(4, -1.1), (9, -1.1)]) == 3


# ------------------------------------------------------------------ SamplingParams

def test_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, stop=["a"], stop_token_ids=[2], exit_trace=[1, 2])
    assert p.top_k == 0 and p.stop == ("a",) and p.stop_token_ids == (2,) and p.exit_trace == (1, 2)
    assert SamplingParams(stop="\n").stop == ("\n",)  # one string, as vLLM takes it
    assert isinstance(p.seed, int) and 0 <= p.seed < 2**31
    assert SamplingParams().seed != SamplingParams().seed  # drawn, 1 in 2**31 to collide
    assert dataclasses.replace(p, top_p=0.5).seed == p.seed  # the recorded seed is kept
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    hash(p)


def test_none_stop_lists_are_empty_as_vllm_takes_them():
    """vLLM's stop, stop_token_ids and bad_words default to None (none): code written for it
    passes None; it was refused ("stop must be a list of strings, got None")."""
    p = SamplingParams(stop=None, stop_token_ids=None, bad_words=None)
    assert (p.stop, p.stop_token_ids, p.bad_words) == ((), (), ())


@pytest.mark.parametrize("kw, msg", [
    (dict(temperature=-1), "temperature must be in [0, 2.0], got -1"),
    (dict(temperature=2.5), "temperature must be in [0, 2.0], got 2.5"),
    (dict(temperature="hot"), "temperature must be a number in [0, 2.0], got 'hot'"),
    (dict(temperature=float("nan")), "temperature must be a number in [0, 2.0], got nan"),
    (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=2.0), "max_tokens must be an integer >= 1, got 2.0"),
    (dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    (dict(top_p=0), "top_p must be in (0, 1], got 0"),
    (dict(top_p=1.1), "top_p must be in (0, 1], got 1.1"),
    (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
    (dict(top_k=-2), "top_k must be >= -1, got -2"),
    (dict(logprobs=21), "logprobs must be in [0, 20], got 21"),
    (dict(logprobs=-1), "logprobs must be in [0, 20], got -1"),
    (dict(seed=2**64), "seed must be in"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(stop_token_ids=[-3]), "every stop_token_ids entry must be >= 0, got -3"),
    (dict(stop=5), "stop must be a list of strings"),
    (dict(stop=""), "every stop entry must be a non-empty string"),
    (dict(stop=[""]), "every stop entry must be a non-empty string"),
    (dict(detokenize=1), "detokenize must be true or false"),
    (dict(stop=["a"], detokenize=False), "stop strings need detokenize=True"),
    (dict(ignore_eos=1), "ignore_eos must be true or false"),
    (dict(skip_special_tokens="no"), "skip_special_tokens must be true or false, got 'no'"),
    (dict(spaces_between_special_tokens=0), "spaces_between_special_tokens must be true or false, got 0"),
    (dict(loops=0), "loops must be >= 1, got 0"),
    (dict(exit_mode="fast"), "exit_mode must be one of select, skip, got 'fast'"),
    (dict(exit_criterion="kld"), "exit_criterion must be one of kl, entropy-diff, latent-diff, "
                                 "argmax-stability, cosine, minp-kl (or unset), got 'kld'"),
    (dict(exit_threshold=1.5), "exit_threshold must be in [0, 1], got 1.5"),
    (dict(exit_threshold=-1, exit_criterion="kl"), "exit_threshold must be in [0, inf], got -1"),
    (dict(exit_min_loops=0), "exit_min_loops must be >= 1, got 0"),
    (dict(exit_min_loops=5, loops=4), "exit_min_loops must be in [1, 4], got 5"),
    (dict(exit_check_every=0), "exit_check_every must be >= 1, got 0"),
    (dict(exit_check_every=2), "exit_min_loops and exit_check_every pace the checks of an exit_criterion"),
    (dict(exit_in_prefill=False), "exit_in_prefill=False keeps an exit_criterion (Huginn) out of the prompt"),
    (dict(exit_in_prefill=0, exit_criterion="kl"), "exit_in_prefill must be true or false, got 0"),
    (dict(exit_trace=[1, 0]), "every exit_trace entry must be >= 1, got 0"),
    (dict(exit_trace=[1, 5], loops=4), "every exit_trace entry must be in [1, 4], got 5"),
    (dict(exit_trace=[]), "exit_trace must list at least one loop count"),
    (dict(exit_trace=[2], exit_criterion="kl"), "exit_trace and exit_criterion exclude each other"),
    # the engine took loop 1 (the weighted sum) whatever the threshold: refused, not ignored
    (dict(exit_step=1, exit_threshold=0.5), "exit_step and exit_threshold exclude each other"),
    (dict(exit_weighted=True, exit_threshold=0.5), "exit_weighted and exit_threshold exclude each other"),
    (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens (5) must not exceed max_tokens (4)"),
    (dict(repetition_penalty=-1.0), "repetition_penalty must be in [0.0001, 10000.0], got -1.0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a number in [0.0001, 10000.0]"),
    # f32 inf / 0 on the device, where 0 * inf is NaN: the logit-0 or the banned (-inf) token won
    (dict(repetition_penalty=1e39), "repetition_penalty must be in [0.0001, 10000.0], got 1e+39"),
    (dict(repetition_penalty=1e-50), "repetition_penalty must be in [0.0001, 10000.0], got 1e-50"),
    (dict(presence_penalty=-2.1), "presence_penalty must be in [-2.0, 2.0], got -2.1"),
    (dict(logit_bias={-1: 1.0}), "every logit_bias token id must be >= 0, got -1"),
    (dict(logit_bias={2: float("nan")}), "logit_bias[2] must be a number in [-100.0, 100.0], got nan"),
    (dict(logit_bias=[(1, 2.0), (1, 3.0)]), "logit_bias lists a token id twice"),
    (dict(logit_bias="5"), "logit_bias must map token ids to biases, got '5'"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1, got 0"),
    (dict(truncate_prompt_tokens=1.5), "truncate_prompt_tokens must be an integer >= 1, got 1.5"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must list 1 to 1024 token ids, got 0"),
    (dict(allowed_token_ids=[3, -1]), "every allowed_token_ids entry must be >= 0, got -1"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a list of integers, got 5"),
    (dict(allowed_token_ids=range(1025)), "allowed_token_ids must list 1 to 1024 token ids, got 1025"),
    (dict(allowed_token_ids=list(range(1025))), "allowed_token_ids must list 1 to 1024 token ids, got 1025"),
])
def test_bad_params_give_one_line_errors(kw, msg):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kw)
    assert str(err.value).startswith(msg) and "\n" not in str(err.value)


def test_max_tokens_none_means_up_to_the_context():
    """max_tokens=None (vLLM's default meaning) is kept, its budget the room the context leaves;
    an OpenAI body's explicit null max_tokens maps to it, an absent one to 16."""
    p = SamplingParams(max_tokens=None, min_tokens=50)
    assert p.max_tokens is None and p.output_budget(7) == 7
    assert SamplingParams(max_tokens=4).output_budget(7) == 4
    assert SamplingParams.from_openai({"max_tokens": None}).max_tokens is None
    assert SamplingParams.from_openai({"max_completion_tokens": None}).max_tokens is None
    assert SamplingParams.from_openai({}).max_tokens == 16


def test_vllms_no_seed_and_repeated_stop_ids():
    """vLLM's SamplingParams: seed=-1 is no seed (one is drawn; it was the seed 2**64 - 1), and a
    stop token id listed twice is one (it took two of min_tokens' suppressed ids)."""
    drawn = [SamplingParams(seed=-1) for _ in range(4)]
    assert all(p.seed_drawn and 0 <= p.seed < 2**31 for p in drawn) and len({p.seed for p in drawn}) > 1
    assert SamplingParams(seed=-2).seed == -2 and not SamplingParams(seed=-2).seed_drawn
    assert SamplingParams(stop_token_ids=[5, 3, 5, 3]).stop_token_ids == (5, 3)


def test_numpy_scalars_are_numbers():
    """numpy integers and reals (a loop variable, an array's item) are taken as Python's, stored
    as Python's (they were refused: "max_tokens must be an integer >= 1, got np.int64(5)")."""
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.uint64(2**64 - 1),
                       n=np.int32(2), loops=np.int8(3), stop_token_ids=[np.int64(7)],
                       exit_trace=(np.int16(2),), logit_bias={np.int64(4): np.float32(1.5)},
                       allowed_token_ids=[np.int64(4)])
    want = SamplingParams(max_tokens=5, temperature=0.5, seed=2**64 - 1, n=2, loops=3, stop_token_ids=[7],
                          exit_trace=(2,), logit_bias={4: 1.5}, allowed_token_ids=[4])
    assert p == want and type(p.max_tokens) is int and type(p.temperature) is float
    assert [s.seed for s in p.fan_out()] == [2**64 - 1, 0]  # Python's ints wrap as documented
    assert all(type(v) is int for v in (*p.stop_token_ids, *p.exit_trace, p.logit_bias[0][0]))
    with pytest.raises(ValueError, match="^ignore_eos must be true or false"):
        SamplingParams(ignore_eos=np.bool_(True))


def test_good_exit_settings():
    p = SamplingParams(loops=8, exit_mode="skip", exit_criterion="kl", exit_threshold=5e-4,
                       exit_min_loops=2, exit_check_every=2)
    assert (p.loops, p.exit_mode, p.exit_threshold) == (8, "skip", 5e-4)
    assert SamplingParams(exit_threshold=0.5).exit_threshold == 0.5


def test_from_openai_maps_fields():
    p = SamplingParams.from_openai({
        "model": "ouro", "prompt": "hi", "stream": False, "max_completion_tokens": 7,
        "temperature": 0.3, "top_p": 0.9, "seed": 42, "stop": "\n\n", "logprobs": True,
        "top_logprobs": 3, "top_k": 20, "min_p": 0.05, "loops": 4, "exit_mode": "skip",
        "exit_threshold": 0.5, "exit_trace": [1, 2], "n": 1, "presence_penalty": 0.5,
        "frequency_penalty": None, "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2.5},
        "user": "u",
    })
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (7, 0.3, 0.9, 42, ("\n\n",))
    assert (p.logprobs, p.top_k, p.min_p, p.loops, p.exit_mode) == (3, 20, 0.05, 4, "skip")
    assert p.exit_trace == (1, 2) and p.exit_threshold == 0.5
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.0, 1.2)
    assert p.logit_bias == ((3, 2.5), (7, -100.0)) and p.processes_logits and not p.is_plain_greedy
    q = SamplingParams.from_openai({"max_tokens": 5, "stop": ["a", "b"], "logprobs": 2})
    assert (q.max_tokens, q.stop, q.logprobs) == (5, ("a", "b"), 2)
    assert SamplingParams.from_openai({"logprobs": True}).logprobs == 0
    assert SamplingParams.from_openai({"logprobs": False}).logprobs is None
    assert SamplingParams.from_openai({}).max_tokens == 16
    assert SamplingParams.from_openai({"n": 3, "best_of": 3}).n == 3
    assert SamplingParams.from_openai({"min_tokens": 4, "max_tokens": 8}).min_tokens == 4
    # what clients send by default asks for nothing: accepted
    assert SamplingParams.from_openai({"response_format": {"type": "text"}, "tools": [],
                                       "tool_choice": "none", "parallel_tool_calls": False, "suffix": "",
                                       }).max_tokens == 16
    # ... and tool_choice "required" over no tools, which vLLM takes as "none" (it was refused)
    assert SamplingParams.from_openai({"tools": [], "tool_choice": "required"}).max_tokens == 16
    assert SamplingParams.from_openai({"bad_words": ["no", "yes"]}).bad_words == ("no", "yes")
    allowed = SamplingParams.from_openai({"allowed_token_ids": [9, 3, 9]})
    assert allowed.allowed_token_ids == (3, 9) and allowed.processes_logits and not allowed.is_plain_greedy


def test_fan_out_derives_one_seed_per_sample():
    params = SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=5)
    samples = params.fan_out()
    assert [p.seed for p in samples] == [7, 8, 9] and all(p.n == 1 for p in samples)
    assert all(dataclasses.replace(p, seed=7) == dataclasses.replace(params, n=1) for p in samples)
    assert SamplingParams(seed=7).fan_out() == [SamplingParams(seed=7)]  # n=1: the request itself
    top = SamplingParams(n=2, seed=2**64 - 1).fan_out()  # wraps: the device keys seeds mod 2**64
    assert [p.seed for p in top] == [2**64 - 1, 0]
    drawn = SamplingParams(n=2).fan_out()  # no seed given: one drawn, then seed + i
    assert drawn[1].seed == drawn[0].seed + 1


def test_from_openai_clamps_logit_bias_into_its_range_as_vllms_server():
    """vLLM's server clamps a request's biases into [-100, 100] (they were refused there: "must
    be in [-100.0, 100.0], got 101"); SamplingParams itself still refuses them offline."""
    p = SamplingParams.from_openai({"logit_bias": {"5": 101, "6": -1e9, "7": 3}})
    assert p.logit_bias == ((5, 100.0), (6, -100.0), (7, 3.0))
    # +-inf (JSON's Infinity, 1e999) clamped too (they were refused); NaN refused by name
    p = SamplingParams.from_openai(json.loads('{"logit_bias": {"5": Infinity, "6": -1e999}}'))
    assert p.logit_bias == ((5, 100.0), (6, -100.0))
    with pytest.raises(ValueError, match=r"^logit_bias\[7\] must be a number in \[-100.0, 100.0\], got nan$"):
        SamplingParams.from_openai(json.loads('{"logit_bias": {"7": NaN}}'))
    with pytest.raises(ValueError, match=r"^logit_bias\[5\] must be in \[-100.0, 100.0\], got 101$"):
        SamplingParams(logit_bias={5: 101})


@pytest.mark.parametrize("body, msg", [
    ({"temprature": 0.5}, "unknown request field 'temprature'"),
    ({"response_format": {"type": "json_object"}}, "response_format is not supported by this server "
                                                   "(structured output)"),
    ({"tools": [{"type": "function"}]}, "tools is not supported by this server (tool calling)"),
    ({"tool_choice": "auto"}, "tool_choice is not supported by this server (tool calling)"),
    ({"guided_choice": ["a", "b"]}, "guided_choice is not supported by this server (guided decoding)"),
    ({"suffix": "}"}, "suffix is not supported by this server (text insertion)"),  # was ignored
    ({"bad_words": ["no", 3]}, "every bad_words entry must be a non-empty string, got 3"),
    ({"temperature": 3}, "temperature must be in [0, 2.0], got 3"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"top_logprobs": 2}, "top_logprobs requires logprobs=true"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs must be in [0, 20], got 30"),
    ({"logprobs": 30}, "logprobs must be in [0, 20], got 30"),
    ({"max_completion_tokens": -1}, "max_completion_tokens must be >= 1, got -1"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"n": "x"}, "n must be an integer >= 1, got 'x'"),
    ({"n": 2, "best_of": 3}, "best_of must equal n (2)"),
    ({"best_of": 2}, "best_of must equal n (1)"),
    ({"best_of": True}, "best_of must be an integer >= 1, got True"),  # was taken as n=1
    ({"n": 2, "best_of": 2.5}, "best_of must be an integer >= 1, got 2.5"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0], got 2.5"),
    ({"frequency_penalty": "x"}, "frequency_penalty must be a number in [-2.0, 2.0], got 'x'"),
    ({"repetition_penalty": 0}, "repetition_penalty must be in [0.0001, 10000.0], got 0"),
    ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids (non-negative integers), got 'x'"),
    ({"logit_bias": {"-3": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias[5] must be a number in [-100.0, 100.0], got nan"),
    ({"logit_bias": {"5": True}}, "logit_bias[5] must be a number in [-100.0, 100.0], got True"),
    ({"logit_bias": [5, 1]}, "logit_bias must be an object mapping token ids to biases"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias takes at most 1024 token ids, got 1025"),
    ({"stop": 5}, "stop must be a list of strings, got 5"),
    ({"exit_criterion": "foo"}, "exit_criterion must be one of"),
    ([1, 2], "request body must be a JSON object, got list"),
])
def test_from_openai_rejects_bad_fields(body, msg):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_openai(body)
    assert str(err.value).startswith(msg) and "\n" not in str(err.value)


def test_sort_descending_matches_numpy_on_every_kind_of_float():
    """The int-key sort gives numpy's descending order (as values) for negatives, positives,
    both zeros, ties, infinities and denormals."""
    rs = np.random.default_rng(3)
    x = rs.standard_normal((3, 257)).astype(np.float32) * 10
    x[0, :6] = [0.0, -0.0, np.inf, -np.inf, 1e-42, -1e-42]
    x[1, :50] = 2.5  # ties
    x[2] = -np.abs(x[2])  # all negative
    got = np.asarray(jax.jit(sort_descending)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, -np.sort(-x, axis=-1))


def test_min_tokens_suppresses_stop_ids_until_then():
    """Before its min_tokens a row cannot pick its stop ids (greedy or sampled), from then on
    it can; its logprobs stay the model's (raw logits); rows without it are untouched."""
    logits = np.zeros((3, 16), np.float32)
    logits[:, 3], logits[:, 5], logits[:, 7] = 30.0, 20.0, 10.0  # 3 first, then 5, then 7
    stop = dict(stop_token_ids=(3, 5), min_tokens=2)
    greedy = SamplingParams(temperature=0.0, **stop)
    sampled = SamplingParams(temperature=1.0, top_k=4, seed=3, **stop)
    tokens, lp, *_ = run(logits, [greedy, greedy, SamplingParams(temperature=0.0)], steps=[1, 2, 0])
    assert tokens.tolist() == [7, 3, 3]  # row 0 is at its token 1 (< 2): 3 and 5 suppressed
    raw = jax.nn.log_softmax(jnp.asarray(logits[0]))
    np.testing.assert_allclose(lp[0], raw[7], rtol=1e-6)
    draws = [run(logits[:1], [dataclasses.replace(sampled, seed=s)], steps=[0])[0][0] for s in range(20)]
    assert 3 not in draws and 5 not in draws
    plain, *_ = run(logits, [SamplingParams(temperature=0.0)] * 3)
    assert plain.tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="at most 64 stop token ids"):
        SamplingBatch.from_params([SamplingParams(stop_token_ids=tuple(range(65)), min_tokens=1)], 1, [0])


def test_min_tokens_suppresses_as_many_stop_ids_as_the_table_holds_beside_bad_word_bans():
    """The suppression table holds 64 (id, after) pairs a row: min_tokens' stop ids (EOS
    included) take the first columns, its bad_words' bans the next (they were capped at 8 stop
    ids, the table's other 56 columns reserved for bans); beyond it, one line."""
    many = SamplingParams(temperature=0.0, stop_token_ids=tuple(range(20, 70)) + (3, 5), min_tokens=2)
    logits = np.zeros((1, 16), np.float32)
    logits[0, 3], logits[0, 5], logits[0, 7] = 30.0, 20.0, 10.0
    assert run(logits, [many], steps=[1])[0].tolist() == [7]  # ids 3 and 5 in columns 50 and 51
    table = SamplingBatch.from_params([many], 1, [0], bans=[((9, -1), (11, 4))]).suppressed[0]
    assert table[:52, 0].tolist() == list(range(20, 70)) + [3, 5]
    assert table[52:54].tolist() == [[9, -1], [11, 4]] and (table[54:] == -1).all()
    assert SamplingBatch.from_params([many], 1, [2], bans=[((9, -1),)]).suppressed[0, 0].tolist() == [9, -1]
    check_suppressible(many, 12)
    with pytest.raises(ValueError, match=r"^min_tokens suppresses at most 51 stop token ids \(EOS included\) "
                                         r"beside 13 bad_words token sequences, got 52$"):
        check_suppressible(many, 13)
