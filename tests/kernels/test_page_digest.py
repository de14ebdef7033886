"""page_digest: the kernel equals kv_digest of the gathered pages, bit for bit."""

import pytest
import torch
from lanekv.kernels.kv_layout import KVCacheSpec
from lanekv.kernels.page_copy import gather_pages_ref
from lanekv.kernels.page_digest import kv_digest, page_digest, page_digest_ref, page_digest_triton

from tests.markers import requires_gpu

U64 = (1 << 64) - 1


def _pool(dtype, num_pages, page_size, device="cpu", seed=0):
    spec = KVCacheSpec(num_layers=3, kv_heads=2, head_dim=4, dtype=dtype, page_size=page_size)
    pool = spec.alloc_pool(num_pages, device)
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, pool.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
    pool.view(torch.uint8).copy_(raw.to(device))
    return pool


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("layers", [(0, 3), (1, 2)])
def test_kernel_equals_the_digest_of_the_gathered_pages(dtype, page_size, layers):
    pool = _pool(dtype, 7, page_size, seed=page_size)
    pages = torch.tensor([5, 0, 3, 6], dtype=torch.int64)
    want = kv_digest(gather_pages_ref(pool, pages, page_size, *layers))
    assert int(page_digest_triton(pool, pages, page_size, *layers)) & U64 == want
    assert int(page_digest_ref(pool, pages, page_size, *layers)) & U64 == want


def test_digest_depends_on_page_order_and_bytes():
    pool = _pool(torch.float16, 6, 4)
    a = int(page_digest_triton(pool, torch.tensor([1, 2]), 4, 0, 3))
    assert a != int(page_digest_triton(pool, torch.tensor([2, 1]), 4, 0, 3))
    pool.view(torch.int16)[2, 1, 5, 0, 0] ^= 4  # a bit of page 1, layer 2, V
    assert a != int(page_digest_triton(pool, torch.tensor([1, 2]), 4, 0, 3))


@pytest.mark.parametrize("digest", [page_digest_triton, page_digest_ref])
def test_digests_of_layer_ranges_add_up_to_the_whole(digest):
    pool = _pool(torch.float16, 7, 4, seed=3)
    pages = torch.tensor([6, 2, 4], dtype=torch.int64)
    whole = kv_digest(gather_pages_ref(pool, pages, 4, 0, 3))
    parts = [int(digest(pool, pages, 4, a, b, first_layer=0)) for a, b in ((0, 1), (1, 3))]
    assert sum(parts) & U64 == whole
    # Without first_layer a range is digested as a buffer of its own.
    assert int(digest(pool, pages, 4, 1, 3)) & U64 == kv_digest(gather_pages_ref(pool, pages, 4, 1, 3))
    with pytest.raises(ValueError, match="first_layer"):
        digest(pool, pages, 4, 1, 3, first_layer=2)


def test_launcher_checks_its_arguments():
    pool = _pool(torch.float16, 4, 2)
    with pytest.raises(ValueError, match="layer range"):
        page_digest_triton(pool, torch.tensor([0]), 2, 2, 2)
    with pytest.raises(ValueError, match="pages"):
        page_digest_triton(pool, torch.tensor([0.0]), 2, 0, 1)
    odd = KVCacheSpec(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float16, page_size=2).alloc_pool(2, "cpu")
    with pytest.raises(ValueError, match="4-byte words"):
        page_digest_triton(odd, torch.tensor([0]), 2, 0, 1)
    # The dispatcher takes the reference for such rows.
    assert int(page_digest(odd, torch.tensor([1]), 2, 0, 1)) & U64 == kv_digest(odd[:, :, 2:4].contiguous())


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernel_equals_the_cpu_reference(dtype):
    pool = _pool(dtype, 64, 16, device="cuda")
    pages = torch.randperm(64)[:40].cuda()
    got = int(page_digest_triton(pool, pages, 16, 0, 3)) & U64
    assert got == int(page_digest_ref(pool.cpu(), pages.cpu(), 16, 0, 3)) & U64



@pytest.mark.parametrize("triton_path", [True, False])
def test_page_digest_in_groups_equals_the_whole(monkeypatch, triton_path):
    import lanekv.kernels.page_digest as module

    monkeypatch.setattr(module, "use_triton", lambda t: triton_path)
    pool = _pool(torch.float16, 7, 4, seed=5)
    pages = torch.tensor([3, 0, 6], dtype=torch.int64)
    digest = module.PageDigest(pool, pages, 4, 0, 3)
    digest.add(0, 2)
    digest.add(2, 3)
    assert int(digest.total()) & U64 == kv_digest(gather_pages_ref(pool, pages, 4, 0, 3))
    with pytest.raises(ValueError, match="not within"):
        digest.add(2, 4)
