"""BlockManager: page growth at boundaries, O(1) free count, no double free, slots."""

import pytest

from loopjax.block_manager import BlockManager
from loopjax.request import Request, RequestPhase


def _req(rid="a", n=1):
    return Request(rid, list(range(n)))


def test_pages_grow_only_at_page_boundaries():
    bm = BlockManager(num_pages=8, page_size=4)
    r = _req()
    assert bm.allocate(r, 1) == [0]           # a fresh pool hands out 0, 1, 2...
    assert bm.allocate(r, 4) == []            # positions 0..3 share page 0
    assert bm.allocate(r, 5) == [1]           # position 4 opens page 1
    assert bm.allocate(r, 3) == []            # never shrinks
    assert bm.allocate(r, 12) == [2]
    assert r.page_ids == [0, 1, 2] and r.num_pages_needed(4, 12) == 3
    assert (bm.num_free_pages, bm.num_used_pages) == (5, 3)
    assert bm.slot(r, 0) == 0 and bm.slot(r, 5) == 1 * 4 + 1 and bm.slot(r, 11) == 2 * 4 + 3


def test_free_returns_every_page_and_reuses_last_freed_first():
    bm = BlockManager(num_pages=6, page_size=2)
    a, b = _req("a"), _req("b")
    bm.allocate(a, 5)   # 3 pages
    bm.allocate(b, 4)   # 2 pages
    bm.check([a, b])
    assert bm.free(a) == 3 and a.page_ids == []
    assert bm.num_free_pages == 4 and bm.num_used_pages == 2
    bm.check([a, b])
    c = _req("c")
    bm.allocate(c, 2)
    assert c.page_ids == [0]  # a freed its pages tail first (2, 1, 0): the last freed is reused first
    bm.free(b)
    bm.free(c)
    assert bm.num_free_pages == 6
    bm.check([a, b, c])


def test_can_fit_and_overdraw():
    bm = BlockManager(num_pages=3, page_size=4)
    r = _req()
    assert bm.can_fit(r, 12) and not bm.can_fit(r, 13)
    assert bm.num_new_pages(r, 13) == 4 and bm.num_free_pages == 3
    with pytest.raises(RuntimeError, match="needs 4 pages, 3 free"):
        bm.allocate(r, 13)
    assert r.page_ids == [] and bm.num_free_pages == 3  # a failed allocation takes nothing
    bm.allocate(r, 12)
    with pytest.raises(RuntimeError, match=r"needs 1 page, 0 free"):  # not "1 pages"
        bm.allocate(r, 13)


def test_double_free_asserts():
    bm = BlockManager(num_pages=4, page_size=4)
    r = _req()
    bm.allocate(r, 8)
    pages = list(r.page_ids)
    bm.free(r)
    with pytest.raises(AssertionError, match="double free"):
        bm.release(pages[:1])
    with pytest.raises(AssertionError, match="outside the pool"):
        bm.release([99])


def test_check_catches_a_page_list_out_of_sync():
    bm = BlockManager(num_pages=4, page_size=4)
    a, b = _req("a"), _req("b")
    bm.allocate(a, 4)
    b.page_ids = list(a.page_ids)  # a page held twice without a reference
    with pytest.raises(AssertionError):
        bm.check([a, b])


def test_bad_sizes_raise():
    with pytest.raises(ValueError, match="num_pages >= 1"):
        BlockManager(num_pages=0, page_size=4)


# ------------------------------------------------- decode pages (Ouro's 'shared' KV layout)

def _decoding(rid="d", n=1):
    r = _req(rid, n)
    r.phase = RequestPhase.DECODING
    return r


def test_decode_pages_split_one_physical_page_into_planes():
    bm = BlockManager(num_pages=4, page_size=2, decode_page_planes=4)
    a = _req("a")
    bm.allocate(a, 3)                        # prefilling: 2 full pages (0, 1)
    a.phase = RequestPhase.DECODING
    new = bm.allocate(a, 9)                  # positions 4..8: 3 decode pages, one physical page
    assert bm.locate(a.page_ids) == ([0, 1, 2, 2, 2], [-1, -1, 0, 1, 2])
    assert new == [4 + 2 * 4 + 0, 4 + 2 * 4 + 1, 4 + 2 * 4 + 2]
    assert (bm.num_free_pages, bm.num_free_decode_slots, bm.num_used_pages) == (1, 1, 3)
    assert bm.slot(a, 7) == 2 * 2 + 1        # the physical slot; the plane comes from locate
    b = _decoding("b")
    bm.allocate(b, 3)                        # 1 slot left in page 2, then page 3 is split
    assert bm.locate(b.page_ids) == ([2, 3], [3, 0])
    assert (bm.num_free_pages, bm.num_free_decode_slots) == (0, 3)
    bm.check([a, b])
    assert bm.ref_count(b.page_ids[0]) == 1 and not bm.is_published(b.page_ids[0])
    assert bm.free(a) == 2                   # the 2 full pages; page 2 is not whole (b holds plane 3)
    assert (bm.num_free_pages, bm.num_free_decode_slots) == (2, 6)
    bm.check([a, b])
    assert bm.free(b) == 2                   # pages 2 and 3 whole again
    assert (bm.num_free_pages, bm.num_free_decode_slots, bm.num_used_pages) == (4, 0, 0)
    bm.check([a, b])
    with pytest.raises(AssertionError, match="decode page"):
        bm.release(new[:1])


def test_decode_page_accounting_is_by_kind():
    bm = BlockManager(num_pages=2, page_size=4, decode_page_planes=4)
    a, d = _req("a"), _decoding()
    bm.allocate(a, 4)                        # 1 full page
    assert bm.can_fit(d, 16) and not bm.can_fit(d, 17)   # 4 decode pages fit in 1 physical page
    bm.allocate(d, 4)                        # split the last page: 3 slots left, 0 whole pages
    prompt = _req("p")
    assert not bm.can_fit(prompt, 1)         # a full page needs a whole physical page
    assert bm.can_fit(d, 16) and not bm.can_fit(d, 17)
    with pytest.raises(RuntimeError, match="needs 4 pages"):
        bm.allocate(d, 17)
    assert bm.can_fit(prompt, 1, reclaim=[d]) and bm.num_reclaimable([d]) == 1
    assert bm.can_fit(d, 32, reclaim=[a]) and not bm.can_fit(d, 33, reclaim=[a])  # 1 + 3 + 4 pages
    e = _decoding("e")
    bm.allocate(e, 4)                        # shares the split page with d
    assert bm.num_reclaimable([d]) == 0 and bm.num_reclaimable([d, e]) == 1
    assert bm._reclaimable([d]) == (0, 1)
    bm.check([a, d, e])


def test_prompt_pages_are_published_and_decode_time_pages_never():
    bm = BlockManager(num_pages=8, page_size=2, enable_prefix_cache=True, decode_page_planes=4)
    a = Request("a", [1, 2, 3, 4, 5], cache_salt=())
    bm.allocate(a, 5)
    a.num_computed_tokens = 5
    assert bm.publish(a) == 2                # the 2 full prompt pages
    a.phase = RequestPhase.DECODING
    a.output_token_ids = [6, 7, 8]
    bm.allocate(a, 7)
    a.num_computed_tokens = 7
    assert bm.publish(a) == 0                # page 2 holds decoded tokens, page 3 is a decode page
    assert bm.locate(a.page_ids)[1] == [-1, -1, -1, 0]
    bm.free(a)
    assert bm.num_free_pages == 8 and bm.prefix_cache.num_parked_pages == 2
    bm.check([a])


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_with_decode_pages_leaks_nothing(seed):
    """Finishes, aborts and preemptions with decode pages and the prefix cache: the fake runner
    checks every position's slot after each step, `check` the pool, and every page comes back."""
    import random

    from fake_runner import FakeRunner, drive

    from loopjax.sampling_params import SamplingParams
    from loopjax.scheduler import Scheduler, SchedulerConfig

    config = SchedulerConfig(page_size=2, num_pages=10, max_num_rows=8, decode_row_buckets=(8,),
                             max_prefill_tokens=8, prefill_token_buckets=(8,), max_prefill_rows=4,
                             max_context_len=24, enable_prefix_caching=True, decode_page_planes=4)
    sched = Scheduler(config)
    # The fake pool addresses decode page ids directly (ids < num_pages * (1 + planes)).
    runner = FakeRunner(2, 10 * 5, 97, sched.block_manager)
    rng = random.Random(seed)
    arrivals = {}
    for i in range(16):
        prompt = [rng.randrange(3)] * 3 + [rng.randrange(97) for _ in range(rng.randrange(1, 5))]
        params = SamplingParams(max_tokens=rng.randrange(4, 16), temperature=0.0, seed=0)
        arrivals.setdefault(rng.randrange(12), []).append(
            Request(f"r{i}", prompt, params, cache_salt=()))

    def chaos(k):
        live = sorted(sched.requests)
        if live and rng.random() < 0.1:
            sched.abort(rng.choice(live))
    drive(sched, runner, arrivals, before_step=chaos)
    bm = sched.block_manager
    assert sched.num_preemptions > 0
    assert (bm.num_free_pages, bm.num_free_decode_slots, bm.num_used_pages) == (10, 0, 0)
