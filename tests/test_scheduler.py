"""Scheduler against the fake runner (tests/fake_runner.py): next token = (last + 1) % 97,
fixed-depth rows exit at their depth, adaptive rows at 1 + last % depth. Every expected
step below is computed by hand from the rule at the top of Scheduler.schedule()."""

import random

import pytest
from fake_runner import VOCAB as V
from fake_runner import FakeRunner, adaptive_exit, drive, setup, step

from loopjax.request import Request, RequestPhase
from loopjax.sampling_params import SamplingParams
from loopjax.scheduler import Scheduler, SchedulerConfig, StepKind, StepOutput, StepPlan


def cfg(**kw):
    base = dict(page_size=4, num_pages=64, max_num_rows=8, decode_row_buckets=(1, 2, 4, 8),
                max_prefill_tokens=32, prefill_token_buckets=(8, 16, 32), max_prefill_rows=4,
                max_context_len=64, num_loops=4)
    base.update(kw)
    return SchedulerConfig(**base)


def req(rid, prompt, max_tokens=4, stop=(), **kw):
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, temperature=0.0, seed=0)
    return Request(rid, list(prompt), params, **kw)


# ---------------------------------------------------------------- batching and buckets

def test_continuous_batching_order():
    sched, runner = setup(cfg())
    a, b, c = req("A", [10, 11, 12], 3), req("B", [20, 21], 5), req("C", [30], 2)
    trace = drive(sched, runner, {0: [a, b], 3: [c]})
    # 0 P[A,B] (no decode rows yet); 1 D (1 prefill >= the initial share of 1); 2 D (queue
    # empty; A's 3rd token); 3 P[C] (the 4-loop decode left a share of 4); 4 D[B,C] (C's
    # 2nd token); 5 D[B] (B's 5th).
    assert trace.kinds == "PDDPDD"
    assert trace.rows == [["A", "B"], ["A", "B"], ["A", "B"], ["C"], ["B", "C"], ["B"]]
    assert trace.loops == [4, 4, 4, 4, 4, 4]
    assert a.output_token_ids == [13, 14, 15] and b.output_token_ids == [22, 23, 24, 25, 26]
    assert c.output_token_ids == [31, 32] and a.exit_loops == [4, 4, 4]
    assert trace.first_token_step == {"A": 0, "B": 0, "C": 3}
    assert all(r.finish_reason == "length" for r in (a, b, c))
    assert not sched.has_unfinished() and sched.block_manager.num_free_pages == 64


def test_default_decode_row_buckets_add_4_rows_past_4096_keys():
    """An engine whose requests may pass LONG_CONTEXT_KEYS compiles a 4-row decode bucket (its
    attention splits long contexts toward one program per SM); otherwise 2-7 rows pad to 8."""
    from loopjax.step_plan import DECODE_ROW_BUCKETS, LONG_CONTEXT_KEYS, default_decode_row_buckets

    assert default_decode_row_buckets(LONG_CONTEXT_KEYS) == DECODE_ROW_BUCKETS == (1, 8, 16, 32, 64, 128)
    assert default_decode_row_buckets(LONG_CONTEXT_KEYS + 1) == (1, 4, 8, 16, 32, 64, 128)
    assert cfg(max_num_rows=32, decode_row_buckets=default_decode_row_buckets(8192)).row_bucket(3) == 4


def test_decode_row_buckets_with_real_row_count():
    config = cfg(max_num_rows=6, decode_row_buckets=(1, 2, 4, 8, 16))
    assert config.row_buckets == (1, 2, 4, 6) and config.prefill_row_buckets == (1, 2, 4)
    with pytest.raises(ValueError, match="7 decode rows exceed the largest bucket 6"):
        config.row_bucket(7)
    sched, runner = setup(config)
    for i in range(5):
        sched.add(req(f"r{i}", [i], max_tokens=3))
    assert config.row_bucket(4) == 4 and config.row_bucket(5) == 6
    # The first decode waits for the prefill share (4 loops: 4 prefill steps), so both prompt
    # batches run first.
    p0, p1, p2, p3 = (step(sched, runner) for _ in range(4))
    assert (p0.kind, p0.num_real_rows, p0.row_bucket) == (StepKind.PREFILL, 4, 4)  # max_prefill_rows
    assert (p1.kind, p1.num_real_rows, p1.row_bucket, p1.token_bucket) == (StepKind.PREFILL, 1, 1, 8)
    assert (p2.kind, p2.num_real_rows, p2.row_bucket, p2.token_bucket) == (StepKind.DECODE, 5, 6, 6)
    assert p2.token_ranges == ((1, 2),) * 5 and p2.input_token_ids() == [1, 2, 3, 4, 5]
    assert (p3.kind, p3.num_real_rows, p3.row_bucket) == (StepKind.DECODE, 5, 6)
    assert p3.token_ranges == ((2, 3),) * 5 and p3.input_token_ids() == [2, 3, 4, 5, 6]


def test_packed_prefill_concatenates_and_pads_only_to_the_bucket():
    sched, runner = setup(cfg())
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8], "c": list(range(10, 19))}
    for rid, prompt in prompts.items():
        sched.add(req(rid, prompt))
    plan = sched.schedule()
    assert plan.kind is StepKind.PREFILL and plan.token_ranges == ((0, 3), (0, 5), (0, 9))
    assert plan.num_real_tokens == 17 and plan.token_bucket == 32 and plan.row_bucket == 4
    assert plan.input_token_ids() == [1, 2, 3, 4, 5, 6, 7, 8] + list(range(10, 19))
    assert plan.positions() == [0, 1, 2, 0, 1, 2, 3, 4] + list(range(9))
    assert plan.emits == (True, True, True) and (plan.loop_begin, plan.num_loops) == (0, 4)
    out = runner.run(plan)
    assert out.token_ids == [4, 9, 19]
    sched.update(plan, out)


def test_chunked_prefill_splits_exactly():
    config = cfg(max_prefill_tokens=8, prefill_token_buckets=(8,))
    sched, runner = setup(config)
    long = req("L", range(21), max_tokens=1)
    sched.add(long)
    plans = [step(sched, runner) for _ in range(3)]
    assert [p.token_ranges for p in plans] == [((0, 8),), ((8, 16),), ((16, 21),)]
    assert [p.emits for p in plans] == [(False,), (False,), (True,)]
    assert [p.token_bucket for p in plans] == [8, 8, 8]
    assert long.output_token_ids == [21] and long.finish_reason == "length"
    # Two prompts share the 8-token budget: A whole, B's first 3; B's remaining 7 follow within
    # the share (L's chunks, prefilled while no row decoded, used none of it), then both decode.
    a, b = req("A", range(5), 3), req("B", range(50, 60), 2)
    trace = drive(sched, runner, {0: [a, b]})
    assert trace.kinds.startswith("PPD") and trace.rows[:3] == [["A", "B"], ["B"], ["A", "B"]]
    assert a.output_token_ids == [5, 6, 7] and b.output_token_ids == [60, 61]
    assert trace.first_token_step == {"A": 0, "B": 1}


# ---------------------------------------------------------------- the prefill share

@pytest.mark.parametrize("share_per_loop, batches, expected_kinds, first_token_step", [
    # L = 4 loops per fused decode. B (48 tokens = 12 chunks of 4) arrives at step 2.
    (True, 1, "PD" + "PPPPD" * 2 + "PPPP", 15),    # 4 chunks per decode: 12th chunk at 2+11+2
    (False, 1, "PD" + "PD" * 11 + "P", 24),        # 1 chunk per decode: 12th chunk at 2+2*11
    (True, 2, "PD" + "PPPPPPPPD" + "PPPP", 14),    # 8 chunks per decode
    (False, 2, "PD" + "PPD" * 5 + "PP", 18),       # 2 chunks per decode
])
def test_prefill_share_first_token_step(share_per_loop, batches, expected_kinds, first_token_step):
    config = cfg(max_prefill_tokens=4, prefill_token_buckets=(4,), max_context_len=256,
                 prefill_share_per_loop=share_per_loop, max_prefill_batches_before_decode=batches)
    sched, runner = setup(config)
    a, b = req("A", [1], max_tokens=30), req("B", range(48), max_tokens=2)
    trace = drive(sched, runner, {0: [a], 2: [b]})
    assert trace.kinds[:len(expected_kinds)] == expected_kinds
    assert trace.first_token_step["B"] == first_token_step
    # The share moves work in time, never changes tokens.
    assert a.output_token_ids == [(2 + i) % V for i in range(30)] and b.output_token_ids == [48, 49]


def test_the_share_counts_the_loops_a_fused_submission_runs():
    """Rows of 4 loops in a submission compiled for 8 (the runner's smallest loop count >= 4):
    the share is 8 loops' worth, as 2 batches per loop of 4 loops would be (was 4 loops')."""
    config = cfg(max_prefill_tokens=4, prefill_token_buckets=(4,), max_context_len=256)
    arrivals = lambda: {0: [req("A", [1], max_tokens=30)], 2: [req("B", range(48), max_tokens=2)]}  # noqa: E731
    sched = Scheduler(config, loop_count=lambda n: 8)
    runner = FakeRunner(config.page_size, config.num_pages, V, sched.block_manager)
    eight = drive(sched, runner, arrivals())
    assert eight.kinds[:14] == "PD" + "PPPPPPPPD" + "PPP" and set(eight.loops[:14]) == {4}
    twice = drive(*setup(cfg(max_prefill_tokens=4, prefill_token_buckets=(4,), max_context_len=256,
                             max_prefill_batches_before_decode=2)), arrivals())
    assert eight.kinds == twice.kinds and eight.first_token_step == twice.first_token_step


def test_a_burst_after_prefill_only_steps_gets_the_first_decodes_share():
    """Prefill steps while no row waits to decode (X finishes at its prompt: 5 chunks, no
    decode) use none of the share: a burst then runs as on a fresh scheduler, its first
    L = 4 prompt batches before its first decode (was: one, the share counted X's chunks)."""
    config = cfg(max_prefill_tokens=4, prefill_token_buckets=(4,), max_prefill_rows=1)
    burst = lambda: {0: [req(f"b{i}", [i] * 4, max_tokens=3) for i in range(6)]}  # noqa: E731
    fresh = drive(*setup(config), burst()).kinds
    assert fresh == "PPPPDPPDD"
    sched, runner = setup(config)
    drive(sched, runner, {0: [req("x", range(20), max_tokens=1)]})
    assert drive(sched, runner, burst()).kinds == fresh


def test_per_loop_share_is_one_loop_worth():
    # fused_decode=False: each decode submission runs 1 loop, so 1 x the batches follow it.
    config = cfg(max_prefill_tokens=4, prefill_token_buckets=(4,), fused_decode=False)
    sched, runner = setup(config)
    trace = drive(sched, runner, {0: [req("A", [1], max_tokens=10)], 2: [req("B", range(12), 1)]})
    assert trace.kinds[:8] == "PDPDPDPD" and trace.first_token_step["B"] == 6


# ---------------------------------------------------------------- fused vs per-loop decode

def _workload(adaptive=False, seed=0, n=12):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(n):
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 7))]
        r = req(f"r{i}", prompt, max_tokens=rng.randint(1, 10), adaptive=adaptive and i % 2 == 0)
        arrivals.setdefault(rng.randint(0, 10), []).append(r)
    return arrivals


def _outputs(trace):
    return {rid: (r.output_token_ids, r.exit_loops, r.finish_reason) for rid, r in trace.finished.items()}


def test_fused_decode_is_one_submission_per_token_and_equals_per_loop():
    fused_sched, fused_runner = setup(cfg())
    fused = drive(fused_sched, fused_runner, _workload())
    loop_sched, loop_runner = setup(cfg(fused_decode=False))
    per_loop = drive(loop_sched, loop_runner, _workload())
    assert _outputs(fused) == _outputs(per_loop) and len(fused.finished) == 12
    for r in fused.finished.values():
        assert r.decode_submissions_per_token in (None, 1.0)  # None: only the prefill token
        assert r.exit_loops == [4] * r.num_output_tokens
    for r in per_loop.finished.values():
        assert r.decode_submissions_per_token in (None, 4.0)
    assert {n for n, k in zip(fused.loops, fused.kinds) if k != "-"} == {4}
    assert {n for n, k in zip(per_loop.loops, per_loop.kinds) if k == "D"} == {1}


def test_fused_rows_of_different_depths_share_one_submission():
    sched, runner = setup(cfg(max_loops=8))
    deep, default = req("deep", [1], 2, max_loops=8), req("default", [2], 2)
    trace = drive(sched, runner, {0: [deep, default]})
    assert trace.kinds == "PD" and trace.loops == [8, 8]  # the deepest row sets the loop count
    assert deep.exit_loops == [8, 8] and default.exit_loops == [4, 4]
    assert deep.decode_submissions_per_token == default.decode_submissions_per_token == 1.0


def test_plan_states_a_positive_loop_count():
    plan = dict(step_id=0, kind=StepKind.DECODE, requests=(), token_ranges=(), emits=(), row_loops=(),
                loop_begin=0, num_real_rows=0, row_bucket=1, num_real_tokens=0, token_bucket=1, preempted=(),
                input_on_device=())
    with pytest.raises(ValueError, match="at least one loop, got 0"):
        StepPlan(num_loops=0, **plan)
    with pytest.raises(ValueError, match="inconsistent plan"):
        StepPlan(num_loops=1, **{**plan, "num_real_rows": 1})


def test_adaptive_rows_run_one_loop_per_submission():
    sched, runner = setup(cfg())
    a = req("A", [5], max_tokens=3, adaptive=True)
    b = req("B", [9], max_tokens=3)
    c = req("C", [40], max_tokens=2)
    trace = drive(sched, runner, {0: [a, b], 2: [c]})
    # 0 P[A,B]: A 6 (exit 1+5%4=2), B 10. Series 1, loops 0..3 of [A,B]; C's prefill slips in
    # after loop 0 (share 1 x 1); A exits at loop 3 (1+6%4) with 7 at step 4, B at step 5 with
    # 11. Series 2 [A,B,C], steps 6..9: A exits at 4 (1+7%4) with 8, B 12, C 42.
    assert trace.kinds == "PDPDDDDDDD"
    ab, abc = ["A", "B"], ["A", "B", "C"]
    assert trace.rows == [ab, ab, ["C"], ab, ab, ["B"], abc, abc, abc, abc]
    assert trace.loops == [4, 1, 4, 1, 1, 1, 1, 1, 1, 1]
    assert a.output_token_ids == [6, 7, 8] and a.exit_loops == [2, 3, 4]
    assert a.exit_loops == [adaptive_exit(t, 4) for t in (5, 6, 7)]
    assert b.output_token_ids == [10, 11, 12] and b.exit_loops == [4, 4, 4]
    assert c.output_token_ids == [41, 42]
    assert a.num_decode_submissions == 7 and b.num_decode_submissions == 8


# ---------------------------------------------------------------- pages and preemption

def test_preemption_by_recompute_hand_example():
    config = cfg(page_size=2, num_pages=4, max_context_len=8)
    sched, runner = setup(config)
    a, b = req("A", [1, 2, 3], 4), req("B", [4, 5, 6], 4)
    free = []  # free pages before each step (and before the final, empty schedule)
    trace = drive(sched, runner, {0: [a, b]},
                  before_step=lambda k: free.append(sched.stats()["num_free_pages"]))
    # 0 P[A,B] fills the pool (2+2 pages); 1 D[A,B]; 2 A's 5th position needs a page: B,
    # the newest, is preempted; 3 B cannot be re-admitted (5 tokens = 3 pages, 1 free):
    # D[A], A done; 4 P[B] recomputes prompt + its 2 tokens; 5 D[B].
    assert trace.kinds == "PDDDPD"
    assert trace.rows == [["A", "B"], ["A", "B"], ["A"], ["A"], ["B"], ["B"]]
    assert a.output_token_ids == [4, 5, 6, 7] and b.output_token_ids == [7, 8, 9, 10]
    assert (a.num_preemptions, b.num_preemptions, sched.num_preemptions) == (0, 1, 1)
    # A took 1 of B's 2 freed pages at step 2; A's 3 pages came back when it finished at 3.
    assert free == [4, 0, 0, 1, 4, 1, 4]


def test_a_prompt_waits_for_room_for_its_whole_context_not_its_first_chunk():
    """10 pages of 4; A (4 tokens, 30 out) grows to 9 pages; B (20 tokens, in chunks of 4) is
    admitted at step 1, prefilled (steps 1-3, 5-6) and decodes beside A until A's 4th page finds
    the pool full (B holds 7): B, the newer, is preempted. Then it waits, as its 28 tokens (7
    pages) do not fit beside A, and is recomputed once A is done. It was admitted again whenever
    its first chunk fit, and preempted at A's next page: 6 times, 32 prefill rows."""
    config = cfg(num_pages=10, max_prefill_tokens=4, prefill_token_buckets=(4,))
    sched, runner = setup(config)
    a, b = req("A", [1] * 4, max_tokens=30), req("B", range(20), max_tokens=10)
    trace = drive(sched, runner, {0: [a], 1: [b]})
    assert trace.kinds == "PPPPDPP" + "D" * 28 + "P" * 7 + "D"
    assert (b.num_preemptions, b.num_prefill_submissions, sched.num_preemptions) == (1, 12, 1)
    assert a.output_token_ids == [(2 + i) % V for i in range(30)]
    assert b.output_token_ids == [(20 + i) % V for i in range(10)]


@pytest.mark.parametrize("fused, adaptive", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_preemption_gives_the_same_tokens_as_an_unconstrained_run(fused, adaptive, seed):
    big = drive(*setup(cfg(page_size=2, num_pages=200, max_context_len=20, fused_decode=fused)),
                _workload(adaptive, seed))
    tiny_sched, tiny_runner = setup(cfg(page_size=2, num_pages=10, max_context_len=20, fused_decode=fused))
    tiny = drive(tiny_sched, tiny_runner, _workload(adaptive, seed))
    assert _outputs(tiny) == _outputs(big) and len(tiny.finished) == 12
    assert tiny_sched.num_preemptions > 0
    assert tiny_sched.block_manager.num_free_pages == 10 and not tiny_sched.running


def test_every_page_comes_back_after_aborts_finishes_and_preemptions():
    config = cfg(page_size=2, num_pages=10, max_context_len=20, max_prefill_tokens=8,
                 prefill_token_buckets=(8,))
    seen_phases = set()  # phases the victims were in, over all seeds
    for seed in range(5):
        sched, runner = setup(config)
        rng = random.Random(seed)

        def chaos(k, sched=sched, rng=rng, seen_phases=seen_phases):
            live = sorted(sched.requests)
            if live and rng.random() < 0.3:
                victim = sched.get(rng.choice(live))
                seen_phases.add(victim.phase)
                if rng.random() < 0.5:
                    assert sched.abort(victim.request_id) is victim
                else:
                    sched.finish(victim.request_id, "stop")
                assert victim.page_ids == [] and victim.is_finished
        drive(sched, runner, _workload(seed=seed, n=16), before_step=chaos)
        assert sched.block_manager.num_free_pages == 10 and sched.block_manager.num_used_pages == 0
        assert not sched.waiting and not sched.running and not sched.has_unfinished()
    assert seen_phases == {RequestPhase.WAITING, RequestPhase.PREFILLING, RequestPhase.DECODING,
                           RequestPhase.PREEMPTED}
    assert sched.abort("nobody") is None


def test_abort_a_preempted_request():
    sched, runner = setup(cfg(page_size=2, num_pages=4, max_context_len=8))
    a, b = req("A", [1, 2, 3], 4), req("B", [4, 5, 6], 4)
    sched.add(a)
    sched.add(b)
    plans = [step(sched, runner) for _ in range(3)]  # as in the hand example: B preempted at 2
    assert plans[2].preempted == (b,) and b.phase is RequestPhase.PREEMPTED and sched.waiting[0] is b
    assert b.output_token_ids == [7, 8] and b.num_computed_tokens == 0 and b.page_ids == []
    assert sched.abort("B") is b and not sched.waiting and b.finish_reason == "abort"
    trace = drive(sched, runner)
    assert trace.kinds == "D" and a.output_token_ids == [4, 5, 6, 7]
    assert sched.block_manager.num_free_pages == 4


def test_abort_in_every_phase():
    config = cfg(page_size=2, num_pages=4, max_context_len=8, max_prefill_tokens=2,
                 prefill_token_buckets=(2,))
    sched, runner = setup(config)
    a, b, c = req("A", [1, 2], 6), req("B", [3, 4, 5], 6), req("C", [6], 2)
    for r in (a, b, c):
        sched.add(r)
    step(sched, runner)  # P[A] (2-token budget)
    step(sched, runner)  # P[B 0:2]: B is mid-prompt (the first decode waits for the prefill share)
    assert a.phase is RequestPhase.DECODING and b.phase is RequestPhase.PREFILLING
    assert c.phase is RequestPhase.WAITING
    sched.abort("C")
    assert c.finish_reason == "abort" and c not in sched.waiting
    sched.abort("B")
    assert b.page_ids == [] and sched.block_manager.num_used_pages == 1  # A's prompt page
    sched.abort("A")
    assert sched.block_manager.num_free_pages == 4 and sched.schedule() is None


# ---------------------------------------------------------------- finishing and bad input

def test_stop_token_context_limit_and_engine_finish():
    sched, runner = setup(cfg(max_context_len=6))
    s = req("S", [1], max_tokens=50, stop=(4,))
    n = req("N", [1, 2, 3], max_tokens=50)
    e = req("E", [7], max_tokens=50)
    trace = drive(sched, runner, {0: [s, n, e]},
                  before_step=lambda k: k == 2 and sched.finish("E", "stop"))
    assert s.output_token_ids == [2, 3, 4] and s.finish_reason == "stop"
    assert n.output_token_ids == [4, 5, 6] and n.finish_reason == "length"  # 6 = max_context_len
    assert e.output_token_ids == [8, 9] and e.finish_reason == "stop"       # the engine's stop string
    assert "E" not in trace.finished and sched.block_manager.num_free_pages == 64


def test_bad_requests_are_refused_and_the_others_served():
    sched, runner = setup(cfg(num_pages=8, max_context_len=64))  # pool: 32 tokens
    good = [req("g0", [1]), req("g1", [2])]
    sched.add(good[0])
    with pytest.raises(ValueError, match="request 'x': empty prompt"):
        sched.add(req("x", []))
    with pytest.raises(ValueError, match="prompt of 64 tokens leaves no room .* max_context_len=64"):
        sched.add(req("x", range(64)))
    with pytest.raises(ValueError, match="prompt of 32 tokens does not fit the KV pool"):
        sched.add(req("x", range(32)))
    with pytest.raises(ValueError, match="loops must be in"):
        sched.add(req("x", [1], max_loops=5))
    with pytest.raises(ValueError, match="id already in use"):
        sched.add(req("g0", [1]))
    trace = drive(sched, runner, {1: [good[1]]})
    assert set(trace.finished) == {"g0", "g1"} and good[1].output_token_ids == [3, 4, 5, 6]
    sched.add(req("fits", range(31), max_tokens=5))  # 31 + 1 tokens fill the pool exactly
    drive(sched, runner)
    assert sched.block_manager.num_free_pages == 8


def test_protocol_errors():
    sched, runner = setup(cfg())
    assert sched.schedule() is None
    sched.add(req("A", [1]))
    plan = sched.schedule()
    out = runner.run(plan)
    ahead = sched.schedule()  # one plan may be planned ahead of the update of the other
    assert ahead.input_on_device == (True,) and ahead.token_ranges == ((1, 2),)
    with pytest.raises(RuntimeError, match="before update"):
        sched.schedule()
    with pytest.raises(ValueError, match="oldest plan"):
        sched.update(ahead, runner.run(ahead))
    with pytest.raises(ValueError, match="1 real rows"):
        sched.update(plan, StepOutput(token_ids=[], exit_loops=[]))
    with pytest.raises(ValueError, match="must emit a token"):
        sched.update(plan, StepOutput(token_ids=[None], exit_loops=[None]))
    sched.update(plan, out)
    with pytest.raises(ValueError, match="oldest plan"):
        sched.update(plan, StepOutput(token_ids=[2], exit_loops=[4]))


def test_timestamps_ttft_tpot():
    now = [0.0]
    config = cfg()
    sched = Scheduler(config, clock=lambda: now[0])
    runner = FakeRunner(config.page_size, config.num_pages, V)
    r = req("A", [1], max_tokens=3)
    sched.add(r)
    for t in (1.0, 3.0, 5.0):
        now[0] = t
        step(sched, runner)
    assert (r.arrival_time, r.first_token_time, r.finish_time) == (0.0, 1.0, 5.0)
    assert r.ttft == 1.0 and r.tpot == 2.0


def test_admission_errors_word_their_counts():
    """Every count in a one-line refusal reads right for one ("1 token", not "1 tokens")."""
    from loopjax.wording import counted, pool_size

    assert (counted(1, "page"), counted(0, "page"), counted(2, "entry", "entries")) == ("1 page", "0 pages",
                                                                                        "2 entries")
    with pytest.raises(ValueError, match=r"prompt of 1 token leaves no room .*max_context_len=1$"):
        Scheduler(cfg(max_context_len=1)).add(req("A", [1]))
    with pytest.raises(ValueError, match=r"prompt of 2 tokens does not fit the KV pool "
                                         r"\(1 page x 1 token = 1 token\)$"):
        Scheduler(cfg(page_size=1, num_pages=1)).add(req("B", [1, 2]))
    assert pool_size(3, 16) == "3 pages x 16 tokens = 48 tokens"


def test_config_validation():
    with pytest.raises(ValueError, match="SchedulerConfig.num_pages must be an integer >= 1"):
        cfg(num_pages=0)
    with pytest.raises(ValueError, match="max_loops"):
        cfg(num_loops=4, max_loops=2)
    c = cfg(max_prefill_tokens=20)
    assert c.token_buckets == (8, 16, 20) and c.token_bucket(17) == 20
    assert c.max_seq_len == 64 and c.max_pages_per_request == 16
    assert c.prefill_share(4) == 4 and cfg(prefill_share_per_loop=False).prefill_share(4) == 1


@pytest.mark.parametrize("seed", range(40))
def test_random_configs_tiny_pool_equals_big_pool(seed):
    """Any config knob mix: a pool of one longest sequence (+ a few pages) gives the tokens of
    an unconstrained pool, never stalls and gets every page back (the prefix cache on or off;
    half the prompts start with a common prefix)."""
    rng = random.Random(seed)
    page_size, ctx = rng.choice([1, 2, 4]), rng.randint(4, 24)
    knobs = dict(page_size=page_size, max_num_rows=rng.choice([1, 3, 8]), max_context_len=ctx,
                 max_prefill_tokens=rng.choice([1, 3, 8, 32]), max_prefill_rows=rng.choice([1, 4]),
                 max_prefill_batches_before_decode=rng.choice([1, 2]),
                 prefill_share_per_loop=rng.random() < 0.5, fused_decode=rng.random() < 0.5,
                 enable_prefix_caching=rng.random() < 0.5)
    adaptive = rng.random() < 0.5

    def workload():
        wl = random.Random(seed)
        common = [wl.randrange(V) for _ in range(ctx)]
        arrivals = {}
        for i in range(15):
            n = wl.randint(1, ctx - 1)
            prompt = common[:n] if wl.random() < 0.5 else [wl.randrange(V) for _ in range(n)]
            r = req(f"r{i}", prompt, max_tokens=wl.randint(1, 12), stop=(wl.randrange(V),),
                    adaptive=adaptive and wl.random() < 0.5, max_loops=wl.choice([None, 1, 2, 4]),
                    cache_salt=wl.choice([None, ()]))
            arrivals.setdefault(wl.randint(0, 30), []).append(r)
        return arrivals

    min_pages = -(-ctx // page_size)
    results = []
    for num_pages in (1000, rng.randint(min_pages, min_pages + 4)):
        for pipelined in (False, True):
            sched, runner = setup(cfg(num_pages=num_pages, **knobs))
            results.append(_outputs(drive(sched, runner, workload(), pipelined=pipelined)))
            assert sched.block_manager.num_free_pages == num_pages and not sched.has_unfinished()
            for rid, (tokens, _, reason) in results[-1].items():  # a dropped token only after a stop
                dropped = runner.emitted[rid] - len(tokens)
                assert dropped == 0 or (dropped == 1 and reason == "stop" and pipelined), rid
    assert all(r == results[0] for r in results) and len(results[0]) == 15


# ---------------------------------------------------------------- planning ahead (async scheduling)

def assert_pool_whole(sched):
    assert not sched.has_unfinished() and not sched.running
    sched.block_manager.check([])
    assert sched.block_manager.num_free_pages == sched.config.num_pages


def test_plans_ahead_while_one_is_in_flight():
    sched, runner = setup(cfg())
    a, b = req("A", [10, 11, 12], 3), req("B", [20, 21], 5)
    trace = drive(sched, runner, {0: [a, b]}, pipelined=True)
    # 0 P[A,B], and D[A,B] planned before its update (share used): inputs on the device.
    # 1, 2: the next decode ahead of each update; at 2 A (3rd token in flight) is left out,
    # at 4 B (5th) too: nothing to plan ahead, so the update comes first ("|").
    assert trace.kinds == "PDDDD|"
    assert trace.rows == [["A", "B"]] * 3 + [["B"]] * 2
    assert a.output_token_ids == [13, 14, 15] and b.output_token_ids == [22, 23, 24, 25, 26]
    assert runner.emitted == {"A": 3, "B": 5}  # max_tokens never over-schedules
    assert a.decode_submissions_per_token == b.decode_submissions_per_token == 1.0
    assert_pool_whole(sched)


def test_stop_and_abort_drop_the_token_in_flight():
    sched, runner = setup(cfg(page_size=2, num_pages=6))
    a = req("A", [1], max_tokens=10, stop=(3,))
    b, c = req("B", [50, 51], max_tokens=10), req("C", [70, 71, 72, 73, 74, 75, 76], 2)

    def act(step):
        if step == 3:
            assert b.num_pending_tokens == 1 and sched.abort("B") is b  # its decode is in flight
    trace = drive(sched, runner, {0: [a, b], 3: [c]}, before_step=act, pipelined=True)
    # A samples 2 then the stop token 3; its next decode was already planned with 3 as input:
    # that token (4) is sampled on the device and dropped. B is aborted with a decode in flight.
    assert a.output_token_ids == [2, 3] and a.finish_reason == "stop" and runner.emitted["A"] == 3
    assert b.finish_reason == "abort" and runner.emitted["B"] > len(b.output_token_ids)
    # C (4 pages) fits only in pages A and B gave back while their last decodes were in
    # flight: planned after those (the fake pool checks every slot it reads back).
    assert trace.rows[trace.kinds.replace("|", "").index("P", 1)] == ["C"]
    assert c.output_token_ids == [77, 78]
    assert_pool_whole(sched)


def test_preemption_falls_back_to_the_synchronous_order():
    config = cfg(page_size=2, num_pages=4, max_context_len=8)
    sched, runner = setup(config)
    a, b = req("A", [1, 2, 3], 4), req("B", [4, 5, 6], 4)
    trace = drive(sched, runner, {0: [a, b]}, pipelined=True)
    # 0 P[A,B] (pool full), D[A,B] ahead; 1 A's next position needs a page: no plan ahead
    # ("|"); 2 after the update, B is preempted as in the synchronous order, D[A] and D[A]
    # ahead; 3 A's last token is in flight and B cannot be admitted: "|"; 4 P[B], D[B].
    assert trace.kinds == "PD|DD|PD|"
    assert a.output_token_ids == [4, 5, 6, 7] and b.output_token_ids == [7, 8, 9, 10]
    assert sched.num_preemptions == 1 and runner.emitted == {"A": 4, "B": 4}
    assert_pool_whole(sched)


def _check_queues(sched):
    """The scheduler's contracts between steps: the pool matches the live page lists; running is
    by arrival; the queue holds the preempted (by arrival), then the new (by arrival), none with
    a page; no request holds a page past the positions of its next step."""
    bm = sched.block_manager
    bm.check(sched.requests.values())
    assert {id(r) for r in (*sched.running, *sched.waiting)} == {id(r) for r in sched.requests.values()}
    assert len(sched.running) + len(sched.waiting) == len(sched.requests)
    assert len(sched.running) <= sched.config.max_num_rows
    assert [r.arrival_order for r in sched.running] == sorted(r.arrival_order for r in sched.running)
    queue = [(r.phase is not RequestPhase.PREEMPTED, r.arrival_order) for r in sched.waiting]
    assert queue == sorted(queue) and {r.phase for r in sched.waiting} <= {RequestPhase.WAITING,
                                                                           RequestPhase.PREEMPTED}
    assert all(not r.page_ids and r.num_computed_tokens == r.num_pending_tokens == 0 for r in sched.waiting)
    for r in sched.running:
        assert r.num_computed_tokens <= len(r.page_ids) * bm.page_size
        assert len(r.page_ids) <= bm.pages_for(r.num_planned_tokens) and r.num_pending_tokens <= 2


def _alone(prompt, max_tokens, stop, stop_at, loops, max_seq_len):
    """Tokens, exit loops and finish reason of a fixed-depth request run alone (the fake's rule);
    stop_at: the engine finishes it after that many tokens (a stop string)."""
    tokens = []
    while True:
        tokens.append((prompt[-1] + len(tokens) + 1) % V)
        if tokens[-1] in stop:
            return tokens, [loops] * len(tokens), "stop"
        if len(tokens) == max_tokens or len(prompt) + len(tokens) == max_seq_len:
            return tokens, [loops] * len(tokens), "length"
        if len(tokens) == stop_at:
            return tokens, [loops] * len(tokens), "stop"


@pytest.mark.parametrize("seed", range(60))
def test_random_aborts_and_stops_while_planning_ahead(seed):
    """Aborts in any phase (a row in flight included) and engine finishes (stop strings) with
    async scheduling, preemption, the prefix cache, decode pages and groups of n samples: the
    queues and the pool keep their contracts after every step, every finished request has the
    tokens it has alone (an aborted one a prefix of them), a dropped token follows only a stop
    or an abort, and every page and decode slot comes back."""
    rng = random.Random(seed)
    page_size, ctx = rng.choice([1, 2, 3, 4]), rng.randint(3, 24)
    min_pages = -(-ctx // page_size)
    planes = rng.choice([0, 0, 2, 4])
    config = cfg(page_size=page_size, max_context_len=ctx, max_num_rows=rng.choice([1, 2, 3, 8]),
                 num_pages=rng.choice([400, rng.randint(min_pages, min_pages + 3)]),
                 max_prefill_tokens=rng.choice([1, 3, 8, 32]), max_prefill_rows=rng.choice([1, 2, 4]),
                 fused_decode=rng.random() < 0.7, enable_prefix_caching=rng.random() < 0.6,
                 decode_page_planes=planes, max_loops=8)
    pipelined, abort_rate = rng.random() < 0.7, rng.choice([0.05, 0.15])
    common = [rng.randrange(V) for _ in range(ctx)]
    arrivals, requests, expected, stop_at = {}, {}, {}, {}
    for g in range(rng.randint(2, 8)):  # a group: n samples of one prompt, arriving together
        prompt = common[:rng.randint(1, ctx - 1)] if rng.random() < 0.6 else \
            [rng.randrange(V) for _ in range(rng.randint(1, ctx - 1))]
        max_tokens, stop, loops = rng.randint(1, 10), (rng.randrange(V),), rng.choice([None, 1, 8])
        at, salt, k = rng.randint(0, 20), rng.choice([(), (), None]), rng.choice([None, rng.randint(1, 5)])
        for i in range(rng.choice([1, 1, 2, 3])):
            rid = f"g{g}s{i}"
            requests[rid] = req(rid, prompt, max_tokens, stop, max_loops=loops, cache_salt=salt)
            arrivals.setdefault(at, []).append(requests[rid])
            expected[rid] = _alone(prompt, max_tokens, stop, k, loops or 4, ctx)
            stop_at[rid] = k
    sched = Scheduler(config)
    runner = FakeRunner(page_size, config.num_pages * (1 + planes), V, sched.block_manager)
    aborted = set()

    def chaos(step):
        _check_queues(sched)
        for r in list(sched.requests.values()):  # the engine's stop string, after the update
            if stop_at[r.request_id] is not None and r.num_output_tokens >= stop_at[r.request_id]:
                sched.finish(r.request_id, "stop")
        if sched.requests and rng.random() < abort_rate:
            rid = rng.choice(sorted(sched.requests))
            assert sched.abort(rid).page_ids == []
            aborted.add(rid)
    drive(sched, runner, arrivals, before_step=chaos, pipelined=pipelined)
    _check_queues(sched)
    bm = sched.block_manager
    assert bm.num_free_pages == config.num_pages and bm.num_free_decode_slots == 0 and not sched.running
    for rid, r in requests.items():
        tokens, loops, reason = expected[rid]
        if rid in aborted:
            n = r.num_output_tokens
            assert (r.output_token_ids, r.exit_loops, r.finish_reason) == (tokens[:n], loops[:n], "abort")
        else:
            assert (r.output_token_ids, r.exit_loops, r.finish_reason) == expected[rid], rid
            dropped = runner.emitted.get(rid, 0) - r.num_output_tokens
            assert dropped == 0 or (dropped == 1 and pipelined and reason == "stop"), rid
