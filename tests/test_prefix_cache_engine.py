"""Engine with the prefix cache on the golden tiny models (fp32, greedy): multi-turn sessions
give the same tokens and exit loops with the cache as without, for Ouro and for Huginn with
the position-keyed (seeded) initial state, and later turns hit the cache. Each turn's prompt
is the previous turn's prompt + its output + new user tokens; sessions share a system prompt
and interleave. Huginn session 0 has explicit initial states: it never hits, and its first
prompt equals session 1's, so a cache that ignored the states would hand it session 1's pages.
Huginn runs 5 loops: on the tiny model, tokens depend on both the earlier tokens and s0 there
(after 2 loops they ignore the context, after 8 they ignore s0: either would hide a cache that
mixed up pages)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

# NOTE: no warm-up: only the two shapes these sessions use compile (Huginn runs 5 loops).
SMALL = dict(page_size=4, max_num_rows=4, decode_row_buckets=(4,), max_prefill_tokens=32,
             prefill_token_buckets=(32,), max_prefill_rows=2, max_context_len=96,
             warmup=False, verbose=False)
NUM_SESSIONS, NUM_TURNS, MAX_TOKENS = 3, 3, 5
MODELS = {"ouro": "tests/data/ouro", "huginn": "tests/data/huginn/huginn_shape_242"}
LOOPS = {"ouro": 4, "huginn": 5}


def run_sessions(engine, loops, explicit_states=None):
    """Returns {(session, turn): (final RequestOutput, tokens its admission took from the
    cache)}. explicit_states: Huginn s0 for every turn of session 0 (never shares pages)."""
    rng = np.random.default_rng(7)
    system = rng.integers(1, 200, 9).tolist()
    user = {(s, t): rng.integers(1, 200, 3 + s).tolist()
            for s in range(NUM_SESSIONS) for t in range(NUM_TURNS)}
    user[1, 0] = user[0, 0]  # sessions 0 and 1 open with the same prompt
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, loops=loops)
    prompts, finals, owner, requests = {}, {}, {}, {}

    def submit(s, t, history):
        prompts[s, t] = history + user[s, t]
        state = explicit_states if s == 0 and explicit_states is not None else None
        rid = engine.add_request(prompts[s, t], params, f"s{s}t{t}", initial_state=state)
        owner[rid] = (s, t)
        requests[s, t] = engine.scheduler.get(rid)  # the live Request: num_cached_tokens

    for s in range(NUM_SESSIONS):
        submit(s, 0, system)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                s, t = owner[out.request_id]
                finals[s, t] = out, requests[s, t]
                if t + 1 < NUM_TURNS:
                    submit(s, t + 1, prompts[s, t] + out.token_ids)
    return {key: (out, requests[key].num_cached_tokens) for key, (out, _) in finals.items()}


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_sessions_same_tokens_with_and_without_the_cache(family):
    model = loopjax.load(MODELS[family])
    loops = LOOPS[family]
    states = None
    if family == "huginn":
        states = np.random.default_rng(3).normal(size=(96, model.cfg.hidden_size)).astype(np.float32)
    off = run_sessions(Engine(model, EngineConfig(**SMALL)), loops, states)
    engine = Engine(model, EngineConfig(**SMALL, enable_prefix_caching=True))
    on = run_sessions(engine, loops, states)
    assert set(on) == set(off) and len(on) == NUM_SESSIONS * NUM_TURNS
    for (s, t), (out, cached) in on.items():
        assert out.token_ids == off[s, t][0].token_ids, (s, t)
        assert out.exit_loops == off[s, t][0].exit_loops == [loops] * MAX_TOKENS, (s, t)
        assert off[s, t][1] == 0
        if t > 0 and not (s == 0 and states is not None):
            assert cached >= 12, (s, t)  # at least the pages of the previous turn's prompt
    stats = engine.stats()
    assert stats["prefix_cache_hit_rate"] > 0.3 and stats["prefix_cache_hit_tokens"] % 4 == 0
    assert stats["prefix_cache_hit_tokens"] == sum(cached for _, cached in on.values())
    assert stats["pages_free"] == stats["pages_total"]
    if states is not None:  # explicit states: no hit, and they matter for the tokens
        assert all(on[0, t][1] == 0 for t in range(NUM_TURNS))
        assert on[0, 0][0].token_ids != on[1, 0][0].token_ids


def test_huginn_ring_prompt_is_computed_in_one_step():
    """Huginn's 'shared' ring (compress-sK) at more loops than its planes: within one prefill a
    token at loop i reads the earlier prompt tokens' loop-i entries, while a later step reads
    their last write of the plane. So a cached prefix or a split prompt gave other logprobs
    than one prefill: such a request neither shares pages nor is split by a batch-mate."""
    model = loopjax.load(MODELS["huginn"])
    engine = Engine(model, EngineConfig(**{**SMALL, "page_size": 8}, kv_layout="shared",
                                        shared_kv_slots=8, enable_prefix_caching=True))  # 2 planes
    rng = np.random.default_rng(0)
    prompt, mate = rng.integers(0, 256, 25).tolist(), rng.integers(0, 256, 20).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)

    def run(*requests):
        for rid, ids in requests:
            engine.add_request(ids, params, rid)
        finals = {}
        while engine.has_unfinished():
            finals.update((o.request_id, o) for o in engine.step() if o.finished)
        return finals[requests[-1][0]]

    alone = run(("alone", prompt))
    again = run(("again", prompt))  # its first 3 pages were published by "alone"
    mixed = run(("mate", mate), ("mixed", prompt))  # 32 - 20 tokens of the prefill budget left
    for out in (again, mixed):
        assert (out.token_ids, out.logprobs) == (alone.token_ids, alone.logprobs)
    assert engine.stats()["prefix_cache_hit_tokens"] == 0
    engine.add_request(prompt, dataclasses.replace(params, loops=2), "unwrapped")  # a plane per loop
    assert engine.scheduler.get("unwrapped").cache_salt is not None
    # the server's n samples wait for sample 0's pages only where they are shared
    assert not engine.shares_prefix(params) and engine.shares_prefix(dataclasses.replace(params, loops=2))
