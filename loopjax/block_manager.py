"""BlockManager: the host-side page allocator of the KV pool (pure Python, no JAX).

The device pool (`kv_cache.py`) is `num_pages` pages of `page_size` token slots; one page
holds every depth plane of its tokens (the planes are a separate axis of the pool), so the
host counts tokens, never planes. Position p of a request lives in slot
`page_ids[p // page_size] * page_size + p % page_size`.

Contract:
- `allocate(request, num_tokens)` grows `request.page_ids` to cover positions
  `0..num_tokens-1`, taking a new page only when num_tokens crosses a page boundary; it
  fails (RuntimeError) if the pool is short: callers check `can_fit` first.
- `free(request)` drops the request's reference to each of its pages (tail first) and empties
  its page list.
- Every page is free (on the free list, ref count 0), held (ref count >= 1: one count per
  request holding it) or, with the prefix cache, parked (ref count 0, holding a published
  key, in the cache's LRU). `num_free_pages` counts free + parked pages and is O(1); a new page
  comes from the free list, and only when that is empty from the LRU (evicting its key).
  Freeing a page at ref count 0 is a bug and asserts.

Decode pages (Ouro's 'shared' KV layout, `decode_page_planes` = L > 0): a decoded token keeps
one plane per layer, so the page a DECODING request takes is one plane slot of a physical page
(page id `num_pages + physical * L + plane`; `locate` maps ids to (physical page, plane), -1
for a full page). A physical page is split into L decode pages when one is needed and no split
page has a free slot, and returns to the free list when its last slot is freed. Pages taken
while prefilling (prompt tokens, recomputed tokens after preemption) are full pages, also when
decoded tokens later fill their tail. Accounting is O(1): `num_free_pages` (whole physical
pages) and `num_free_decode_slots`; `can_fit` checks the real cost of each kind. Decode pages
are never shared or published, and nothing is published while a request decodes (a full
page's decoded tail keeps only the last loop, so it is not a prompt page).

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
from loopjax.request import Request, RequestPhase
from loopjax.wording import counted


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_cache: bool = False,
                 decode_page_planes: int = 0):
        if num_pages < 1 or page_size < 1 or decode_page_planes < 0:
            raise ValueError(f"need num_pages >= 1, page_size >= 1 and decode_page_planes >= 0, "
                             f"got {num_pages}, {page_size}, {decode_page_planes}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.decode_page_planes = decode_page_planes
        # Split physical pages: free plane slots (only pages with one), held slot counts (all).
        self._split_free: dict[int, list[int]] = {}
        self._split_held: dict[int, int] = {}
        self._num_free_slots = 0
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
    def num_free_decode_slots(self) -> int:
        """Free decode pages inside split physical pages (not counting whole free pages)."""
        return self._num_free_slots

    @property
    def num_used_pages(self) -> int:
        """Physical pages held by requests (ref count >= 1) or split into decode pages."""
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

    def takes_decode_pages(self, request: Request) -> bool:
        """New pages of this request are decode pages (a decoding request, 'shared' layout)."""
        return self.decode_page_planes > 0 and request.phase is RequestPhase.DECODING

    def can_fit(self, request: Request, num_tokens: int, reclaim: Iterable[Request] = ()) -> bool:
        """Room to grow the request to num_tokens positions, after `reclaim` released every
        page (exact: the scheduler preempts them until this holds without them)."""
        needed = self.num_new_pages(request, num_tokens)
        pages, slots = self.num_free_pages, self._num_free_slots
        if reclaim:
            more_pages, more_slots = self._reclaimable(reclaim)
            pages, slots = pages + more_pages, slots + more_slots
        if not self.takes_decode_pages(request):
            return needed <= pages
        return needed <= slots + self.decode_page_planes * pages

    def stats(self) -> dict[str, int | float]:
        """Free and used pages; the prefix_cache_* entries are zero with the cache off (hit
        rates: hit / queried, queried = every admitted context)."""
        return {"num_free_pages": self.num_free_pages, "num_used_pages": self.num_used_pages,
                **(self.prefix_cache or PrefixCache(self.page_size)).stats()}

    # ---- allocation
    def allocate(self, request: Request, num_tokens: int) -> list[int]:
        """Grow the request's pages to cover num_tokens positions; returns the new pages."""
        if not self.can_fit(request, num_tokens):
            raise RuntimeError(f"request {request.request_id}: needs "
                               f"{counted(self.num_new_pages(request, num_tokens), 'page')}, "
                               f"{self.num_free_pages} free (check can_fit first)")
        take = self._take_decode_page if self.takes_decode_pages(request) else self._take_page
        new = [take() for _ in range(self.num_new_pages(request, num_tokens))]
        request.page_ids.extend(new)
        return new

    def locate(self, page_ids: Iterable[int]) -> tuple[list[int], list[int]]:
        """(physical pages, planes) of page ids: plane -1 for a full page, else the plane slot
        of a decode page in its physical page."""
        pages, planes = [], []
        for page in page_ids:
            if page < self.num_pages:
                pages.append(page)
                planes.append(-1)
            else:
                physical, plane = divmod(page - self.num_pages, self.decode_page_planes)
                pages.append(physical)
                planes.append(plane)
        return pages, planes

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
        """Physical pages that would become free if `requests` released all their pages (a
        shared page only if every holder is among them; a split page if all its decode pages)."""
        return self._reclaimable(requests)[0]

    def _reclaimable(self, requests: Iterable[Request]) -> tuple[int, int]:
        """(whole physical pages, free decode slots) that `requests` releasing every page adds."""
        held = Counter(page for request in requests for page in request.page_ids)
        pages = slots = 0
        split = Counter()
        for page, n in held.items():
            if page >= self.num_pages:
                split[(page - self.num_pages) // self.decode_page_planes] += n
            elif n == self._ref_counts[page]:
                pages += 1
        for physical, n in split.items():
            if n == self._split_held[physical]:  # whole again: its free slots leave the count
                pages += 1
                slots -= len(self._split_free.get(physical, ()))
            else:
                slots += n
        return pages, slots

    def _take_page(self) -> int:
        if self._free_pages:
            page = self._free_pages.pop()
        else:  # NOTE: parked pages are reused only when the free list is empty
            page = self.prefix_cache.evict()
        assert self._ref_counts[page] == 0, f"page {page} on the free list is referenced"
        self._ref_counts[page] = 1
        return page

    def _take_decode_page(self) -> int:
        if not self._split_free:  # split a whole page; it stays referenced while split
            physical = self._take_page()
            self._split_free[physical] = list(range(self.decode_page_planes - 1, -1, -1))
            self._split_held[physical] = 0
            self._num_free_slots += self.decode_page_planes
        physical = next(reversed(self._split_free))  # the last to gain a free slot (newly split, or was full)
        free = self._split_free[physical]
        plane = free.pop()
        if not free:
            del self._split_free[physical]
        self._split_held[physical] += 1
        self._num_free_slots -= 1
        return self.num_pages + physical * self.decode_page_planes + plane

    def _release_decode_page(self, page: int) -> int:
        physical, plane = divmod(page - self.num_pages, self.decode_page_planes)
        assert physical in self._split_held, f"decode page {page} is not in a split page"
        free = self._split_free.setdefault(physical, [])
        assert plane not in free, f"double free of decode page {page}"
        free.append(plane)
        self._num_free_slots += 1
        self._split_held[physical] -= 1
        if self._split_held[physical]:
            return 0
        del self._split_free[physical], self._split_held[physical]
        self._num_free_slots -= self.decode_page_planes
        self._ref_counts[physical] = 0
        self._free_pages.append(physical)  # NOTE: never parked: it holds no published key
        return 1

    def _release_page(self, page: int) -> int:
        if page >= self.num_pages and self.decode_page_planes:
            return self._release_decode_page(page)
        assert 0 <= page < self.num_pages, f"page {page} is outside the pool"
        assert self._ref_counts[page] > 0, f"double free of page {page}"
        self._ref_counts[page] -= 1
        if self._ref_counts[page] > 0:
            return 0
        if self.prefix_cache is None or not self.prefix_cache.park(page):
            self._free_pages.append(page)
        return 1

    # ---- prefix cache
    def forget_cached(self) -> int:
        """Unpublish every parked page (their KV is gone: the device state was made anew) onto
        the free list; returns how many. Held pages keep their keys: call it once none is held."""
        forgotten = 0
        while self.prefix_cache is not None and self.prefix_cache.num_parked_pages:
            self._free_pages.append(self.prefix_cache.evict())
            forgotten += 1
        return forgotten

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
        not offered before; returns how many were published (a copy of a page already cached
        too: `PrefixCache.publish`). The tokens of those positions must be known and their KV written
        (or written by a step dispatched before any step that reads the cache)."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        bound = request.num_computed_tokens if num_tokens is None else num_tokens
        if self.decode_page_planes > 0:  # NOTE: decoded tokens keep only their last loop's KV,
            bound = min(bound, request.num_prompt_tokens)  # so only prompt pages are published
        num_pages = bound // self.page_size
        if num_pages <= request.num_offered_pages:
            return 0
        keys = cache.keys(request, num_pages)
        published = 0
        if keys:  # [] for a request that never shares
            for i in range(request.num_offered_pages, num_pages):
                cache.publish(request.page_ids[i], keys[i])
                published += 1
        request.num_offered_pages = num_pages
        return published

    # ---- helpers for the runner and the tests
    def ref_count(self, page: int) -> int:
        if page >= self.num_pages:  # a decode page: held by one request or free
            physical, plane = divmod(page - self.num_pages, self.decode_page_planes)
            held = physical in self._split_held and plane not in self._split_free.get(physical, ())
            return int(held)
        return self._ref_counts[page]

    def is_published(self, page: int) -> bool:
        """The page holds a prefix-cache key (its KV must not change)."""
        return self.prefix_cache is not None and self.prefix_cache.key_of(page) is not None

    def slot(self, request: Request, position: int) -> int:
        """Flat KV slot of a position of the request in its physical page (its page must be
        allocated; `locate` gives a decode page's plane)."""
        (page,), _ = self.locate([request.page_ids[position // self.page_size]])
        return page * self.page_size + position % self.page_size

    def check(self, requests: Iterable[Request]) -> None:
        """Assert the pool is consistent with the live requests' page lists (tests, debugging)."""
        counts = [0] * self.num_pages
        slots = Counter()
        for request in requests:
            for page in request.page_ids:
                if page < self.num_pages:
                    counts[page] += 1
                else:
                    slots[page] += 1
        assert all(n == 1 for n in slots.values()), "a decode page is held twice"
        for physical, held in self._split_held.items():
            counts[physical] += 1  # held by its split
            free = self._split_free.get(physical, [])
            mine = {(p - self.num_pages) % self.decode_page_planes for p in slots
                    if (p - self.num_pages) // self.decode_page_planes == physical}
            assert held == len(mine) and not mine & set(free) and \
                len(mine) + len(free) == self.decode_page_planes, f"split page {physical} is inconsistent"
        assert len(slots) == sum(self._split_held.values()), "a decode page lies outside the split pages"
        assert self._num_free_slots == sum(map(len, self._split_free.values())), "free slot count is off"
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
