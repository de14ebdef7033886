"""What the prefix-cache end-to-end tests share: a Generate that reports what the
caches did, transformers' greedy tokens, and the check that nothing leaked."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch
from lanekv.proto import lanekv_pb2

from tests.checkpoints import EOS_TOKEN_ID, VOCAB_SIZE


class Generated(NamedTuple):
    tokens: list[int]
    cached_tokens: int  # the first reply's: prompt tokens whose compute a cache skipped
    held_tokens: int  # the first reply's prefix_cache_tokens: what the decode cache holds of the prompt
    moved_bytes: int  # KV bytes the fetch moved (trailing metadata)
    paths: str  # how each rank's KV came ("0:shm,1:grpc"; empty when nothing moved)


def generate(stub, ids: list[int], max_new_tokens: int, **kw) -> Generated:
    request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=max_new_tokens,
                                         **kw)
    call = stub.Generate(request, timeout=120)
    tokens, cached, held = [], [], []
    for reply in call:
        tokens += reply.token_ids
        cached.append(reply.cached_tokens)
        held.append(reply.prefix_cache_tokens)
    assert all(c == 0 for c in cached[1:]) and all(h == 0 for h in held[1:])  # on the first reply only
    meta = dict(call.trailing_metadata())
    return Generated(tokens, cached[0], held[0], int(meta["lanekv-transfer-bytes"]),
                     meta.get("lanekv-transfer-paths", ""))


def reference(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``ids``."""
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=EOS_TOKEN_ID)
    return out[0, len(ids):].tolist()


def load_hf(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, attn_implementation="eager",
                                                dtype=torch.float32).eval()


def random_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist()


def page_bytes(decode) -> int:
    """KV bytes of one page over every layer (float32 GQA)."""
    a = decode.agreement
    return 2 * a.num_layers * a.page_size * a.num_kv_heads * a.head_dim * 4


def settled(prefill, decode, timeout_s: float = 10.0) -> None:
    """Nothing leaks: after idle, free = capacity - what the cache keeps, on both sides, and
    emptying the caches gives the whole pool back."""
    alloc, cache = prefill.engine.allocator, prefill.cache
    deadline = time.monotonic() + timeout_s
    # The ranks' releases and the decode side's settles come in the background.
    while (cache.held_pages or decode.budget.used or decode.pool.used_count) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cache.held_pages == 0 and prefill.leases.held() == {}
    assert sum(alloc.free_list_counts()) == alloc.num_pages - cache.idle_pages
    assert cache.idle_pages == cache.cached_pages  # nobody holds a cached page
    cache.clear()
    assert alloc.free_list_counts() == [alloc.pages_per_lane] * alloc.cp_size and cache.cached_pages == 0
    pool = decode.pool
    assert pool.used_count == 0 and decode.budget.used == 0
    assert pool.free_list_count == pool.num_pages - decode.prefix_cache.kept()
    assert decode.prefix_cache.kept() == decode.prefix_cache.cached_pages
    decode.prefix_cache.clear()
    assert pool.free_list_count == pool.num_pages and decode.prefix_cache.cached_pages == 0
