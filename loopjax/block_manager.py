"""BlockManager: the host-side page allocator of the KV pool (pure Python, no JAX).

The device pool (`kv_cache.py`) is `num_pages` pages of `page_size` token slots; one page
holds every depth plane of its tokens (the planes are a separate axis of the pool), so the
host counts tokens, never planes. Position p of a request lives in slot
`page_ids[p // page_size] * page_size + p % page_size`.

Contract:
- `allocate(request, num_tokens)` grows `request.page_ids` to cover positions
  `0..num_tokens-1`, taking a new page only when num_tokens crosses a page boundary; it
  fails (RuntimeError) if the free list is short: callers check `can_allocate` first.
- `free(request)` returns every page of the request and empties its page list.
- `num_free_pages` is O(1) (the free list's length); every page is either on the free
  list (ref count 0) or referenced (ref count >= 1). Freeing a free page is a bug and
  asserts. NOTE: ref counts are the hook for a later prefix cache (a shared page gets one
  count per holder and returns to the free list at zero); today every count is 0 or 1.
"""

from __future__ import annotations

from collections.abc import Iterable

from loopjax.request import Request


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # A stack: the last freed page is reused first. Reversed so a fresh pool hands out 0, 1, 2...
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref_counts: list[int] = [0] * num_pages

    # ---- counts
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free_pages)

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
        return num_pages <= len(self._free_pages)

    def can_fit(self, request: Request, num_tokens: int) -> bool:
        return self.can_allocate(self.num_new_pages(request, num_tokens))

    # ---- allocation
    def allocate(self, request: Request, num_tokens: int) -> list[int]:
        """Grow the request's pages to cover num_tokens positions; returns the new pages."""
        needed = self.num_new_pages(request, num_tokens)
        if needed > len(self._free_pages):
            raise RuntimeError(f"request {request.request_id}: needs {needed} pages, "
                               f"{len(self._free_pages)} free (check can_allocate first)")
        new = [self._take_page() for _ in range(needed)]
        request.page_ids.extend(new)
        return new

    def free(self, request: Request) -> int:
        """Return every page of the request; returns how many reached the free list."""
        freed = self.release(request.page_ids)
        request.page_ids = []
        return freed

    def release(self, pages: Iterable[int]) -> int:
        """Drop one reference to each page; pages at zero go back to the free list."""
        freed = 0
        for page in pages:
            freed += self._release_page(page)
        return freed

    def _take_page(self) -> int:
        page = self._free_pages.pop()
        assert self._ref_counts[page] == 0, f"page {page} on the free list is referenced"
        self._ref_counts[page] = 1
        return page

    def _release_page(self, page: int) -> int:
        assert 0 <= page < self.num_pages, f"page {page} is outside the pool"
        assert self._ref_counts[page] > 0, f"double free of page {page}"
        self._ref_counts[page] -= 1
        if self._ref_counts[page] == 0:
            self._free_pages.append(page)
            return 1
        return 0

    # ---- helpers for the runner and the tests
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
        assert free == {p for p, c in enumerate(counts) if c == 0}, "free list differs from unused pages"
