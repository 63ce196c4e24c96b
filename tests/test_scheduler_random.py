"""Seeded randomized scenarios for the scheduler, block manager and prefix cache, against the
fake runner (tests/fake_runner.py: next token = last + 1, adaptive rows exit at 1 + last % depth;
it checks every slot a step writes and reads). Each scenario draws a config (tight pools that
force preemption, the prefix cache, decode pages, fused or per-loop decode, planning ahead,
fused submissions compiled deeper than their rows) and
a workload (n-sample groups, shared prefixes, prompts at the context and pool limits, adaptive
and whole-prefill requests, stop tokens, engine stop strings, aborts in every phase, dispatches
that fail, aborts while plans are in flight, prompts past the context or the pool, refused in
one line with nothing queued), drives it to the end and checks the invariants listed in
`_Checker`."""

from __future__ import annotations

import random
from collections import deque

import pytest
from fake_runner import VOCAB as V
from fake_runner import FakeRunner, adaptive_exit

from loopjax.request import Request, RequestPhase
from loopjax.sampling_params import SamplingParams
from loopjax.scheduler import Scheduler, SchedulerConfig, StepKind

PHASES = (RequestPhase.WAITING, RequestPhase.PREFILLING, RequestPhase.DECODING, RequestPhase.PREEMPTED)


def _config(rng: random.Random) -> SchedulerConfig:
    page_size, ctx = rng.choice([1, 2, 3, 4, 8]), rng.randint(3, 40)
    min_pages = -(-ctx // page_size)
    # NOTE: half the pools hold one longest sequence plus a page or two: preemption is frequent
    num_pages = rng.choice([min_pages, min_pages + 1, min_pages + rng.randint(2, 6), 500])
    if rng.random() < 0.2:  # a pool smaller than the context: max_seq_len is the pool's
        num_pages = max(-(-2 // page_size), min_pages - rng.randint(1, 3))
    fused = rng.random() < 0.7
    return SchedulerConfig(
        page_size=page_size, num_pages=num_pages, max_num_rows=rng.choice([1, 2, 3, 5, 8]),
        decode_row_buckets=rng.choice([(1, 8), (1, 2, 4, 8), (8,)]), max_context_len=ctx,
        max_prefill_tokens=rng.choice([1, 2, 5, 8, 32]), prefill_token_buckets=(4, 16),
        max_prefill_rows=rng.choice([1, 2, 4]), max_prefill_batches_before_decode=rng.choice([1, 2]),
        prefill_share_per_loop=rng.random() < 0.6, num_loops=rng.choice([1, 2, 4]), max_loops=4,
        fused_decode=fused, enable_prefix_caching=rng.random() < 0.6,
        decode_page_planes=rng.choice([0, 0, 0, 2, 4]))


def _alone(prompt, max_tokens, stop, stop_at, loops, adaptive, max_seq_len):
    """(tokens, exit loops, finish reason) of a request run alone by the fake's rule; stop_at:
    the engine finishes it (a stop string) once it has that many tokens."""
    tokens, exits = [], []
    while True:
        last = tokens[-1] if tokens else prompt[-1]
        tokens.append((last + 1) % V)
        exits.append(adaptive_exit(last, loops) if adaptive else loops)
        if tokens[-1] in stop:
            return tokens, exits, "stop"
        if (max_tokens is not None and len(tokens) == max_tokens) or len(prompt) + len(tokens) >= max_seq_len:
            return tokens, exits, "length"
        if len(tokens) == stop_at:
            return tokens, exits, "stop"


def _workload(rng: random.Random, config: SchedulerConfig):
    """arrivals {step: [Request]}, expected {id: alone result}, stop_at {id: k or None}."""
    ctx, seq = config.max_context_len, config.max_seq_len
    common = [rng.randrange(V) for _ in range(ctx)]
    arrivals, expected, stop_at = {}, {}, {}
    for g in range(rng.randint(2, 10)):
        # prompt lengths: 1, the limit (room for one token), a page boundary, or anything
        limit = seq - 1
        n = rng.choice([1, limit, max(1, min(limit, config.page_size * rng.randint(1, 3))),
                        rng.randint(1, limit), rng.randint(1, limit)])
        prompt = common[:n] if rng.random() < 0.5 else [rng.randrange(V) for _ in range(n)]
        adaptive = rng.random() < 0.2  # planned one loop per submission
        loops = rng.choice([None, 1, 2, 4])
        max_tokens = rng.choice([1, rng.randint(1, 12), seq, 10_000])
        stop = (rng.randrange(V),) if rng.random() < 0.5 else ()
        k = rng.choice([None, None, rng.randint(1, 6)])
        salt = rng.choice([(), (), None])
        whole = adaptive and rng.random() < 0.5
        at = rng.choice([0, 0, rng.randint(0, 30)])
        lag = rng.choice([0, 0, 1, 3, 8])  # samples 1.. arrive together, after sample 0 (the server's n)
        for i in range(rng.choice([1, 1, 2, 4])):  # n samples of one prompt
            rid = f"g{g}s{i}"
            params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, temperature=0.0, seed=0)
            r = Request(rid, prompt, params, adaptive=adaptive, max_loops=loops, cache_salt=salt,
                        whole_prefill=whole)
            arrivals.setdefault(at + (lag if i else 0), []).append(r)
            depth = loops or config.num_loops
            expected[rid] = _alone(prompt, max_tokens, stop, k, depth, adaptive, seq)
            stop_at[rid] = k
    return arrivals, expected, stop_at


class _Checker:
    """Invariants, checked around every schedule() and update():
    - the pool: `BlockManager.check` (ref counts = the live page lists, no page held twice or
      both free and parked, prefix-cache maps inverse, decode slots consistent); the fake runner
      checks every slot a step writes or reads and that no step writes a shared/published page;
    - the queues: running by arrival and within max_num_rows, the queue preempted-first by
      arrival, queued requests hold no page and nothing computed; a partially prefilled
      request is the newest running one (so it has no newer row to preempt);
    - every plan: its rows within max_prefill_rows / max_num_rows and its tokens within
      max_prefill_tokens, buckets compiled ones, no request twice, no finished row, decode rows
      decoding, prefill rows holding full pages only, its pages covering its positions;
      admissions a prefix of the queue (FCFS); no prefill step once the prefill share is used
      up while rows wait to decode; a cached page held or parked, never on the free list;
      preempted requests queued with no page, newer than every request running on (vLLM's
      order: the newest first), never the oldest running request;
    - progress: the oldest running request advances within a bounded number of updates, and
      the whole scenario ends within a bounded number of steps;
    - at the end: every request finished exactly once (by an update, an abort or the engine),
      with its alone tokens (a prefix when aborted), every page and decode slot free."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        cfg = sched.config
        self.window = cfg.loop_cap * (cfg.prefill_share(cfg.loop_cap) + 2) + 4
        self.oldest, self.progress, self.stalled = None, None, 0
        self.finished: dict[str, str] = {}
        self.aborted_phases: set[RequestPhase] = set()

    def queues(self):
        sched, bm = self.sched, self.sched.block_manager
        bm.check(sched.requests.values())
        cache = bm.prefix_cache
        if cache is not None:  # a cached page is held or parked, never free to be overwritten
            assert all(bm.ref_count(p) or cache.is_parked(p) for p in range(bm.num_pages) if cache.key_of(p))
        assert len(sched.running) + len(sched.waiting) == len(sched.requests)
        assert {id(r) for r in (*sched.running, *sched.waiting)} == {id(r) for r in sched.requests.values()}
        assert len(sched.running) <= sched.config.max_num_rows
        assert [r.arrival_order for r in sched.running] == sorted(r.arrival_order for r in sched.running)
        queue = [(r.phase is not RequestPhase.PREEMPTED, r.arrival_order) for r in sched.waiting]
        assert queue == sorted(queue)
        for r in sched.waiting:
            assert r.phase in (RequestPhase.WAITING, RequestPhase.PREEMPTED)
            assert not r.page_ids and r.num_computed_tokens == r.num_pending_tokens == 0
        prefilling = [r for r in sched.running if r.phase is RequestPhase.PREFILLING]
        assert prefilling in ([], sched.running[-1:]), "a request runs newer than a partial prefill"
        for r in sched.running:
            assert r.phase in (RequestPhase.PREFILLING, RequestPhase.DECODING)
            assert r.num_computed_tokens <= len(r.page_ids) * bm.page_size
            assert len(r.page_ids) <= bm.pages_for(max(1, r.num_planned_tokens))
            assert r.num_planned_tokens <= sched.config.max_seq_len

    def before_schedule(self):
        sched = self.sched
        self.queue = list(sched.waiting)
        self.oldest_running = sched.running[0] if sched.running else None
        # NOTE: private state, read to check the prefill share (scheduler.py's module note)
        self.share_used = (any(sched._decodes_next(r) for r in sched.running)
                           and sched._share.used_up)

    def plan(self, plan):
        cfg = self.sched.config
        rows = plan.requests
        assert len({id(r) for r in rows}) == len(rows), "a request twice in one plan"
        assert not any(r.is_finished for r in rows)
        if plan.kind is StepKind.PREFILL:
            assert not self.share_used, "a prefill step past the share while rows wait to decode"
            assert len(rows) <= cfg.max_prefill_rows and plan.num_real_tokens <= cfg.max_prefill_tokens
            assert plan.token_bucket in cfg.token_buckets and plan.row_bucket in cfg.prefill_row_buckets
            assert not any(plan.input_on_device)
            assert all(p < cfg.num_pages for r in rows for p in r.page_ids), "a decode page in a prefill"
        else:
            assert len(rows) <= cfg.max_num_rows and plan.row_bucket in cfg.row_buckets
            assert all(r.phase is RequestPhase.DECODING for r in rows)
        for r, (start, end) in zip(rows, plan.token_ranges):
            assert 0 <= start < end <= cfg.max_seq_len and len(r.page_ids) * cfg.page_size >= end
        admitted = [r for r in self.queue if r.phase not in (RequestPhase.WAITING, RequestPhase.PREEMPTED)]
        assert admitted == self.queue[:len(admitted)], "a request overtook the head of the queue"
        newest_running = max((r.arrival_order for r in self.sched.running), default=-1)
        for r in plan.preempted:
            assert r.phase is RequestPhase.PREEMPTED and not r.page_ids and r in self.sched.waiting
            assert r is not self.oldest_running, "the oldest running request was preempted"
            assert r.arrival_order > newest_running, "a request was preempted while a newer one runs on"

    def after_update(self, changed):
        for r in changed:
            if r.is_finished:
                self.finish(r)
        running = self.sched.running
        oldest = running[0] if running else None
        progress = oldest and (oldest.num_computed_tokens, oldest.num_output_tokens, oldest.num_loops_done)
        if oldest is not None and oldest is self.oldest and progress == self.progress:
            self.stalled += 1
            assert self.stalled <= self.window, f"{oldest.request_id} starves ({self.stalled} updates)"
        else:
            self.stalled = 0
        self.oldest, self.progress = oldest, progress

    def finish(self, r: Request):
        assert r.is_finished and r.finish_reason and r.request_id not in self.sched.requests
        assert r.request_id not in self.finished, f"{r.request_id} finished twice"
        self.finished[r.request_id] = r.finish_reason


def _scenario(seed: int) -> dict:
    rng = random.Random(seed)
    config = _config(rng)
    arrivals, expected, stop_at = _workload(rng, config)
    requests = {r.request_id: r for rs in arrivals.values() for r in rs}
    # every third scenario: fused submissions compiled for the deepest loop count (the share counts it)
    sched = Scheduler(config, loop_count=(lambda n: config.loop_cap) if seed % 3 == 0 else None)
    planes = config.decode_page_planes
    runner = FakeRunner(config.page_size, config.num_pages * (1 + planes), V, sched.block_manager)
    check = _Checker(sched)
    pipelined = rng.random() < 0.6
    abort_rate, drop_rate = rng.choice([0.0, 0.05, 0.15]), rng.choice([0.0, 0.0, 0.03])
    aborted: set[str] = set()
    max_steps = 200 + 40 * sum(len(r.prompt_token_ids) + 12 * 4 for r in requests.values())
    in_flight: deque = deque()
    for step in range(max_steps):
        for r in arrivals.pop(step, []):
            sched.add(r)
        if rng.random() < 0.05:  # past the context or the pool: one line, nothing queued, the rest served
            n = config.max_seq_len + rng.choice([0, 0, 1, 50])
            before = (len(sched.requests), len(sched.waiting), sched.block_manager.num_free_pages)
            with pytest.raises(ValueError, match=r"^request 'big': prompt of \d+ tokens (leav|does)") as e:
                sched.add(Request("big", [1] * n, SamplingParams(max_tokens=1)))
            assert "\n" not in str(e.value)
            assert (len(sched.requests), len(sched.waiting), sched.block_manager.num_free_pages) == before
        check.queues()
        for r in list(sched.requests.values()):  # the engine's stop strings, after an update
            k = stop_at[r.request_id]
            if k is not None and r.num_output_tokens >= k:
                assert sched.finish(r.request_id, "stop") is r
                check.finish(r)
        if sched.requests and rng.random() < abort_rate:
            phase = rng.choice(PHASES)  # a victim in a chosen phase, if any is in it
            live = sorted(rid for rid, r in sched.requests.items() if r.phase is phase)
            live = live or sorted(sched.requests)
            victim = sched.get(rng.choice(live))
            check.aborted_phases.add((victim.phase, victim.num_pending_tokens > 0))
            assert sched.abort(victim.request_id) is victim
            assert victim.page_ids == [] and victim.finish_reason == "abort"
            aborted.add(victim.request_id)
            check.finish(victim)
        dropped = False
        while not in_flight or (pipelined and len(in_flight) == 1 and sched.can_schedule_ahead()):
            check.before_schedule()
            plan = sched.schedule()
            if plan is None:
                break
            check.plan(plan)
            if rng.random() < drop_rate:  # its dispatch raised: the plan never runs
                for r in plan.preempted:
                    runner.loops_done.pop(r.request_id, None)
                for r in sched.drop(plan):
                    aborted.add(r.request_id)
                    check.finish(r)
                dropped = True
                break
            in_flight.append((plan, runner.run(plan)))
        if in_flight and sched.requests and rng.random() < abort_rate / 3:
            # an abort while the host waits for the device (Ctrl-C in the read): every plan in flight
            victim = sched.get(rng.choice(sorted(sched.requests)))
            check.aborted_phases.add((victim.phase, True))
            assert sched.abort(victim.request_id) is victim and victim.page_ids == []
            aborted.add(victim.request_id)
            check.finish(victim)
        if not in_flight:
            if not arrivals and not sched.has_unfinished():
                break
            assert arrivals or dropped, "nothing planned while requests are unfinished"
            continue
        check.after_update(sched.update(*in_flight.popleft()))
    else:
        raise AssertionError(f"seed {seed}: not done after {max_steps} steps")
    check.queues()
    bm = sched.block_manager
    assert not sched.requests and not sched.running and not sched.waiting and not in_flight
    assert bm.num_free_pages == config.num_pages and bm.num_free_decode_slots == 0
    assert all(bm.ref_count(p) == 0 for p in range(config.num_pages))
    assert set(check.finished) == set(requests), "a request never finished"
    for rid, r in requests.items():
        tokens, exits, reason = expected[rid]
        n = r.num_output_tokens
        if rid in aborted:
            tokens, exits, reason = tokens[:n], exits[:n], "abort"
        assert (r.output_token_ids, r.exit_loops, r.finish_reason) == (tokens, exits, reason), rid
        # tokens sampled and dropped: those in flight at an abort (two plans at most), or one
        # after a stop the scheduler could not foresee while it planned ahead
        dropped = runner.emitted.get(rid, 0) - n
        assert dropped <= (2 if rid in aborted else int(pipelined and reason == "stop")), rid
    return {"preemptions": sched.num_preemptions, "aborted_phases": check.aborted_phases,
            "hits": sched.stats()["prefix_cache_hit_tokens"]}


SEEDS = range(300)


def test_random_scenarios_keep_every_invariant():
    """300 scenarios (~a few seconds): see _Checker for the invariants. Over the seeds, the
    pools force preemption, the prefix cache hits, and aborts reach every phase."""
    preemptions = hits = 0
    phases = set()
    for seed in SEEDS:
        try:
            result = _scenario(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
        preemptions += result["preemptions"]
        hits += result["hits"]
        phases |= result["aborted_phases"]
    assert preemptions > 0 and hits > 0 and {p for p, _ in phases} == set(PHASES)
    assert (RequestPhase.DECODING, True) in phases  # aborted with a token in flight


def test_the_host_scheduler_imports_no_jax():
    """scheduler.py's contract (pure Python: the host plans while the device runs); checked in a
    fresh interpreter, as this one has JAX loaded by other tests."""
    import subprocess
    import sys

    code = ("import sys, loopjax.scheduler, loopjax.async_engine; "
            "print(sorted(m for m in ('jax', 'jaxlib', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
