"""Prefix caches on both sides, end to end: greedy tokens equal transformers at
every alignment of a hit, only the pages after the decode side's prefix move,
a whole cached prompt moves nothing, ``cached_tokens`` counts the skipped
compute once, and nothing leaks (pages free after idle = capacity minus what
the caches keep, and emptying the caches gives the whole pool back)."""

from __future__ import annotations

import threading

import grpc
import pytest
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.prefix_checks import load_hf, page_bytes, random_ids, reference, settled

MAX_NEW = 6
PS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("prefix-llama"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def _reference(hf, ids: list[int]) -> list[int]:
    return reference(hf, ids, MAX_NEW)


def _ids(n: int, seed: int) -> list[int]:
    return random_ids(n, seed)


def _generate(stub, ids: list[int]) -> tuple[list[int], int, dict]:
    request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=MAX_NEW)
    call = stub.Generate(request, timeout=120)
    tokens, cached = [], []
    for reply in call:
        tokens += reply.token_ids
        cached.append(reply.cached_tokens)
    assert all(c == 0 for c in cached[1:])  # counted once, on the first reply
    return tokens, cached[0], dict(call.trailing_metadata())


@pytest.fixture(scope="module", params=[(2, "auto"), (3, "grpc")], ids=["cp2-auto", "cp3-grpc"])
def pair(request, checkpoint):
    cp, transport = request.param
    engine = EngineConfig(str(checkpoint), cp_size=cp, page_size=PS, pages_per_lane=40, start_timeout_s=120)
    with running_pair(engine, pool_pages=80, transport=transport) as daemons:
        yield daemons


_page_bytes, _settled = page_bytes, settled


@pytest.mark.timeout(300)
def test_multi_turn_hits_at_every_alignment(pair, hf):
    prefill, decode = pair
    page_bytes = _page_bytes(decode)
    base = _ids(23, 1)  # 4 whole pages and 3 tokens
    # (prompt, decode pages held before it, tokens whose compute the caches skip)
    turns = [
        (base, 0, 0),  # cold
        (base, 4, 20),  # the same prompt: the last page (with the last token) is prefilled again
        (base[:12], 2, 10),  # a strict prefix of a cached prompt
        (base + _ids(9, 2), 4, 20),  # the next turn: the first prompt's pages, then new ones
        (base[:20], 4, 19),  # a prompt of whole pages, all cached: decode's own step samples
        (_ids(7, 3), 0, 0),  # nothing shared
        (base[:3], 0, 0),  # shorter than a page
    ]
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        for ids, held, cached in turns:
            lookups = prefill.cache.stats.lookups
            tokens, got_cached, meta = _generate(stub, ids)
            assert tokens == _reference(hf, ids), f"prompt of {len(ids)} tokens"
            assert got_cached == cached, f"prompt of {len(ids)} tokens"
            assert got_cached <= len(ids)
            moved = int(meta["lanekv-transfer-bytes"])
            assert moved == (-(-len(ids) // PS) - held) * page_bytes, f"prompt of {len(ids)} tokens"
            whole_hit = held * PS == len(ids)
            assert (prefill.cache.stats.lookups == lookups) == whole_hit  # no prefill asked on a whole hit
    _settled(prefill, decode)


@pytest.mark.timeout(300)
def test_concurrent_requests_share_a_prefix(pair, hf):
    prefill, decode = pair
    system = _ids(16, 4)
    prompts = [system + _ids(3 + i, 10 + i) for i in range(4)]
    with grpc.insecure_channel(decode.endpoint) as channel:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        _generate(stub, system + [7])  # the shared part is cached on both sides
        out: list = [None] * len(prompts)

        def run(i: int) -> None:
            out[i] = _generate(stub, prompts[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for ids, result in zip(prompts, out):
        assert result is not None
        tokens, cached, _ = result
        assert tokens == _reference(hf, ids)
        assert cached == 15  # three whole pages of the system prompt
    _settled(prefill, decode)


@pytest.mark.timeout(300)
def test_eviction_under_a_pool_smaller_than_the_working_set(checkpoint, hf, monkeypatch):
    """Pools of 12 pages on each side; conversations of six or seven pages sharing two,
    two at a time, each followed by its next turn (prompt + reply + a new turn): both
    caches evict what nobody holds, never a page in use, and every request completes
    equal to transformers."""
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PS, pages_per_lane=12, start_timeout_s=120)
    system = _ids(10, 20)
    prompts = [system + _ids(18 + i % 3, 30 + i) for i in range(4)]
    with running_pair(engine, pool_pages=2 * (12 + 2), transport="grpc") as (prefill, decode):
        in_use: list[int] = []
        evict, drop = decode.prefix_cache.evict, prefill.cache._drop

        def checked_evict(n: int) -> list[int]:  # under the pool's lock
            pages = evict(n)
            in_use.extend(p for p in pages if decode.pool.refs(p) != 0)
            return pages

        def checked_drop(page: int) -> None:  # under the prefill cache's lock
            if prefill.cache._refs.get(page, 0):
                in_use.append(page)
            drop(page)

        monkeypatch.setattr(decode.prefix_cache, "evict", checked_evict)
        monkeypatch.setattr(prefill.cache, "_drop", checked_drop)
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            out: dict = {}

            def run(i: int) -> None:
                out[i] = _generate(stub, prompts[i])

            for first, second in ((0, 1), (2, 3), (0, 2), (1, 3)):
                out.clear()
                threads = [threading.Thread(target=run, args=(i,)) for i in (first, second)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(120)
                for i in (first, second):
                    tokens, cached, _ = out[i]
                    assert tokens == _reference(hf, prompts[i]), f"prompt {i}"
                    # Whole pages skipped, or every token but the last (a whole prompt in the decode cache).
                    assert (cached % PS == 0 and cached < len(prompts[i])) or cached == len(prompts[i]) - 1
                    follow = prompts[i] + tokens + _ids(2, 50 + i)  # the next turn, alone
                    assert _generate(stub, follow)[0] == _reference(hf, follow), f"prompt {i}, next turn"
        assert prefill.cache.stats.evicted_pages > 0 and decode.prefix_cache.stats.evicted_pages > 0
        assert in_use == []  # no page anyone held was evicted
        _settled(prefill, decode)
