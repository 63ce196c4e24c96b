"""BlockManager: page growth at boundaries, O(1) free count, no double free, slots."""

import pytest

from loopjax.block_manager import BlockManager
from loopjax.request import Request


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


def test_can_allocate_and_overdraw():
    bm = BlockManager(num_pages=3, page_size=4)
    r = _req()
    assert bm.can_fit(r, 12) and not bm.can_fit(r, 13)
    assert bm.num_new_pages(r, 13) == 4 and not bm.can_allocate(4)
    with pytest.raises(RuntimeError, match="needs 4 pages, 3 free"):
        bm.allocate(r, 13)
    assert r.page_ids == [] and bm.num_free_pages == 3  # a failed allocation takes nothing


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
