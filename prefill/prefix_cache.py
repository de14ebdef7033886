"""The prefill daemon's prefix cache: whole pages of prompts it has prefilled.

A page is keyed by a hash chain: the agreement's fingerprint, then the token
ids of every page up to and including it, so a page matches only when every
page before it matches, and another model, layout or build never does. Only
full pages are cached, and only once their prefill succeeded (every layer of
every rank written); a cached logical page keeps its owner lane.

Every page the engine hands out is counted here (``hold``): the request that
computed it (its lease), and each later request whose prefix it serves
(``match``). ``free`` drops one reference (the lease table calls it as its
allocator): a page nobody holds goes back to its lane unless it is cached,
and a cached page nobody holds waits, least recently used first, until the
allocator needs room (``reclaim``). A page someone holds is never evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lanekv.prefill.allocator import LaneAllocator
from lanekv.transfer.protocol.prefix_keys import chain_keys


@dataclass
class CacheStats:
    """Counters for the metrics: lookups, prompt tokens looked up and matched, evictions."""

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0


class PrefillPrefixCache:
    """Reference counts of the engine's logical pages and the cache of full prompt pages.

    ``enabled=False``: nothing is cached; ``free`` gives every page back at its last
    reference (the daemon runs as if there were no cache). ``max_pages``: at most
    this many pages cached (a share of the pool).
    """

    def __init__(self, allocator: LaneAllocator, page_size: int, seed: str, *,
                 enabled: bool = True, max_pages: int | None = None) -> None:
        if max_pages is not None and (isinstance(max_pages, bool) or not isinstance(max_pages, int)
                                      or max_pages < 0):
            raise ValueError(f"max_pages must be None or an int >= 0, got max_pages={max_pages!r}")
        self.allocator = allocator
        self.cp_size = allocator.cp_size
        self.page_size = page_size
        self.seed = seed
        self.enabled = enabled
        self.max_pages = allocator.num_pages if max_pages is None else max_pages
        self.stats = CacheStats()
        self._refs: dict[int, int] = {}  # logical page -> references (pages in use only)
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced: LRU first
        self._lock = threading.Lock()
        allocator.reclaim = self.reclaim
        allocator.reclaimable = self.idle_by_lane

    # -- what a request holds ---------------------------------------------------

    def hold(self, pages: Iterable[int]) -> None:
        """One more reference on each page (fresh pages of a prefill, or shared ones)."""
        with self._lock:
            for page in pages:
                self._refs[page] = self._refs.get(page, 0) + 1
                self._idle.pop(page, None)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference on each page; a page at zero is kept if cached, else freed."""
        back = []
        with self._lock:
            pages = list(pages)
            for page in pages:
                if self._refs.get(page, 0) <= 0:
                    raise ValueError(f"page {page} is not held (double free or foreign page)")
            for page in pages:
                self._refs[page] -= 1
                if self._refs[page]:
                    continue
                del self._refs[page]
                if page in self._key_of:
                    self._idle[page] = None
                else:
                    back.append(page)
            if back:
                self.allocator.free(back)

    # -- the cache --------------------------------------------------------------

    def usable_pages(self, num_tokens: int) -> int:
        """Full pages a hit may cover: at least the prompt's last token is computed, since
        the first output token is sampled from its hidden state, which no cache keeps. A
        prefix is whole pages (owner-lane pages and the planner's prefix path), so a prompt
        of whole pages that is all cached recomputes its last page."""
        return (num_tokens - 1) // self.page_size

    def match(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        """The cached pages holding the longest page-aligned prefix of ``token_ids`` (at
        most ``limit`` pages), each with a reference taken for the caller."""
        usable = self.usable_pages(len(token_ids))
        if limit is not None:
            usable = min(usable, limit)
        with self._lock:
            self.stats.lookups += 1
            self.stats.lookup_tokens += len(token_ids)
            if not self.enabled or usable <= 0:
                return []
            pages = []
            for key in chain_keys(self.seed, token_ids, self.page_size, usable):
                page = self._by_key.get(key)
                if page is None:
                    break
                pages.append(page)
            for page in pages:
                self._refs[page] = self._refs.get(page, 0) + 1
                self._idle.pop(page, None)
            self.stats.hit_tokens += len(pages) * self.page_size
            return pages

    def peek(self, token_ids: Sequence[int]) -> int:
        """How many leading full pages of ``token_ids`` are cached (no reference taken)."""
        if not self.enabled:
            return 0
        num = len(token_ids) // self.page_size
        with self._lock:
            count = 0
            for key in chain_keys(self.seed, token_ids, self.page_size, num):
                if key not in self._by_key:
                    break
                count += 1
            return count

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the full pages of a prefilled prompt (``pages``: all its pages, in order,
        every one written and held by the caller); how many pages were newly cached.
        A key cached already keeps its page; past ``max_pages`` idle pages are evicted
        first, and a page that finds no room stays uncached."""
        if not self.enabled:
            return 0
        full = min(len(token_ids) // self.page_size, len(pages))
        added, back = 0, []
        with self._lock:
            for key, page in zip(chain_keys(self.seed, token_ids, self.page_size, full), pages):
                if key in self._by_key or page in self._key_of:
                    continue
                if self._refs.get(page, 0) <= 0:
                    break  # released under us: its bytes are not ours to keep
                if len(self._key_of) >= self.max_pages:
                    if not self._idle:
                        break
                    back.append(self._evict_one())
                self._by_key[key] = page
                self._key_of[page] = key
                added += 1
            if back:
                self.allocator.free(back)
        return added

    def reclaim(self, short: Sequence[int]) -> int:
        """Evict idle cached pages, least recently used first, until each lane ``r`` got
        ``short[r]`` pages back (or none is left); the allocator calls it when short."""
        need = list(short)
        back = []
        with self._lock:
            for page in list(self._idle):
                lane = page % self.cp_size
                if need[lane] <= 0:
                    continue
                del self._idle[page]
                self._drop(page)
                back.append(page)
                need[lane] -= 1
                if not any(n > 0 for n in need):
                    break
            if back:
                self.allocator.free(back)
        return len(back)

    def clear(self) -> int:
        """Evict every idle cached page; how many went back to the lanes."""
        with self._lock:
            back = list(self._idle)
            self._idle.clear()
            for page in back:
                self._drop(page)
            if back:
                self.allocator.free(back)
        return len(back)

    def _evict_one(self) -> int:
        page, _ = self._idle.popitem(last=False)
        self._drop(page)
        return page

    def _drop(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._by_key[key]
        self.stats.evicted_pages += 1

    # -- what it holds ----------------------------------------------------------

    @property
    def cached_pages(self) -> int:
        with self._lock:
            return len(self._key_of)

    def idle_by_lane(self) -> list[int]:
        """Cached pages nobody holds, per lane (what ``reclaim`` could give back)."""
        counts = [0] * self.cp_size
        with self._lock:
            for page in self._idle:
                counts[page % self.cp_size] += 1
        return counts

    @property
    def idle_pages(self) -> int:
        with self._lock:
            return len(self._idle)

    @property
    def held_pages(self) -> int:
        """Pages with at least one reference (requests, leases, fetches)."""
        with self._lock:
            return len(self._refs)

    def refs(self, page: int) -> int:
        with self._lock:
            return self._refs.get(page, 0)
