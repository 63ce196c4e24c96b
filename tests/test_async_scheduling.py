"""Async scheduling (the engine plans and dispatches step n+1 before it reads step n) gives
exactly the results of the synchronous loop: tokens, exit loops, finish reasons, logprobs,
seeded samples, over mixed prompt lengths and arrival times, a stop token mid-batch, a stop
string and an abort while the request's next step is in flight, and a pool small enough to
force preemption; every page and slot comes back, one host read per submission, one decode
submission per output token, nothing compiles after warm-up (a strict engine).
The scheduler's side of it is tested with the fake runner in test_scheduler.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import greedy

import loopjax
from loopjax.engine import Engine, EngineConfig
from loopjax.sampling_params import SamplingParams

OURO = "tests/data/ouro"
# 8 pages of 8 tokens: the three golden prompts with 24 tokens each cannot all fit.
CONFIG = EngineConfig(page_size=8, num_pages=8, max_num_rows=4, decode_row_buckets=(4,),
                      max_prefill_tokens=32, prefill_token_buckets=(32,), max_prefill_rows=2,
                      max_context_len=48, max_logprobs=2, strict_compile=True, verbose=False)


def sampled(max_tokens, seed, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=seed,
                          ignore_eos=True, logprobs=2, **kw)


@pytest.fixture(scope="module")
def engine():
    return Engine(loopjax.load(OURO), CONFIG)


def workload(stop_token=None):
    """{step: [(id, prompt, params)]}: the golden prompts (5, 12, 17 tokens) and two random
    ones, greedy and seeded sampling, logprobs, arriving over the first steps."""
    ref = np.load(f"{OURO}/reference_fp32.npz")
    p0, p1, p2 = (ref[f"{k}_input_ids"].tolist() for k in ("p0", "p1", "p2"))
    stop = () if stop_token is None else (stop_token,)
    return {0: [("g0", p0, greedy(24)), ("g1", p1, greedy(20, logprobs=2))],
            1: [("s2", p2, sampled(16, seed=7))],
            2: [("victim", p1, greedy(20))],
            3: [("stop", [9, 200, 31], greedy(12, stop_token_ids=stop))],
            8: [("late", list(range(40, 49)), sampled(10, seed=3))]}


def run(engine, arrivals, *, pipelined, abort_at=None):
    """Step to completion with async scheduling on or off; aborts "victim" before step
    abort_at (pipelined: the first step from there on where its next step is in flight)."""
    engine.config = dataclasses.replace(engine.config, async_scheduling=pipelined)
    arrivals, finals, step = dict(arrivals), {}, 0
    while engine.has_unfinished() or arrivals:
        for rid, prompt, params in arrivals.pop(step, []):
            engine.add_request(prompt, params, rid)
        victim = engine.scheduler.get("victim")
        if abort_at is not None and step >= abort_at and victim is not None:
            if not pipelined or victim.num_pending_tokens == 1:
                assert engine.abort("victim")
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    stats = engine.stats()
    assert stats["pages_free"] == stats["pages_total"]
    engine.scheduler.block_manager.check([])
    assert len(engine._free_token_slots) == len(engine._free_carry) == engine.runner.max_rows
    return finals


def results(finals):
    return {rid: (o.token_ids, o.exit_loops, o.finish_reason, o.logprobs, o.top_logprobs)
            for rid, o in finals.items()}


def test_async_scheduling_gives_the_synchronous_results(engine, monkeypatch):
    compiled = engine.runner.compilations
    free_run = run(engine, workload(), pipelined=False)
    tokens = free_run["stop"].token_ids
    stop_token = next(t for i, t in enumerate(tokens) if i >= 3 and t not in tokens[:i])
    preemptions = engine.stats()["preemptions"]
    sync = results(run(engine, workload(stop_token), pipelined=False, abort_at=6))
    assert engine.stats()["preemptions"] > preemptions

    events = []  # "d": a dispatch, "r": a host read
    dispatch, read = engine.runner.dispatch, engine.runner.read
    monkeypatch.setattr(engine.runner, "dispatch", lambda *a, **k: events.append("d") or dispatch(*a, **k))
    monkeypatch.setattr(engine.runner, "read", lambda p: events.append("r") or read(p))
    preemptions, submissions = engine.stats()["preemptions"], engine.runner.submissions
    finals = run(engine, workload(stop_token), pipelined=True, abort_at=6)
    pipelined = results(finals)
    assert engine.stats()["preemptions"] > preemptions  # the fallback to the synchronous order

    victim = pipelined.pop("victim")
    assert sync.pop("victim")[2] == victim[2] == "abort"
    assert victim[0] == free_run["victim"].token_ids[:len(victim[0])]
    assert pipelined == sync
    assert sync["stop"][0][-1] == stop_token and sync["stop"][2] == "stop"
    assert len(sync["stop"][0]) < 12 and len(sync["g1"][3]) == 20
    for rid, out in finals.items():
        if rid != "victim":
            assert out.metrics["decode_submissions_per_token"] == 1.0, rid
    # One host read per submission, and most submissions dispatched before the previous
    # one was read (the overlap).
    assert events.count("d") == events.count("r") == engine.runner.submissions - submissions
    overlapped = [e == "d" and events[:i].count("d") > events[:i].count("r")
                  for i, e in enumerate(events)]
    assert sum(overlapped) > 3 * events.count("d") // 4  # the rest: fallbacks (pages), the start
    assert engine.runner.compilations == compiled


def test_stop_string_while_the_next_step_is_in_flight(engine, monkeypatch):
    """A stop string (found by the engine after the update) finishes a request whose next
    decode is already dispatched: same text, tokens and reason as the synchronous loop."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 symbols: the tiny vocabulary
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    monkeypatch.setattr(engine, "model", dataclasses.replace(engine.model, tokenizer=tok))
    prompt = [ord(c) for c in "loop"]
    free = run(engine, {0: [("free", prompt, greedy(16))]}, pipelined=False)["free"]
    text = free.text
    raw = run(engine, {0: [("raw", prompt, greedy(16, detokenize=False))]}, pipelined=False)["raw"]
    assert raw.text is None and raw.token_ids == free.token_ids and text  # detokenize=False: no text
    stop = next(text[i - 2:i] for i in range(4, len(text)) if text[i - 2:i] not in text[:i - 1])
    outs, submissions = [], []
    for pipelined in (False, True):
        before = engine.runner.submissions
        outs.append(run(engine, {0: [("s", prompt, greedy(16, stop=(stop,)))]}, pipelined=pipelined)["s"])
        submissions.append(engine.runner.submissions - before)
    expected = (outs[0].token_ids, text[:text.index(stop)], "stop")
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == [expected] * 2
    # One submission per token (prefill, then decodes); pipelined, one more: the decode
    # dispatched before the stop string was seen, whose token was dropped.
    assert len(outs[0].token_ids) < 16 and submissions == [len(expected[0]), len(expected[0]) + 1]
