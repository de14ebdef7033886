"""The decode daemon's prefix cache: whole prompt pages it received and verified,
and whole pages of the replies it generated.

Keys are the prefill side's (``transfer.protocol.prefix_keys.chain_keys``: the agreement's
fingerprint, then every page's token ids up to and including it). A received
page enters only after the fetch that brought it verified every chunk's
checksum or digest and checked that every layer of every page arrived
(``KVFetcher.fetch`` returned): a failed, cancelled or partial fetch admits
nothing. A cached page is never written again (decode appends after the
prompt's last full page, and a whole-prompt hit copies its last page first).

Generated pages: when a request ends by a stop token or its length (not when
cancelled or failed), the engine offers the rows its steps wrote, keyed by the
token ids it fed (``DecodeEngine.on_finish``): the prompt, then every output
token but the last (whose row no step wrote). Only whole pages enter. So a
conversation's next turn, whose prompt is this prompt + the reply + a new
turn, hits past the prompt into the reply's pages -- when its token ids are
the ones generated. A client that detokenizes the reply and tokenizes it
again may get other ids (BPE merges across the seam); the chain keys then
differ from that page on and the prompt just misses there: a key is token ids,
never text, so a hit is never a near match. These rows were computed here, by
the decode step, so there is nothing to verify: they are what every later
step of the request read.

It is the pool's ``keeper`` and shares the pool's lock: the pool counts who
holds a page (requests' page tables, a match in progress); a cached page
nobody holds waits, least recently used first, until an allocation needs it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lanekv.decode.pool import PagePool
from lanekv.transfer.protocol.prefix_keys import chain_keys


@dataclass
class DecodeCacheStats:
    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    admitted_pages: int = 0


class DecodePrefixCache:
    """``enabled=False``: matches nothing and keeps nothing. ``max_pages``: at most
    this many pages cached (a share of the pool)."""

    def __init__(self, pool: PagePool, seed: str, *, enabled: bool = True, max_pages: int | None = None) -> None:
        if max_pages is not None and (isinstance(max_pages, bool) or not isinstance(max_pages, int)
                                      or max_pages < 0):
            raise ValueError(f"max_pages must be None or an int >= 0, got max_pages={max_pages!r}")
        self.pool = pool
        self.page_size = pool.page_size
        self.seed = seed
        self.enabled = enabled
        self.max_pages = pool.num_pages if max_pages is None else max_pages
        self.stats = DecodeCacheStats()
        self._by_key: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached, held by nobody: LRU first
        pool.keeper = self

    def match(self, token_ids: Sequence[int], limit: int, *, count: bool = True) -> list[int]:
        """Physical pages holding the longest run of ``token_ids``' leading whole pages
        (at most ``limit``), each held for the caller (``pool.free`` gives it back).
        ``count=False``: a second look of the same request, left out of the stats."""
        with self.pool.lock:
            if count:
                self.stats.lookups += 1
                self.stats.lookup_tokens += len(token_ids)
            if not self.enabled or limit <= 0:
                return []
            pages = []
            for key in chain_keys(self.seed, token_ids, self.page_size, limit):
                page = self._by_key.get(key)
                if page is None:
                    break
                pages.append(page)
            self.pool.share(pages)
            for page in pages:
                self._idle.pop(page, None)
            if count:
                self.stats.hit_tokens += len(pages) * self.page_size
            return pages

    def peek(self, token_ids: Sequence[int]) -> int:
        """Leading whole pages of ``token_ids`` cached (nothing held)."""
        if not self.enabled:
            return 0
        with self.pool.lock:
            count = 0
            for key in chain_keys(self.seed, token_ids, self.page_size, len(token_ids) // self.page_size):
                if key not in self._by_key:
                    break
                count += 1
            return count

    def admit(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the whole pages of ``token_ids`` (``pages``: the request's physical
        pages, in order, held by the caller, their bytes verified); how many are new.
        Past ``max_pages`` idle pages are evicted first; a page with no room stays out."""
        if not self.enabled:
            return 0
        full = min(len(token_ids) // self.page_size, len(pages))
        added, back = 0, []
        with self.pool.lock:
            for key, page in zip(chain_keys(self.seed, token_ids, self.page_size, full), pages):
                if key in self._by_key or page in self._key_of:
                    continue
                if len(self._key_of) >= self.max_pages:
                    if not self._idle:
                        break
                    back.extend(self.evict(1))
                self._by_key[key] = page
                self._key_of[page] = key
                added += 1
            self.stats.admitted_pages += added
            if back:
                self.pool._to_free_list(back)
        return added

    def clear(self) -> int:
        """Evict every cached page nobody holds; how many went back to the free list."""
        with self.pool.lock:
            back = self.evict(len(self._idle))
            self.pool._to_free_list(back)
        return len(back)

    # -- the pool's keeper (called under its lock) -------------------------------

    def keep(self, page: int) -> bool:
        if page not in self._key_of:
            return False
        self._idle[page] = None
        return True

    def evict(self, n: int) -> list[int]:
        out = []
        while self._idle and len(out) < n:
            page, _ = self._idle.popitem(last=False)
            del self._by_key[self._key_of.pop(page)]
            self.stats.evicted_pages += 1
            out.append(page)
        return out

    def kept(self) -> int:
        return len(self._idle)

    @property
    def cached_pages(self) -> int:
        with self.pool.lock:
            return len(self._key_of)
