"""PrefixCache: content keys for full KV pages, so requests with a common prefix share pages.

Pure Python, no JAX. The BlockManager owns it: the allocator keeps the ref counts and the free
list, the cache keeps the key <-> page maps, the LRU of parked pages and the hit statistics.

Keys. Full page i of a request (positions i*S .. i*S+S-1) is keyed by
`blake2b(key of page i-1 || token ids of page i)`; page 0's parent is the request's root key,
`blake2b(repr((cache_salt, loop count)))`. A key therefore names the whole prefix up to the
end of its page plus everything else the page's KV depends on. Each key is computed once, when
its page's tokens are known, and kept in `Request.page_keys` (a step never rehashes a prefix).
A 128-bit digest makes a collision (two prefixes sharing KV by accident) negligible.

What a page's KV depends on, hence what the root holds:
- The token ids of every position up to the page's end: the key chain.
- The loop count: a token run for L loops writes planes 0..L-1 (`per_loop`) or its ring slots
  (`shared`); another L leaves other planes. Every depth plane of a token lives in the token's
  page (planes are a separate axis of the pool), so one key covers all planes, for Ouro's
  `per_loop` layout, Huginn's packed planes and the shared ring alike: a hit saves L loops of
  work per token, not one.
- Huginn's initial state s0: the recurrent loops start every token from s0, so the KV of the
  core and coda layers depends on it. A cached prefix is valid only if recomputing it would give
  the same states, i.e. if s0 is a pure function of (seed, position) (`huginn.initial_state`,
  or zero). The engine then puts (state mode, seed) in `cache_salt`, so two seeds never share a
  page. Explicit states and per-request random states (the reference's default) cannot be
  reproduced from the tokens: their requests have `cache_salt = None` and neither look up nor
  publish. That is why prefix caching is opt-in for Huginn (and the engine decides per request).
  Ouro's KV depends on tokens and the loop count only: its salt is ().
- The request's own salt (vLLM's `cache_salt`, `SamplingParams.cache_salt`): not a KV input but
  a boundary: the engine appends it to `cache_salt`, so only requests of one salt share pages
  (another salt, or none, cannot learn from a hit that a prompt was cached).
- Huginn's ring ('shared') when it wraps within the depth: a prefill that starts after a
  cached page reads the page's tokens at their last write of a slot, where one prefill reads
  their entry of the same loop. The engine gives such requests `cache_salt = None`.
- Adaptive exits: a token that exits early writes fewer planes (then the "last exited" fill),
  so its KV depends on exit decisions, not only on tokens. Adaptive requests never publish;
  NOTE: they do not look up either (their prompt runs at full depth today, but tying cache
  validity to how prefill treats exits is not worth the saving).

A page is free (the BlockManager's free list), held (ref count >= 1) or parked: ref count 0
but holding a published key, in the LRU. Parked pages count as free; the allocator reuses one
(evicting its key, oldest first) only when the free list is empty. A hit on a parked page takes
it out of the LRU. Two requests that computed one prefix at once publish a copy each, so the
prefix stays cached while either holds its copy; the first copy released while the other
lives is unpublished and freed, never parked. A request releases its pages tail first, so
the deep end of a prefix is evicted before the pages it hangs from.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from loopjax.request import Request

_ROOT_TAG = "loopjax-prefix-v1"


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def root_key(request: Request) -> bytes | None:
    """The parent key of a request's page 0, or None if its pages are never shared."""
    if request.cache_salt is None or request.adaptive:
        return None
    return _digest(repr((_ROOT_TAG, request.cache_salt, request.max_loops)).encode())


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        # published key -> its pages (two requests that computed one prefix at once both publish:
        # each copy stays findable while held, `park`), in publish order; page -> its key
        self._pages_of: dict[bytes, dict[int, None]] = {}
        self._key_of: dict[int, bytes] = {}
        self._parked: OrderedDict[int, None] = OrderedDict()  # ref-0 keyed pages, oldest first
        self.num_evictions = 0
        self.num_queried_tokens = self.num_hit_tokens = 0  # over admissions
        self.num_queried_pages = self.num_hit_pages = 0

    # ---- keys
    def keys(self, request: Request, num_pages: int) -> list[bytes]:
        """Keys of the request's full pages 0..num_pages-1 (at least; [] if it never shares).
        Extends `request.page_keys`, hashing only pages not keyed before."""
        keys = request.page_keys
        if len(keys) >= num_pages:
            return keys
        parent = keys[-1] if keys else root_key(request)
        if parent is None:
            return keys
        size = self.page_size
        assert num_pages * size <= request.num_tokens, "only full pages have keys"
        for i in range(len(keys), num_pages):
            parent = _digest(parent + array("q", request.token_ids(i * size, i * size + size)).tobytes())
            keys.append(parent)
        return keys

    # ---- lookup
    def match(self, request: Request) -> list[int]:
        """The cached pages of the request's longest cached prefix of full pages, leaving at
        least its last token uncached (the step that computes it yields the logits). Of two
        copies of a page, a held one (taking it costs no free page) before a parked one."""
        num_pages = (request.num_tokens - 1) // self.page_size
        pages = []
        for key in self.keys(request, num_pages)[:num_pages]:
            copies = self._pages_of.get(key)
            if copies is None:
                break
            pages.append(next((p for p in copies if p not in self._parked), next(iter(copies))))
        return pages

    def record_admission(self, request: Request, num_hit_pages: int) -> None:
        """Hit statistics: every admitted request queries its whole context."""
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += num_hit_pages * self.page_size
        self.num_queried_pages += (request.num_tokens - 1) // self.page_size
        self.num_hit_pages += num_hit_pages

    # ---- page life cycle (called by the BlockManager)
    def publish(self, page: int, key: bytes) -> None:
        """Register a held page whose KV is complete (also a second copy of a key's page: two
        requests computed the same prefix at once, and either may be released first)."""
        assert page not in self._key_of, f"page {page} is published twice"
        self._pages_of.setdefault(key, {})[page] = None
        self._key_of[page] = key

    def park(self, page: int) -> bool:
        """A page's ref count reached 0: keep it (True) if it holds a key, else False; a copy
        whose key has another page loses its key (False): that page keeps the prefix cached,
        and redundant copies would push other prefixes out of the LRU."""
        key = self._key_of.get(page)
        if key is None:
            return False
        copies = self._pages_of[key]
        if len(copies) > 1:
            del copies[page], self._key_of[page]
            return False
        self._parked[page] = None
        return True

    def unpark(self, page: int) -> None:
        """A hit took a parked page back."""
        del self._parked[page]

    def evict(self) -> int:
        """Forget the least recently parked page's key and hand the page out."""
        page, _ = self._parked.popitem(last=False)
        key = self._key_of.pop(page)
        copies = self._pages_of[key]
        del copies[page]
        if not copies:
            del self._pages_of[key]
        self.num_evictions += 1
        return page

    # ---- counts
    @property
    def num_parked_pages(self) -> int:
        return len(self._parked)

    @property
    def num_cached_pages(self) -> int:
        """Pages holding a published key (held or parked)."""
        return len(self._key_of)

    def key_of(self, page: int) -> bytes | None:
        return self._key_of.get(page)

    def is_parked(self, page: int) -> bool:
        return page in self._parked

    def stats(self) -> dict[str, int | float]:
        return {
            "prefix_cache_queried_tokens": self.num_queried_tokens,
            "prefix_cache_hit_tokens": self.num_hit_tokens,
            "prefix_cache_hit_rate": self.num_hit_tokens / max(1, self.num_queried_tokens),
            "prefix_cache_queried_pages": self.num_queried_pages,
            "prefix_cache_hit_pages": self.num_hit_pages,
            "prefix_cache_page_hit_rate": self.num_hit_pages / max(1, self.num_queried_pages),
            "prefix_cache_pages": self.num_cached_pages,
            "prefix_cache_parked_pages": self.num_parked_pages,
            "prefix_cache_evictions": self.num_evictions,
        }

    def check(self) -> None:
        """Assert the maps are inverse and every parked page holds a key (tests, debugging)."""
        assert sum(map(len, self._pages_of.values())) == len(self._key_of), "key and page maps differ in size"
        assert all(self._key_of.get(p) == k for k, copies in self._pages_of.items() for p in copies), \
            "maps not inverse"
        assert all(self._pages_of.values()), "a key without a page"
        assert all(p in self._key_of for p in self._parked), "a parked page holds no key"
