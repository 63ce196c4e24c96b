"""BlockManager: the host-side page allocator of the KV pool (pure Python, no JAX).

The device pool (`kv_cache.py`) is `num_pages` pages of `page_size` token slots; one page
holds every depth plane of its tokens (the planes are a separate axis of the pool), so the
host counts tokens, never planes. Position p of a request lives in slot
`page_ids[p // page_size] * page_size + p % page_size`.

Contract:
- `allocate(request, num_tokens)` grows `request.page_ids` to cover positions
  `0..num_tokens-1`, taking a new page only when num_tokens crosses a page boundary; it
  fails (RuntimeError) if the pool is short: callers check `can_allocate` first.
- `free(request)` drops the request's reference to each of its pages (tail first) and empties
  its page list.
- Every page is free (on the free list, ref count 0), held (ref count >= 1: one count per
  request holding it) or, with the prefix cache, parked (ref count 0, holding a published
  key, in the cache's LRU). `num_free_pages` counts free + parked pages and is O(1); a new page
  comes from the free list, and only when that is empty from the LRU (evicting its key).
  Freeing a page at ref count 0 is a bug and asserts.

Prefix cache (`prefix_cache.py`, `enable_prefix_cache=True`): `match(request)` finds the
cached prefix pages of a waiting request, `admit(request, hits, num_tokens)` shares them (one
more reference each) and allocates the rest, `publish(request)` offers the pages the request
has finished computing. A shared page is never written: only positions at or past a request's
`num_computed_tokens` are written, and shared pages lie below it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from loopjax.prefix_cache import PrefixCache
from loopjax.request import Request


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = False):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: the last freed page is reused first. Reversed so a fresh pool hands out 0, 1, 2...
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_pages
        self.prefix_cache = PrefixCache(page_size) if enable_prefix_cache else None

    # ---- counts
    @property
    def num_free_pages(self) -> int:
        """Pages a request can take: the free list plus the parked cached pages."""
        parked = self.prefix_cache.num_parked_pages if self.prefix_cache is not None else 0
        return len(self._free_pages) + parked

    @property
    def num_used_pages(self) -> int:
        """Pages held by requests (ref count >= 1)."""
        return self.num_pages - self.num_free_pages

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold positions 0..num_tokens-1."""
        return -(-num_tokens // self.page_size)

    def num_new_pages(self, request: Request, num_tokens: int) -> int:
        """Pages `allocate(request, num_tokens)` would take from the free list."""
        return max(0, self.pages_for(num_tokens) - len(request.page_ids))

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def can_fit(self, request: Request, num_tokens: int) -> bool:
        return self.can_allocate(self.num_new_pages(request, num_tokens))

    # ---- allocation
    def allocate(self, request: Request, num_tokens: int) -> list[int]:
        """Grow the request's pages to cover num_tokens positions; returns the new pages."""
        needed = self.num_new_pages(request, num_tokens)
        if needed > self.num_free_pages:
            raise RuntimeError(f"request {request.request_id}: needs {needed} pages, "
                               f"{self.num_free_pages} free (check can_allocate first)")
        new = [self._take_page() for _ in range(needed)]
        request.page_ids.extend(new)
        return new

    def free(self, request: Request) -> int:
        """Drop the request's reference to each of its pages, the last page first (so the
        deep end of a cached prefix is evicted first); returns how many reached ref count 0."""
        freed = self.release(reversed(request.page_ids))
        request.page_ids = []
        request.num_offered_pages = 0
        return freed

    def release(self, pages: Iterable[int]) -> int:
        """Drop one reference to each page; pages at zero are parked (published) or freed."""
        freed = 0
        for page in pages:
            freed += self._release_page(page)
        return freed

    def num_reclaimable(self, requests: Iterable[Request]) -> int:
        """Pages that would become free if `requests` released all their pages (a shared page
        only if every holder is among them)."""
        held = Counter(page for request in requests for page in request.page_ids)
        return sum(1 for page, n in held.items() if n == self._ref_counts[page])

    def _take_page(self) -> int:
        if self._free_pages:
            page = self._free_pages.pop()
        else:  # NOTE: parked pages are reused only when the free list is empty
            page = self.prefix_cache.evict()
        assert self._ref_counts[page] == 0, f"page {page} on the free list is referenced"
        self._ref_counts[page] = 1
        return page

    def _release_page(self, page: int) -> int:
        assert 0 <= page < self.num_pages, f"page {page} is outside the pool"
        assert self._ref_counts[page] > 0, f"double free of page {page}"
        self._ref_counts[page] -= 1
        if self._ref_counts[page] > 0:
            return 0
        if self.prefix_cache is None or not self.prefix_cache.park(page):
            self._free_pages.append(page)
        return 1

    # ---- prefix cache
    def match(self, request: Request) -> list[int]:
        """Cached pages of a waiting request's prefix ([] without the cache or for a request
        that never shares); they stay usable until the next allocation."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.match(request)

    def can_admit(self, hits: list[int], num_tokens: int) -> bool:
        """Room for a request holding no page to share `hits` and cover num_tokens positions:
        a parked hit leaves the free pages just as a new page does."""
        parked = sum(1 for page in hits if self._ref_counts[page] == 0)
        return self.pages_for(num_tokens) - len(hits) + parked <= self.num_free_pages

    def admit(self, request: Request, hits: list[int], num_tokens: int) -> None:
        """Share the cached prefix pages `hits` (from `match`, before any other allocation)
        and allocate the rest of num_tokens positions; callers check `can_admit` first."""
        assert not request.page_ids, f"request {request.request_id} already holds pages"
        for page in hits:  # NOTE: first, so allocating the rest cannot evict a hit
            if self._ref_counts[page] == 0:
                self.prefix_cache.unpark(page)
            self._ref_counts[page] += 1
        request.page_ids.extend(hits)
        request.num_offered_pages = len(hits)
        request.num_cached_tokens = len(hits) * self.page_size
        if self.prefix_cache is not None:
            self.prefix_cache.record_admission(request, len(hits))
        self.allocate(request, num_tokens)

    def publish(self, request: Request, num_tokens: int | None = None) -> int:
        """Offer the request's full pages below `num_tokens` (default `num_computed_tokens`)
        not offered before; returns how many were published (a duplicate of a cached prefix
        stays private). The tokens of those positions must be known and their KV written
        (or written by a step dispatched before any step that reads the cache)."""
        cache = self.prefix_cache
        bound = request.num_computed_tokens if num_tokens is None else num_tokens
        num_pages = bound // self.page_size
        if cache is None or num_pages <= request.num_offered_pages:
            return 0
        keys = cache.keys(request, num_pages)
        published = 0
        if keys:  # [] for a request that never shares
            for i in range(request.num_offered_pages, num_pages):
                published += cache.publish(request.page_ids[i], keys[i])
        request.num_offered_pages = num_pages
        return published

    # ---- helpers for the runner and the tests
    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def is_published(self, page: int) -> bool:
        """The page holds a prefix-cache key (its KV must not change)."""
        return self.prefix_cache is not None and self.prefix_cache.key_of(page) is not None

    def slot(self, request: Request, position: int) -> int:
        """Flat KV slot of a position of the request (its page must be allocated)."""
        return request.page_ids[position // self.page_size] * self.page_size + position % self.page_size

    def check(self, requests: Iterable[Request]) -> None:
        """Assert the pool is consistent with the live requests' page lists (tests, debugging)."""
        counts = [0] * self.num_pages
        for request in requests:
            for page in request.page_ids:
                counts[page] += 1
        assert counts == self._ref_counts, "page ref counts differ from the requests' page lists"
        free = set(self._free_pages)
        assert len(free) == len(self._free_pages), "a page is on the free list twice"
        parked = set()
        if self.prefix_cache is not None:
            self.prefix_cache.check()
            parked = {p for p in range(self.num_pages) if self.prefix_cache.is_parked(p)}
            assert not free & parked, "a page is both free and parked"
        assert free | parked == {p for p, c in enumerate(counts) if c == 0}, \
            "free list and parked pages differ from unused pages"
