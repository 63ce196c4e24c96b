"""The greedy decode step (StepKind.greedy): Runner.dispatch picks it exactly when every row of
a fused decode step is greedy, through the rule warm-up compiles (`steps.fused_kind`), and its
executable gives bitwise the full sampler's outputs on an all-greedy batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loopjax
from loopjax import kv_cache
from loopjax.batch import greedy_row
from loopjax.runner import Runner
from loopjax.sampling_params import SamplingParams
from loopjax.steps import fused

GREEDY = SamplingParams(temperature=0.0)
NEAR_ZERO = SamplingParams(temperature=1e-6, top_k=3, seed=5)  # raised to 0.01 (vLLM's): drawn
SAMPLED = SamplingParams(temperature=0.7, top_p=0.9, seed=1)
CHOSEN_LOGPROB = SamplingParams(temperature=0.0, logprobs=0)  # the greedy sampler computes it
TOP_LOGPROBS = SamplingParams(temperature=0.0, logprobs=2)  # top logprobs: the full sampler's


def tiny_runner(preset, dtype, **kw):
    model = loopjax.load(preset, dtype=dtype)
    layout = kv_cache.make_layout(model.cfg, "per_loop", page_size=8, dtype=jnp.dtype(dtype), num_pages=8)
    return Runner(model, layout, decode_rows=(2,), prefill_buckets=((2, 8),), max_pages=2,
                  max_loops=4, **kw)


def rows(*params, loops=4):
    return [greedy_row([5 + i], 3, [1 + i], loops=loops, params=p) for i, p in enumerate(params)]


@pytest.fixture(scope="module")
def ouro_runner():
    return tiny_runner("ouro-tiny", "float32")


@pytest.mark.parametrize("params, greedy", [((GREEDY, GREEDY), True), ((GREEDY, NEAR_ZERO), False),
                                            ((GREEDY,), True), ((GREEDY, SAMPLED), False),
                                            ((SAMPLED,), False), ((GREEDY, CHOSEN_LOGPROB), True),
                                            ((GREEDY, TOP_LOGPROBS), False)])
def test_dispatch_picks_the_greedy_kind_iff_every_decode_row_is_greedy(ouro_runner, monkeypatch,
                                                                       params, greedy):
    """Decode steps only (prefill and per-loop series keep the full sampler), and every kind
    dispatch picks is one warm-up compiles, adaptive and weighted ones included."""
    submitted = []
    monkeypatch.setattr(ouro_runner, "submit", lambda batch, kind: submitted.append((batch.decode, kind)))
    warm = {(b.decode, k) for b, k in ouro_runner.warmup_steps(adaptive=True, weighted=True)}
    ouro_runner.dispatch(rows(*params), decode=True)
    ouro_runner.dispatch(rows(*params), decode=False)
    ouro_runner.dispatch([*rows(*params)[:-1], greedy_row([9], 3, [4], loops=4, params=params[-1],
                                                           exit_skip=True)], decode=True)
    ouro_runner.dispatch(rows(*params), decode=True, loop_begin=1, num_loops=1, series=True)
    assert [kind.greedy for _, kind in submitted] == [greedy, False, greedy, False]
    assert submitted[0][1] == fused(4, greedy=greedy) and submitted[2][1].adaptive
    assert set(submitted[:3]) <= warm
    assert {k for d, k in warm if d} == {fused(4, a, 1, w, greedy=g) for a in (False, True)
                                         for w in (False, True) for g in (False, True)}


@pytest.mark.parametrize("preset", ["ouro-tiny", "huginn-tiny"])
def test_greedy_and_full_executables_agree_bitwise_on_greedy_rows(preset):
    """One all-greedy decode batch (a padding row included) through both executables, bf16
    weights (16-bit logits reach the sampler), from the same device state. The greedy one
    computes no top logprobs (rows asking for them run the full one)."""
    runner = tiny_runner(preset, "bfloat16", num_top_logprobs=3)
    batch = runner.make_batch(rows(GREEDY), decode=True, loop_begin=0, loop_end=4, num_rows=2)
    state = jax.tree.map(jnp.copy, runner.state)
    outs = []
    for greedy in (False, True):
        runner.state = jax.tree.map(jnp.copy, state)  # the step donates the state
        outs.append(jax.device_get(runner.submit(batch, fused(4, greedy=greedy))))
    full, greedy = outs
    for name in ("tokens", "exit_loops", "logprobs"):
        np.testing.assert_array_equal(getattr(greedy, name), getattr(full, name), err_msg=name)
    assert greedy.top_ids.shape == greedy.top_logprobs.shape == (2, 0) and np.isfinite(greedy.logprobs).all()
    assert full.top_ids.shape == (2, 3) and (full.top_ids[:, 0] == full.tokens).all()
    np.testing.assert_array_equal(full.top_logprobs[:, 0], full.logprobs)
    assert runner.compilations == 2
