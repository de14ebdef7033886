"""Prefix caches on both sides, end to end: greedy tokens equal transformers at
every alignment of a hit, only the pages after the decode side's prefix move,
a whole cached prompt moves nothing, ``cached_tokens`` counts the skipped
compute once, and nothing leaks (pages free after idle = capacity minus what
the caches keep, and emptying the caches gives the whole pool back)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE, write_llama
from tests.daemons import running_pair

MAX_NEW = 6
PS = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("prefix-llama"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def _reference(hf, ids: list[int]) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW,
                          pad_token_id=EOS_TOKEN_ID)
    return out[0, len(ids):].tolist()


def _ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist()


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


def _page_bytes(decode) -> int:
    a = decode.agreement
    return 2 * a.num_layers * a.page_size * a.num_kv_heads * a.head_dim * 4


def _settled(prefill, decode) -> None:
    """Nothing leaks: free = capacity - kept, on both sides, and emptying the caches gives it all back."""
    alloc, cache = prefill.engine.allocator, prefill.cache
    deadline = time.monotonic() + 10
    while cache.held_pages and time.monotonic() < deadline:  # the ranks' releases come in the background
        time.sleep(0.05)
    assert cache.held_pages == 0
    assert sum(alloc.free_list_counts()) == alloc.num_pages - cache.idle_pages
    assert cache.clear() >= 0 and alloc.free_list_counts() == [alloc.pages_per_lane] * alloc.cp_size
    pool = decode.pool
    assert pool.free_list_count == pool.num_pages - decode.prefix_cache.kept()
    decode.prefix_cache.clear()
    assert pool.free_list_count == pool.num_pages and decode.budget.used == 0


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
def test_eviction_under_a_pool_smaller_than_the_working_set(checkpoint, hf):
    """Pools of 12 pages on each side; eight prompts of six or seven pages sharing two:
    both caches evict what nobody holds, every request completes equal to transformers."""
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PS, pages_per_lane=12, start_timeout_s=120)
    system = _ids(10, 20)
    prompts = [system + _ids(18 + i % 3, 30 + i) for i in range(4)]
    with running_pair(engine, pool_pages=12 + 2, transport="grpc") as (prefill, decode):
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            for ids in prompts + prompts:
                tokens, cached, _ = _generate(stub, ids)
                assert tokens == _reference(hf, ids), f"prompt of {len(ids)} tokens"
                assert cached % PS == 0 and cached <= len(ids) - 1
        assert prefill.cache.stats.evicted_pages > 0 and decode.prefix_cache.stats.evicted_pages > 0
        _settled(prefill, decode)
