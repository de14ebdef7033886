"""An MLA pool (kv=1, one head of the latent width) through the copy and digest
kernels: the same wire order, bytes and digests as a K/V pool, one plane per layer."""

import pytest
import torch
from lanekv.kernels.kv_layout import KVCacheSpec, check_pool_tensor
from lanekv.kernels.page_copy import gather_pages_ref, gather_pages_triton, scatter_pages_triton
from lanekv.kernels.page_digest import kv_digest, page_digest_ref, page_digest_triton
from lanekv.kernels.store_kv import store_kv_ref, store_kv_triton

U64 = (1 << 64) - 1
LATENT = 40  # kv_lora_rank 32 + qk_rope_head_dim 8 of the tiny test models


def _pool(num_pages: int, page_size: int, seed: int = 0) -> torch.Tensor:
    spec = KVCacheSpec(num_layers=3, kv_heads=1, head_dim=LATENT, dtype=torch.float16,
                       page_size=page_size, kv=1)
    pool = spec.alloc_pool(num_pages, "cpu")
    gen = torch.Generator().manual_seed(seed)
    pool.view(torch.uint8).copy_(torch.randint(0, 256, pool.view(torch.uint8).shape,
                                               generator=gen, dtype=torch.uint8))
    return pool


def test_spec_and_check_accept_one_plane():
    spec = KVCacheSpec(num_layers=27, kv_heads=1, head_dim=576, dtype=torch.bfloat16,
                       page_size=64, kv=1)
    assert spec.pool_shape(2) == (27, 1, 128, 1, 576)
    assert spec.page_bytes == 27 * 64 * 576 * 2  # about 31 KB per token over 64 tokens
    assert check_pool_tensor(spec.alloc_pool(2, "cpu"), 64) == 2
    with pytest.raises(ValueError, match="KVCacheSpec.kv"):
        KVCacheSpec(num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float16, page_size=4, kv=3)
    with pytest.raises(ValueError, match="has shape"):
        spec.check_pool(torch.zeros(27, 2, 128, 1, 576, dtype=torch.bfloat16))


@pytest.mark.parametrize("page_size", [1, 4])
def test_gather_scatter_and_digest_of_latent_pages(page_size):
    pool = _pool(6, page_size, seed=page_size)
    pages = torch.tensor([4, 0, 5])
    want = torch.cat([pool[1:3, :, p * page_size:(p + 1) * page_size] for p in pages.tolist()], 2)
    got = gather_pages_triton(pool, pages, page_size, 1, 3)
    assert got.shape == (2, 1, 3 * page_size, 1, LATENT)
    assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8))
    assert torch.equal(gather_pages_ref(pool, pages, page_size, 1, 3).view(torch.int16),
                       got.view(torch.int16))
    other = torch.zeros_like(pool)
    scatter_pages_triton(got, other, torch.tensor([1, 2, 3]), page_size, 1, 3)
    assert torch.equal(gather_pages_ref(other, torch.tensor([1, 2, 3]), page_size, 1, 3)
                       .view(torch.int16), got.view(torch.int16))
    whole = kv_digest(gather_pages_ref(pool, pages, page_size, 0, 3))
    assert int(page_digest_triton(pool, pages, page_size, 0, 3)) & U64 == whole
    parts = [int(page_digest_triton(pool, pages, page_size, a, b, first_layer=0))
             for a, b in ((0, 1), (1, 3))]
    assert sum(parts) & U64 == whole
    assert int(page_digest_ref(pool, pages, page_size, 1, 3, first_layer=0)) == parts[1]


@pytest.mark.parametrize("store", [store_kv_triton, store_kv_ref])
def test_store_latent_rows(store):
    pool = torch.zeros(1, 1, 8, 1, LATENT, dtype=torch.float16)
    latent = torch.randn(3, 1, LATENT).half()
    cache = pool[0, 0]
    store(latent, latent, cache, cache, torch.tensor([5, -1, 0]))
    assert torch.equal(cache[5], latent[0]) and torch.equal(cache[0], latent[2])
    assert cache[1:5].abs().sum() == 0
