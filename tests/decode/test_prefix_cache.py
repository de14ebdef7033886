"""The decode pool's holders and prefix cache, and routing by prefix (the decode
daemon's pick among prefill daemons, the HTTP front's among decode daemons)."""

from __future__ import annotations

import pytest
import torch
from lanekv.decode.pool import PagePool, PageTable, PoolExhausted
from lanekv.decode.prefill_call import PrefillClient, PrefillPool, PrefillTarget
from lanekv.decode.prefix.cache import DecodePrefixCache
from lanekv.decode.prefix.route import PrefixMemory
from lanekv.kernels.kv_layout import KVCacheSpec

from lanekv.http.backends import ROUTE_SLACK, Backend, Backends
from tests.decode.test_prefill_pool import FakeHealth, _topology

PS = 4


def _pool(num_pages=6, **kw):
    spec = KVCacheSpec(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, page_size=PS)
    pool = PagePool(spec, num_pages)
    return pool, DecodePrefixCache(pool, "fp", **kw)


def test_admitted_pages_outlive_their_request_and_serve_hits():
    pool, cache = _pool()
    ids = list(range(10, 21))  # two whole pages and three tokens
    table = PageTable.remap(pool, [7, 8, 9], len(ids))
    assert cache.admit(ids, table.pages) == 2
    table.release()
    assert pool.free_list_count == 4 and pool.free_count == 6 and cache.kept() == 2
    hit = cache.match(ids, (len(ids) - 1) // PS)
    assert len(hit) == 2 and all(pool.refs(p) == 1 for p in hit)
    again = PageTable.remap(pool, [1, 2, 3], len(ids), cached=hit)
    assert again.pages[:2] == tuple(hit) and pool.refs(hit[0]) == 1
    held = cache.match(ids, 2)
    with pytest.raises(ValueError, match="last page comes fresh"):
        PageTable.remap(pool, [1, 2], 8, cached=held)
    pool.free(held)
    again.release()
    assert cache.kept() == 2 and cache.match([0] + ids[1:], 2) == []


def test_only_pages_nobody_holds_are_evicted_lru_first():
    pool, cache = _pool(num_pages=4)
    a, b = list(range(8)), list(range(50, 58))
    ta, tb = PageTable.allocate(pool, 8), PageTable.allocate(pool, 8)
    cache.admit(a, ta.pages)
    cache.admit(b, tb.pages)
    with pytest.raises(PoolExhausted):  # every page is held
        pool.allocate(1)
    b_pages = tb.pages
    tb.release()
    ta.release()  # b idle first: evicted first
    got = pool.allocate(2)
    assert set(got) == set(b_pages) and cache.stats.evicted_pages == 2
    assert cache.peek(a) == 2 and cache.peek(b) == 0
    pool.free(got)
    assert cache.clear() == 2 and pool.free_list_count == 4


def test_disabled_and_capped():
    pool, cache = _pool(enabled=False)
    t = PageTable.allocate(pool, 8)
    assert cache.admit(list(range(8)), t.pages) == 0
    t.release()
    assert pool.free_list_count == 6
    pool, cache = _pool(max_pages=1)
    t = PageTable.allocate(pool, 8)
    assert cache.admit(list(range(8)), t.pages) == 1
    t.release()
    assert pool.free_list_count == 5


def test_prefill_pick_prefers_a_remembered_prefix_unless_busier_by_more():
    targets = [PrefillTarget(PrefillClient(None, f"127.0.0.1:{7000 + i}"), _topology(i), FakeHealth(),
                             memory=PrefixMemory("fp", PS)) for i in range(2)]
    pool = PrefillPool(targets, interval_s=60.0, timeout_s=0.5)
    try:
        a, b = targets
        prompt = list(range(40))
        b.memory.remember(prompt[:32])
        assert pool.pick(40, token_ids=prompt) is b and pool.picks_on_hit == 1
        pool.done(b, 40)
        b.queued_tokens = 31  # busier than a by less than the 32 cached tokens: still b
        assert pool.pick(40, token_ids=prompt) is b
        pool.done(b, 40)
        b.queued_tokens = 33  # busier by more: a
        assert pool.pick(40, token_ids=prompt) is a
        assert (pool.picks, pool.picks_on_hit) == (3, 2)
    finally:
        pool.close()


def test_front_pick_prefers_a_remembered_prefix_within_the_slack():
    backends = Backends(config=type("C", (), {"max_running_per_decode": 100})(),
                        members=[Backend(f"127.0.0.1:{9000 + i}", healthy=True) for i in range(2)])
    a, b = backends.members
    prompt = list(range(64))
    backends.remember(b, prompt)
    assert backends.pick(prompt_ids=prompt + [1]) is b
    b.running = ROUTE_SLACK + 1  # too busy: load wins
    assert backends.pick(prompt_ids=prompt) is a
    assert (backends.picks, backends.picks_on_hit) == (2, 1)


def test_a_short_remembered_head_does_not_steer_the_pick():
    targets = [PrefillTarget(PrefillClient(None, f"127.0.0.1:{7000 + i}"), _topology(i), FakeHealth(),
                             memory=PrefixMemory("fp", PS)) for i in range(2)]
    pool = PrefillPool(targets, interval_s=60.0, timeout_s=0.5)
    try:
        prompt = list(range(40))
        targets[1].memory.remember(prompt[:16])  # 16 of 40 tokens: under half, load decides (turns)
        got = {pool.pick(40, token_ids=prompt) for _ in range(2)}
        assert got == set(targets) and pool.picks_on_hit == 0
    finally:
        pool.close()


def test_a_reply_showing_an_evicted_prefix_makes_the_memory_forget_it():
    memory = PrefixMemory("fp", PS)
    prompt = list(range(40))  # ten whole pages
    memory.remember(prompt)
    # The daemon matched only two pages (the rest evicted there) and, its cache full, kept
    # only those: we forget the rest, and say the pick had followed a stale prefix.
    assert memory.observe(prompt, 8, hit_tokens=8) is True
    assert memory.cached_tokens(prompt) == 8
    # A reply matching all we remembered is not stale; what it holds now is remembered.
    assert memory.observe(prompt, 40, hit_tokens=8) is False
    assert memory.cached_tokens(prompt) == 40
    # The last token's page is never a prefill hit: a full memory against a hit of nine pages is fine.
    assert memory.observe(prompt, 40, hit_tokens=36) is False
    # Held-only form (the front's): stale when it holds less than remembered.
    assert memory.observe(prompt, 12) is True and memory.cached_tokens(prompt) == 12
    assert memory.observe(prompt, 12) is False
    with pytest.raises(ValueError, match="held_tokens"):
        memory.observe(prompt, -1)


def test_the_prefill_pick_stops_following_a_prefix_the_daemon_evicted():
    targets = [PrefillTarget(PrefillClient(None, f"127.0.0.1:{7000 + i}"), _topology(i), FakeHealth(),
                             memory=PrefixMemory("fp", PS)) for i in range(2)]
    pool = PrefillPool(targets, interval_s=60.0, timeout_s=0.5)
    try:
        a, b = targets
        prompt = list(range(40))
        b.memory.remember(prompt[:32])
        a.queued_tokens, b.queued_tokens = 1, 5  # b is busier, by less than its remembered prefix
        assert pool.pick(40, token_ids=prompt) is b and pool.picks_on_hit == 1
        pool.done(b, 40)
        # b's reply: none of the prompt was cached there any more, and it keeps none (cache off).
        pool.observed(b, b.memory.observe(prompt, 0, hit_tokens=0))
        assert pool.picks_on_stale == 1 and b.memory.cached_tokens(prompt) == 0
        assert pool.pick(40, token_ids=prompt) is a and pool.picks_on_hit == 1  # the same loads: a now
    finally:
        pool.close()


def test_the_front_forgets_what_a_decode_daemon_no_longer_holds():
    backends = Backends(config=type("C", (), {"max_running_per_decode": 100})(),
                        members=[Backend(f"127.0.0.1:{9000 + i}", healthy=True) for i in range(2)])
    a, b = backends.members
    prompt = list(range(64))
    backends.remember(b, prompt)
    assert backends.pick(prompt_ids=prompt) is b
    backends.done(b)
    backends.observe(b, prompt, 0)  # its first reply: its cache holds none of the prompt
    assert backends.picks_on_stale == 1 and b.memory.cached_tokens(prompt) == 0
    a.running = 1  # b is less busy: picked by load now, not by a prefix
    assert backends.pick(prompt_ids=prompt) is b and backends.picks_on_hit == 1
    backends.done(b)
    backends.observe(b, prompt, 64)  # it holds the whole prompt again
    assert backends.picks_on_stale == 1 and b.memory.cached_tokens(prompt) == 64
