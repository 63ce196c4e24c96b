"""The sampler's two fast paths against the implementation they replace, bitwise: 16-bit logits
sort their 16-bit order keys and scale after (`scale_and_sort`), where the sampler sorted the
f32 scaled logits; the greedy sampler (`sample(..., greedy=True)`, StepKind.greedy) gives what
the full one gives on an all-greedy batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loopjax.sampling import (
    TOP_K_CAP,
    SamplingBatch,
    filter_threshold,
    row_keys,
    sample,
    scale_and_sort,
    sort_descending,
)
from loopjax.sampling_params import GREEDY_EPS, SamplingParams

VOCAB, ROWS = 1024, 16


def reference_sample(logits, batch, num_top_logprobs):
    """The sampler before the 16-bit sort: f32 logits, the scaled logits' f32 keys sorted."""
    x = logits.astype(jnp.float32)
    greedy = batch.temperature < GREEDY_EPS
    scaled = x / jnp.where(greedy, 1.0, batch.temperature)[:, None]
    thr = filter_threshold(scaled, sort_descending(scaled), batch, greedy)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (x.shape[-1],), jnp.float32))(row_keys(batch))
    drawn = jnp.argmax(jnp.where(scaled >= thr, scaled, -jnp.inf) + noise, axis=-1).astype(jnp.int32)
    tokens = jnp.where(greedy, jnp.argmax(x, axis=-1).astype(jnp.int32), drawn)
    lse = jax.nn.logsumexp(x, axis=-1)
    top_vals, top_ids = jax.lax.top_k(x, num_top_logprobs)
    chosen = jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - lse
    ranks = jnp.sum(x - lse[:, None] >= chosen[:, None], axis=-1, dtype=jnp.int32)
    return tokens, chosen, top_ids.astype(jnp.int32), top_vals - lse[:, None], ranks, thr


def thresholds(logits, batch):
    greedy = batch.temperature < GREEDY_EPS
    return filter_threshold(*scale_and_sort(logits, batch, greedy), batch, greedy)


_reference = jax.jit(reference_sample, static_argnums=2)
_sample = jax.jit(sample, static_argnames=("num_top_logprobs", "greedy"))
_thresholds = jax.jit(thresholds)


def tied_logits(seed, dtype):
    """[ROWS, VOCAB] logits with many exact ties: multiples of 1/8 in [-8, 8), both zeros."""
    rs = np.random.default_rng(seed)
    x = rs.integers(-64, 64, (ROWS, VOCAB)).astype(np.float32) / 8
    x[np.arange(ROWS), rs.integers(0, VOCAB, ROWS)] = -0.0
    return jnp.asarray(x, dtype)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


# Batches by the threshold path they take (filter_threshold): every filtering row capped
# (top-k 1..TOP_K_CAP), some uncapped (top-k > cap or top-p alone: the full sort), min-p only.
CAPPED = [dict(top_k=1), dict(top_k=5, top_p=0.8), dict(top_k=TOP_K_CAP), dict(top_k=40, min_p=0.1)]
UNCAPPED = [dict(top_k=500), dict(top_p=0.9), dict(top_p=0.5, min_p=0.05), dict(top_k=3), {}]
MIN_P = [dict(min_p=0.2), dict(min_p=0.0), {}]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("filters", [CAPPED, UNCAPPED, MIN_P], ids=["capped", "uncapped", "min_p"])
def test_16bit_sort_matches_the_f32_sampler_bitwise(dtype, filters):
    temperatures = (0.3, 0.7, 1.0, 1.7)
    params = [SamplingParams(temperature=temperatures[i % 4], seed=i, **filters[i % len(filters)])
              for i in range(ROWS - 3)]
    params[2] = SamplingParams(temperature=0.0)  # a greedy row; the last 3 rows are padding
    batch = SamplingBatch.from_params(params, ROWS, list(range(ROWS - 3)))
    for seed in range(3):
        logits = tied_logits(seed, dtype)
        *want, want_thr = _reference(logits, batch, 3)
        got = _sample(logits, batch, num_top_logprobs=3)
        thr = _thresholds(logits, batch)
        np.testing.assert_array_equal(bits(thr), bits(want_thr))
        assert np.isfinite(np.asarray(thr)).any()  # some row did filter
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(bits(g), bits(w))
    x = np.asarray(logits, np.float32)
    assert np.asarray(got[0])[2] == x[2].argmax()  # the greedy row
    drawn = np.asarray(got[0])[:ROWS - 3] != x[:ROWS - 3].argmax(-1)
    assert drawn.any()  # some sampled row drew off its argmax


def test_sorted_16bit_keys_scale_to_the_sorted_scaled_values():
    """Ties, both zeros, infinities, the extremes of bf16: sorting the raw values and dividing
    by t > 0 gives the sort of the divided values, element for element."""
    x = np.array(tied_logits(9, jnp.float32))
    x[0, :6] = [np.inf, -np.inf, 3.3895e38, -3.3895e38, 1e-38, -1e-38]
    logits = jnp.asarray(x, jnp.bfloat16)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.37)] * ROWS, ROWS, [0] * ROWS)
    scaled, sorted_desc = jax.jit(scale_and_sort)(logits, batch, jnp.zeros(ROWS, bool))
    want = jax.jit(sort_descending)(scaled)
    np.testing.assert_array_equal(bits(sorted_desc), bits(want))
    assert np.asarray(sorted_desc).dtype == np.float32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_greedy_sampler_equals_the_full_one_on_greedy_rows(dtype):
    """All-greedy batch (real rows greedy, padding rows greedy by construction): tokens,
    logprobs and top logprobs bitwise equal; the greedy program has no sort."""
    logits = tied_logits(4, dtype)
    # NOTE: only temperature 0 is greedy (a tiny positive one draws at 0.01, vLLM's)
    batch = SamplingBatch.from_params([SamplingParams(temperature=0.0, top_p=p, seed=s)
                                       for p, s in ((0.5, 3), (0.9, 4), (1.0, 5))], ROWS, [0, 5, 9])
    full = _sample(logits, batch, num_top_logprobs=4)
    greedy = _sample(logits, batch, num_top_logprobs=4, greedy=True)
    for g, f in zip(greedy, full, strict=True):
        np.testing.assert_array_equal(bits(g), bits(f))
    np.testing.assert_array_equal(greedy[0], np.asarray(logits, np.float32).argmax(-1))
    texts = [_sample.lower(logits, batch, num_top_logprobs=4, greedy=g).as_text() for g in (False, True)]
    assert ["stablehlo.sort" in t and "threefry" in t for t in texts] == [True, False]
