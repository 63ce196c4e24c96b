"""Prefix cache against the fake runner (tests/fake_runner.py). The fake's pool stores, per
slot, (identity, position, tokens up to it), identity = (cache_salt, loops) for shareable
requests and the request id otherwise, and asserts every read and that no step writes a
shared or published page: a page shared wrongly, evicted while held or freed too early fails
at once. Page size 4 throughout; expected hits are computed by hand from the rules in
loopjax/prefix_cache.py (full pages only, the last token always computed)."""

import random

import pytest
from fake_runner import VOCAB as V
from fake_runner import drive, setup, step

from loopjax.block_manager import BlockManager
from loopjax.prefix_cache import PrefixCache
from loopjax.request import Request, RequestPhase
from loopjax.sampling_params import SamplingParams
from loopjax.scheduler import SchedulerConfig

OURO = ()                # Ouro's salt: KV depends on tokens and loops only
SEEDED0 = ("seeded", 0)  # Huginn, position-keyed s0 with seed 0


def cfg(**kw):
    base = dict(page_size=4, num_pages=64, max_num_rows=8, decode_row_buckets=(1, 2, 4, 8),
                max_prefill_tokens=32, prefill_token_buckets=(8, 16, 32), max_prefill_rows=4,
                max_context_len=64, num_loops=4, enable_prefix_caching=True)
    base.update(kw)
    return SchedulerConfig(**base)


def req(rid, prompt, max_tokens=4, salt=OURO, **kw):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=0)
    return Request(rid, list(prompt), params, cache_salt=salt, **kw)


def assert_pool_whole(sched):
    bm = sched.block_manager
    bm.check([])
    assert all(bm.ref_count(p) == 0 for p in range(bm.num_pages))
    assert bm.num_free_pages == bm.num_pages and bm.num_used_pages == 0


def _outputs(trace):
    return {rid: (r.output_token_ids, r.exit_loops, r.finish_reason) for rid, r in trace.finished.items()}


# ---------------------------------------------------------------- keys

def test_page_keys_chain_once_per_page_and_root_separates_salts_and_loops():
    cache = PrefixCache(page_size=4)
    a = req("a", range(10))
    keys = cache.keys(a, 2)
    assert len(keys) == 2 and keys is a.page_keys and len(set(keys)) == 2
    first = list(keys)
    a.output_token_ids = [10, 11]  # page 2 completes: only it is hashed, the chain is kept
    assert cache.keys(a, 3)[:2] == first and len(a.page_keys) == 3
    same = req("b", list(range(8)) + [77])  # same first two pages, other tail
    assert cache.keys(same, 2) == first
    other_page1 = req("c", [0, 1, 2, 3, 4, 5, 6, 99])
    assert cache.keys(other_page1, 2)[0] == first[0] and other_page1.page_keys[1] != first[1]
    for different_root in (req("d", range(8), salt=SEEDED0), req("e", range(8), salt=("seeded", 1)),
                           req("f", range(8), max_loops=2), req("g", range(8), max_loops=8)):
        assert cache.keys(different_root, 2)[0] != first[0]
    assert cache.keys(req("h", range(8), salt=None), 2) == []        # explicit / random states
    assert cache.keys(req("i", range(8), adaptive=True), 2) == []    # exits change its KV


# ---------------------------------------------------------------- sharing

def test_concurrent_requests_share_the_prefix_and_compute_only_the_rest():
    sched, runner = setup(cfg())
    prefix = list(range(1, 9))  # two full pages
    a = req("A", prefix + [50, 51], max_tokens=4)
    b, c = req("B", prefix + [60], max_tokens=3), req("C", prefix + [70, 71, 72], max_tokens=3)
    sched.add(a)
    step(sched, runner)           # 0 P[A 0:10]: pages 0, 1 published
    sched.add(b)
    sched.add(c)
    plan = step(sched, runner)    # 1 P[B, C] (the first decode waits for the share): each hits A's two pages
    assert [r.request_id for r in plan.requests] == ["B", "C"]
    assert plan.token_ranges == ((8, 9), (8, 11)) and plan.positions() == [8, 8, 9, 10]
    assert plan.num_real_tokens == 4 and (b.num_cached_tokens, c.num_cached_tokens) == (8, 8)
    shared = a.page_ids[:2]
    assert b.page_ids[:2] == c.page_ids[:2] == shared
    assert [sched.block_manager.ref_count(p) for p in shared] == [3, 3]
    assert b.page_ids[2] != c.page_ids[2]  # the tails are private
    drive(sched, runner)
    assert a.output_token_ids == [52, 53, 54, 55] and b.output_token_ids == [61, 62, 63]
    assert c.output_token_ids == [73, 74, 75]
    stats = sched.stats()
    # Queried: 10 + 9 + 11 tokens, (9 + 8 + 10) // 4 = 2 + 2 + 2 pages; hits: 2 pages each for B, C.
    assert (stats["prefix_cache_hit_tokens"], stats["prefix_cache_queried_tokens"]) == (16, 30)
    assert (stats["prefix_cache_hit_pages"], stats["prefix_cache_queried_pages"]) == (4, 6)
    assert stats["prefix_cache_hit_rate"] == 16 / 30 and stats["prefix_cache_page_hit_rate"] == 4 / 6
    assert stats["prefix_cache_evictions"] == 0 and stats["prefix_cache_pages"] >= 2
    assert_pool_whole(sched)


def test_a_hit_leaves_the_last_token_to_compute():
    sched, runner = setup(cfg())
    drive(sched, runner, {0: [req("A", range(8), max_tokens=1)]})  # pages 0, 1 cached
    same = req("B", range(8), max_tokens=1)   # a full hit would leave nothing to sample from
    one = req("C", [0], max_tokens=1)         # no full page at all
    trace = drive(sched, runner, {0: [same, one]})
    assert same.num_cached_tokens == 4 and one.num_cached_tokens == 0
    assert trace.rows[0] == ["B", "C"] and same.output_token_ids == [8] and one.output_token_ids == [1]
    assert sched.stats()["prefix_cache_hit_pages"] == 1


def test_multi_turn_session_hits_pages_of_generated_tokens():
    sched, runner = setup(cfg())
    turn1 = req("t1", range(1, 7), max_tokens=5)  # 1..6, generates 7..11
    drive(sched, runner, {0: [turn1]})
    assert turn1.output_token_ids == [7, 8, 9, 10, 11]
    # Computed: positions 0..9 (11 is never fed). Page 0 was published by the prefill, page 1
    # (tokens 5, 6 | 7, 8: generated) by a decode step; page 2 (9, 10, 11) is not full-computed.
    turn2 = req("t2", turn1.all_token_ids + [40, 41], max_tokens=2)
    trace = drive(sched, runner, {0: [turn2]})
    assert turn2.num_cached_tokens == 8 and trace.rows[0] == ["t2"]
    assert turn2.output_token_ids == [42, 43]
    assert_pool_whole(sched)


def test_no_sharing_across_loop_counts():
    sched, runner = setup(cfg())
    drive(sched, runner, {0: [req("deep", range(9), max_tokens=1)]})
    shallow = req("shallow", range(9), max_tokens=1, max_loops=2)
    drive(sched, runner, {0: [shallow]})
    assert shallow.num_cached_tokens == 0 and shallow.exit_loops == [2]
    again = req("again", range(9), max_tokens=1, max_loops=2)
    drive(sched, runner, {0: [again]})
    assert again.num_cached_tokens == 8


# ---------------------------------------------------------------- Huginn initial states

def test_huginn_without_position_keyed_states_never_hits():
    sched, runner = setup(cfg())
    prompt = list(range(20))
    explicit = [req(f"x{i}", prompt, max_tokens=6, salt=None) for i in range(3)]
    trace = drive(sched, runner, {0: explicit[:1], 3: explicit[1:2], 9: explicit[2:]})
    assert all(r.num_cached_tokens == 0 for r in explicit) and len(trace.finished) == 3
    stats = sched.stats()
    assert stats["prefix_cache_hit_tokens"] == 0 and stats["prefix_cache_queried_tokens"] == 60
    assert stats["prefix_cache_pages"] == 0  # nothing was published either
    # Adaptive exits change the KV: such requests neither publish nor hit.
    adaptive = [req(f"ad{i}", prompt, 2, adaptive=True) for i in range(2)]
    drive(sched, runner, {0: adaptive[:1], 5: adaptive[1:]})
    assert all(r.num_cached_tokens == 0 for r in adaptive)
    assert sched.stats()["prefix_cache_pages"] == 0 and sched.stats()["prefix_cache_hit_tokens"] == 0
    # Position-keyed states: the same seed shares, another seed does not.
    s0, s0_again, s1 = (req("s0", prompt, 2, salt=SEEDED0), req("s0b", prompt, 2, salt=SEEDED0),
                        req("s1", prompt, 2, salt=("seeded", 1)))
    drive(sched, runner, {0: [s0], 4: [s0_again, s1]})
    assert (s0.num_cached_tokens, s0_again.num_cached_tokens, s1.num_cached_tokens) == (0, 16, 0)
    assert_pool_whole(sched)


# ---------------------------------------------------------------- pressure, preemption, aborts

def test_parked_pages_are_evicted_only_for_room_deep_end_first():
    sched, runner = setup(cfg(num_pages=6))
    bm = sched.block_manager
    a = req("A", range(10, 18), max_tokens=1)  # 8 tokens: 2 pages, parked when A finishes
    drive(sched, runner, {0: [a]})
    assert (bm.prefix_cache.num_parked_pages, bm.num_free_pages) == (2, 6)
    drive(sched, runner, {0: [req("B", range(20, 28), max_tokens=1)]})
    assert bm.prefix_cache.num_parked_pages == 4 and bm.prefix_cache.num_evictions == 0
    drive(sched, runner, {0: [req("C", range(30, 42), max_tokens=1)]})  # 3 pages: 2 free + 1 evicted
    assert bm.prefix_cache.num_evictions == 1 and bm.prefix_cache.num_parked_pages == 6
    # The oldest parked page was A's tail (A released tail first): A's first page still hits;
    # D's other 2 pages evict the next oldest, B's (tail first again).
    d = req("D", list(range(10, 18)) + [99], max_tokens=1)
    drive(sched, runner, {0: [d]})
    assert d.num_cached_tokens == 4 and bm.prefix_cache.num_evictions == 3
    assert sched.get("B") is None and bm.match(req("B2", list(range(20, 28)) + [1])) == []
    assert sched.stats()["prefix_cache_evictions"] == bm.prefix_cache.num_evictions
    assert_pool_whole(sched)


def test_a_copy_computed_at_once_is_published_too_and_hits_after_the_other_is_gone():
    sched, runner = setup(cfg(num_pages=6, max_prefill_rows=2))
    bm = sched.block_manager
    # A and B computed the same first page in one step; A's copy is gone (C took every page B
    # does not hold), B's still hits (was: B's copy stayed unpublished, D missed).
    a, b = req("A", range(10, 15), max_tokens=2), req("B", range(10, 15), max_tokens=20)
    sched.add(a)
    sched.add(b)
    plan = step(sched, runner)
    assert plan.requests == (a, b) and a.num_cached_tokens == b.num_cached_tokens == 0
    copy = b.page_ids[0]
    assert bm.is_published(a.page_ids[0]) and bm.is_published(copy) and bm.prefix_cache.num_cached_pages == 2
    step(sched, runner)  # A finishes: its copy, released while B's lives, is freed, not parked
    assert a.is_finished and bm.prefix_cache.num_parked_pages == 0
    assert bm.prefix_cache.num_cached_pages == 1 and bm.is_published(copy)
    c = req("C", range(30, 43), max_tokens=1)  # 4 pages: every page B does not hold
    sched.add(c)
    while not c.is_finished:
        step(sched, runner)
    d = req("D", list(range(10, 14)) + [99], max_tokens=1)
    drive(sched, runner, {0: [d]})
    assert d.num_cached_tokens == 4 and d.output_token_ids == [100 % V]  # the fake checks what it read
    assert_pool_whole(sched)


def test_a_hit_takes_a_held_copy_before_a_parked_one():
    cache = PrefixCache(page_size=4)
    r = req("r", range(9), max_loops=4)
    key = cache.keys(r, 1)[0]
    cache.publish(5, key)
    assert cache.park(5)  # the only copy: parked
    cache.publish(7, key)  # computed meanwhile by a request admitted before 5 was published
    assert cache.match(r) == [7] and cache.num_cached_pages == 2  # taking 5 would cost a free page
    assert not cache.park(7) and cache.key_of(7) is None  # released while 5 lives: freed
    assert cache.match(r) == [5] and (cache.evict(), cache.match(r)) == (5, [])
    cache.check()


def test_preempting_a_request_that_holds_shared_pages():
    config = cfg(page_size=2, num_pages=7, max_context_len=16)
    sched, runner = setup(config)
    a = req("A", [1, 2, 3, 4, 5], max_tokens=8)
    b = req("B", [1, 2, 3, 4, 9], max_tokens=8)
    ref_counts = []  # of the two shared pages, before each step

    def watch(k):
        if len(b.page_ids) >= 2 and b.page_ids[:2] == a.page_ids[:2]:
            ref_counts.append(tuple(sched.block_manager.ref_count(p) for p in a.page_ids[:2]))
        elif b.phase is RequestPhase.PREEMPTED:
            ref_counts.append(tuple(sched.block_manager.ref_count(p) for p in a.page_ids[:2]))
    trace = drive(sched, runner, {0: [a], 2: [b]}, before_step=watch)
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert (2, 2) in ref_counts and (1, 1) in ref_counts  # B's preemption kept A's pages alive
    assert a.output_token_ids == list(range(6, 14)) and b.output_token_ids == list(range(10, 18))
    # Same tokens as an unconstrained pool without the cache.
    big_sched, big_runner = setup(cfg(page_size=2, num_pages=100, max_context_len=16,
                                      enable_prefix_caching=False))
    big = drive(big_sched, big_runner, {0: [req("A", [1, 2, 3, 4, 5], 8)], 2: [req("B", [1, 2, 3, 4, 9], 8)]})
    assert _outputs(trace) == _outputs(big)
    assert sched.stats()["prefix_cache_hit_pages"] >= 2
    assert_pool_whole(sched)


def test_abort_mid_prefill_returns_every_reference():
    config = cfg(max_prefill_tokens=6, prefill_token_buckets=(8,))
    sched, runner = setup(config)
    bm = sched.block_manager
    prompt = list(range(20))
    a = req("A", prompt, max_tokens=2)
    sched.add(a)
    step(sched, runner)                 # P[A 0:6]: page 0 full and published, page 1 half
    assert a.phase is RequestPhase.PREFILLING and len(a.page_ids) == 2
    sched.abort("A")
    assert bm.prefix_cache.num_parked_pages == 1 and bm.num_used_pages == 0
    assert_pool_whole(sched)
    b, c = req("B", prompt, max_tokens=2), req("C", prompt, max_tokens=2)
    sched.add(b)
    assert step(sched, runner).token_ranges == ((4, 10),)  # B hits A's published page
    sched.add(c)
    step(sched, runner)                 # P[B 10:16] (B has no token yet: no decode row)
    plan = step(sched, runner)          # P[B 16:20, C 16:18]: C hits B's four computed pages
    assert plan.token_ranges == ((16, 20), (16, 18)) and c.num_cached_tokens == 16
    assert [bm.ref_count(p) for p in b.page_ids[:4]] == [2, 2, 2, 2]
    assert c.phase is RequestPhase.PREFILLING
    sched.abort("C")                    # mid-prefill, holding shared pages
    assert [bm.ref_count(p) for p in b.page_ids[:5]] == [1, 1, 1, 1, 1]
    bm.check(sched.requests.values())
    drive(sched, runner)
    assert b.output_token_ids == [20, 21]
    assert_pool_whole(sched)


# ---------------------------------------------------------------- the allocator alone

def test_reclaimable_counts_only_pages_every_holder_releases():
    bm = BlockManager(num_pages=8, page_size=4, enable_prefix_cache=True)
    old, new = req("old", range(9)), req("new", list(range(8)) + [5])
    bm.admit(old, [], 9)
    old.num_computed_tokens = 9
    assert bm.publish(old) == 2
    hits = bm.match(new)
    assert hits == old.page_ids[:2]
    assert bm.can_admit(hits, 9) and bm.num_free_pages == 5
    bm.admit(new, hits, 9)
    assert bm.num_free_pages == 4 and new.num_cached_tokens == 8
    assert bm.num_reclaimable([new]) == 1 and bm.num_reclaimable([old, new]) == 4
    bm.free(new)
    assert bm.num_free_pages == 5 and [bm.ref_count(p) for p in old.page_ids] == [1, 1, 1]
    bm.free(old)
    assert bm.prefix_cache.num_parked_pages == 2 and bm.num_free_pages == 8
    bm.check([old, new])
    # A parked hit counts against the room as a new page does.
    again = req("again", list(range(8)) + [6])
    hits = bm.match(again)
    assert len(hits) == 2 and bm.can_admit(hits, 9)
    for _ in range(6):
        bm.allocate(req("filler", [0]), 1)  # takes the 6 free-list pages, no eviction
    assert bm.prefix_cache.num_evictions == 0 and bm.num_free_pages == 2
    assert bm.can_admit(hits, 8) and not bm.can_admit(hits, 9)


# ---------------------------------------------------------------- randomized

def _sessions(seed, n=14, ctx=24):
    """Requests that extend a few shared system prompts and earlier turns; mixed salts,
    loops and adaptive rows."""
    rng = random.Random(seed)
    systems = [[rng.randrange(V) for _ in range(rng.randint(3, 10))] for _ in range(2)]
    salts = [OURO, OURO, SEEDED0, ("seeded", 1), None]
    arrivals, history = {}, []
    for i in range(n):
        base = rng.choice(history) if history and rng.random() < 0.5 else rng.choice(systems)
        prompt = (base + [rng.randrange(V) for _ in range(rng.randint(1, 5))])[:ctx - 2]
        history.append(prompt)
        r = req(f"r{i}", prompt, max_tokens=rng.randint(1, 8), salt=rng.choice(salts),
                adaptive=rng.random() < 0.15, max_loops=rng.choice([None, None, 2]))
        if i == 0:  # NOTE: r0 is shareable and replayed late, so the run has a hit to take
            r.cache_salt, r.adaptive, r.max_loops = OURO, False, None
        arrivals.setdefault(rng.randint(0, 25), []).append(r)
    arrivals.setdefault(60, []).append(req("replay", history[0] + [1], max_tokens=2))
    return arrivals


@pytest.mark.parametrize("seed", range(40))
def test_random_sessions_cache_on_equals_off_in_any_pool(seed):
    rng = random.Random(seed)
    page_size, ctx = rng.choice([1, 2, 4]), 24
    knobs = dict(page_size=page_size, max_context_len=ctx, max_num_rows=rng.choice([2, 8]),
                 max_prefill_tokens=rng.choice([3, 8, 32]), max_prefill_rows=rng.choice([1, 4]),
                 fused_decode=rng.random() < 0.5)
    min_pages = -(-ctx // page_size)
    results, hits = [], []
    for cache, num_pages in ((False, 400), (True, 400), (True, min_pages + rng.randint(0, 3))):
        sched, runner = setup(cfg(num_pages=num_pages, enable_prefix_caching=cache, **knobs))
        results.append(_outputs(drive(sched, runner, _sessions(seed))))
        hits.append(sched.stats()["prefix_cache_hit_tokens"])
        assert_pool_whole(sched)
    assert results[0] == results[1] == results[2] and len(results[0]) == 15
    assert hits[0] == 0 and hits[1] > 0
