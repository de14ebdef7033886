"""store_kv: Triton (interpreted on CPU) and reference against a plain row loop."""

import pytest
import torch
from lanekv.kernels.kv_layout import KVCacheSpec
from lanekv.kernels.store_kv import store_kv, store_kv_ref, store_kv_triton

from tests.markers import requires_gpu

SENTINEL = 0xA5


def _random_rows(shape, dtype, gen):
    """Random payload of any dtype, made from random bytes (NaN bit patterns included)."""
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=gen,
                        dtype=torch.uint8)
    return raw.view(dtype)


def _bytes(t):
    return t.contiguous().unsqueeze(-1).view(torch.uint8)


def _poisoned_pool(spec, num_pages, device="cpu"):
    pool = spec.alloc_pool(num_pages, device)
    pool.view(torch.uint8).fill_(SENTINEL)
    return pool


def _expected(pool, layer, k, v, locs):
    want = pool.clone()
    for t, loc in enumerate(locs.tolist()):
        if loc >= 0:
            want[layer, 0, loc] = k[t]
            want[layer, 1, loc] = v[t]
    return want


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,kv_heads,head_dim", [(1, 1, 8), (13, 3, 5), (37, 2, 24)])
@pytest.mark.parametrize("impl", [store_kv_triton, store_kv_ref])
def test_store_kv_writes_rows_and_skips_negative_locs(dtype, num_tokens, kv_heads, head_dim,
                                                      impl):
    gen = torch.Generator().manual_seed(num_tokens * 31 + head_dim)
    spec = KVCacheSpec(num_layers=3, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       page_size=3)
    pool = _poisoned_pool(spec, num_pages=20)
    rows = pool.shape[2]
    k = _random_rows((num_tokens, kv_heads, head_dim), dtype, gen)
    v = _random_rows((num_tokens, kv_heads, head_dim), dtype, gen)
    locs = torch.randperm(rows, generator=gen)[:num_tokens]
    locs[::4] = -1  # compute-padding rows are never written
    want = _expected(pool, 1, k, v, locs)
    impl(k, v, pool[1, 0], pool[1, 1], locs)
    assert torch.equal(_bytes(pool), _bytes(want))


def test_store_kv_strided_source_rows():
    # k and v as slices of one fused projection output: rows have a larger stride.
    gen = torch.Generator().manual_seed(3)
    spec = KVCacheSpec(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16, page_size=1)
    pool = _poisoned_pool(spec, num_pages=11)
    fused = torch.randn(9, 6 * 8, generator=gen).half()
    k = fused[:, 16:32].view(9, 2, 8)
    v = fused[:, 32:48].view(9, 2, 8)
    locs = torch.tensor([10, 0, -3, 4, 5, 1, 2, -1, 9])
    want = _expected(pool, 0, k, v, locs)
    store_kv_triton(k, v, pool[0, 0], pool[0, 1], locs)
    assert torch.equal(_bytes(pool), _bytes(want))


def test_store_kv_all_skipped_and_empty_leave_cache_untouched():
    spec = KVCacheSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, page_size=2)
    pool = _poisoned_pool(spec, num_pages=3)
    before = pool.clone()
    k = torch.randn(4, 1, 4)
    store_kv_triton(k, k, pool[0, 0], pool[0, 1], torch.full((4,), -1, dtype=torch.int64))
    store_kv_triton(k[:0], k[:0], pool[0, 0], pool[0, 1], torch.empty(0, dtype=torch.int64))
    assert torch.equal(_bytes(pool), _bytes(before))


def test_store_kv_dispatcher_matches_reference_on_cpu():
    spec = KVCacheSpec(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, page_size=2)
    pool = _poisoned_pool(spec, num_pages=4)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    locs = torch.tensor([7, -1, 2])
    want = _expected(pool, 1, k, v, locs)
    store_kv(k, v, pool[1, 0], pool[1, 1], locs)
    assert torch.equal(_bytes(pool), _bytes(want))


@pytest.mark.parametrize("impl", [store_kv_triton, store_kv_ref])
def test_store_kv_rejects_bad_arguments(impl):
    cache = torch.zeros(8, 2, 4)
    k = torch.zeros(3, 2, 4)
    locs = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="locs holds 8"):
        impl(k, k, cache, cache, torch.tensor([0, 8, 1]))
    with pytest.raises(ValueError, match="locs must be a 1-D int64"):
        impl(k, k, cache, cache, locs.int())
    with pytest.raises(ValueError, match="locs has 2 entries"):
        impl(k, k, cache, cache, locs[:2])
    with pytest.raises(ValueError, match="v has shape"):
        impl(k, k[:2], cache, cache, locs)
    with pytest.raises(ValueError, match="k_cache rows are"):
        impl(torch.zeros(3, 1, 4), torch.zeros(3, 1, 4), cache, cache, locs)
    with pytest.raises(ValueError, match="v.dtype is torch.float16"):
        impl(k, k.half(), cache, cache, locs)
    with pytest.raises(ValueError, match="k_cache must be a 3-D"):
        impl(k, k, cache.view(8, 8), cache, locs)
    with pytest.raises(ValueError, match="locs is on meta"):
        impl(k, k, cache, cache, locs.to("meta"))


def test_store_kv_triton_rejects_rows_that_are_not_dense():
    cache = torch.zeros(8, 2, 4)
    k = torch.zeros(3, 4, 2).transpose(1, 2)  # [3, 2, 4] with a strided head_dim
    with pytest.raises(ValueError, match="k must have contiguous rows"):
        store_kv_triton(k, k, cache, cache, torch.tensor([0, 1, 2]))


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16])
def test_store_kv_gpu_bf16_matches_reference(page_size):
    gen = torch.Generator(device="cuda").manual_seed(0)
    spec = KVCacheSpec(num_layers=4, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                       page_size=page_size)
    pool = _poisoned_pool(spec, num_pages=8192 // page_size, device="cuda")
    want = pool.clone()
    k = torch.randn(3000, 8, 128, device="cuda", generator=gen).bfloat16()
    v = torch.randn(3000, 8, 128, device="cuda", generator=gen).bfloat16()
    locs = torch.randperm(pool.shape[2], device="cuda", generator=gen)[:3000]
    locs[::7] = -1
    store_kv_triton(k, v, pool[2, 0], pool[2, 1], locs)
    store_kv_ref(k, v, want[2, 0], want[2, 1], locs)
    assert torch.equal(_bytes(pool), _bytes(want))
