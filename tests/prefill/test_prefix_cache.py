"""The prefill side's prefix cache on its own: chain keys, floored hits, references,
LRU eviction only of pages nobody holds, the cap, and nothing leaks."""

from __future__ import annotations

import pytest
from lanekv.prefill.allocator import LaneAllocator, OutOfPagesError
from lanekv.prefill.prefix_cache import PrefillPrefixCache
from lanekv.transfer.protocol.prefix_keys import chain_keys


def _cache(cp=2, per_lane=4, ps=4, **kw):
    alloc = LaneAllocator(cp, per_lane)
    return alloc, PrefillPrefixCache(alloc, ps, "fp-a", **kw)


def _prefill(alloc, cache, ids, ps=4):
    """What the daemon does: match, allocate the rest, hold, insert; returns all pages."""
    prefix = cache.match(ids)
    fresh = alloc.allocate([k % alloc.cp_size for k in range(len(prefix), -(-len(ids) // ps))])
    cache.hold(fresh)
    pages = prefix + fresh
    cache.insert(ids, pages)
    return prefix, pages


def test_chain_keys_cover_every_page_before():
    a = chain_keys("fp", [1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    b = chain_keys("fp", [9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[1] != b[1]  # same second page, different first page: no match
    assert chain_keys("other", [1, 2, 3, 4], 4, 1) != a[:1]  # another agreement never matches


def test_hits_are_whole_pages_and_leave_the_last_token():
    alloc, cache = _cache()
    ids = list(range(10, 22))  # 12 tokens, 3 whole pages
    prefix, pages = _prefill(alloc, cache, ids)
    assert prefix == [] and cache.cached_pages == 3
    cache.free(pages)
    # The whole prompt again: its last page is recomputed (the first token needs its last token).
    again = cache.match(ids)
    assert again == pages[:2]
    cache.free(again)
    # A longer prompt: the three pages; a strict prefix of 6 tokens: one page; another first page: nothing.
    longer = cache.match(ids + [1, 2])
    assert longer == pages
    cache.free(longer)
    strict = cache.match(ids[:6])
    assert strict == pages[:1]
    cache.free(strict)
    assert cache.match([0] + ids[1:]) == []
    # Looked-up and matched tokens are counted.
    assert cache.stats.hit_tokens == (2 + 3 + 1) * 4


def test_pages_in_use_are_never_evicted_and_idle_ones_are_lru():
    alloc, cache = _cache(cp=1, per_lane=4)
    first = list(range(100, 108))  # 2 pages
    second = list(range(200, 208))
    _, p1 = _prefill(alloc, cache, first)
    _, p2 = _prefill(alloc, cache, second)
    assert alloc.free_list_counts() == [0]
    with pytest.raises(OutOfPagesError):  # every page is held: nothing is evicted
        alloc.allocate([0])
    cache.free(p2)
    cache.free(p1)  # p2 idle first, then p1: p1 is the most recent
    assert alloc.free_counts() == [4] and alloc.free_list_counts() == [0]
    hit = cache.match(second + [1])  # touch the second prompt: now the first is least recent
    cache.free(hit)
    got = alloc.allocate([0])
    assert got == [p1[0]] and cache.stats.evicted_pages == 1
    # The first prompt's chain is broken at its first page: no stale hit of its second page.
    assert cache.match(first + [1]) == []
    alloc.free(got)
    assert cache.clear() == 3 and alloc.free_list_counts() == [4] and cache.held_pages == 0


def test_the_cap_bounds_what_is_cached():
    alloc, cache = _cache(cp=1, per_lane=8, max_pages=2)
    _, p1 = _prefill(alloc, cache, list(range(12)))
    assert cache.cached_pages == 2  # the third page found no room: it goes back at release
    cache.free(p1)
    assert alloc.free_list_counts() == [6]
    _, p2 = _prefill(alloc, cache, list(range(50, 58)))  # evicts the idle ones to stay at two
    assert cache.cached_pages == 2 and cache.stats.evicted_pages == 2
    cache.free(p2)
    assert cache.clear() == 2 and alloc.free_list_counts() == [8]


def test_disabled_cache_frees_at_the_last_reference():
    alloc, cache = _cache(enabled=False)
    ids = list(range(16))
    prefix, pages = _prefill(alloc, cache, ids)
    assert prefix == [] and cache.cached_pages == 0
    cache.hold(pages[:1])
    cache.free(pages)
    assert alloc.num_used() == 1
    cache.free(pages[:1])
    assert alloc.num_used() == 0
    with pytest.raises(ValueError, match="not held"):
        cache.free(pages[:1])


def test_a_released_page_is_not_cached():
    alloc, cache = _cache(cp=1)
    ids = list(range(8))
    pages = alloc.allocate([0, 0])
    cache.hold(pages)
    cache.free(pages[1:])  # released before the prefill ended
    assert cache.insert(ids, pages) == 1 and cache.cached_pages == 1
