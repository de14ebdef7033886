"""KV pool layout, gather_pages and scatter_pages (bit-exact, any page order and pool size)."""

import pytest
import torch
from lanekv.kernels.kv_layout import KVCacheSpec, check_pool_tensor
from lanekv.kernels.page_copy import (
    gather_pages,
    gather_pages_ref,
    gather_pages_triton,
    scatter_pages,
    scatter_pages_ref,
    scatter_pages_triton,
)

from tests.markers import requires_gpu

SENTINEL = 0x5A
DTYPES = [torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.bfloat16]


def _bytes(t):
    return t.contiguous().unsqueeze(-1).view(torch.uint8)


def _random_pool(spec, num_pages, gen):
    """A pool full of random bytes: every bit pattern, NaN payloads included."""
    pool = spec.alloc_pool(num_pages, "cpu")
    pool.view(torch.uint8).copy_(
        torch.randint(0, 256, pool.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
    )
    return pool


def _naive_gather(pool, pages, page_size, layer_start, layer_end):
    chunks = [pool[layer_start:layer_end, :, p * page_size:(p + 1) * page_size]
              for p in pages.tolist()]
    return torch.cat(chunks, dim=2)


def test_spec_shapes_and_bytes():
    spec = KVCacheSpec(num_layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                       page_size=16)
    assert spec.row_shape == (8, 128)
    assert spec.page_bytes == 32 * 2 * 16 * 8 * 128 * 2
    pool = spec.alloc_pool(3, "cpu")
    assert pool.shape == (32, 2, 48, 8, 128) and pool.dtype == torch.bfloat16
    assert spec.check_pool(pool) == 3
    assert check_pool_tensor(pool, 16) == 3


@pytest.mark.parametrize(
    "field,value,match",
    [("num_layers", 0, "num_layers"), ("kv_heads", -1, "kv_heads"),
     ("head_dim", 2.0, "head_dim"), ("page_size", 0, "page_size"),
     ("dtype", torch.int64, "dtype")],
)
def test_spec_rejects_bad_fields(field, value, match):
    fields = dict(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    fields[field] = value
    with pytest.raises(ValueError, match=f"KVCacheSpec.{match}"):
        KVCacheSpec(**fields)


def test_check_pool_names_the_problem():
    spec = KVCacheSpec(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)
    pool = spec.alloc_pool(2, "cpu")
    with pytest.raises(ValueError, match="src_pool.dtype"):
        spec.check_pool(pool.float(), "src_pool")
    with pytest.raises(ValueError, match="has shape"):
        spec.check_pool(pool[:1])
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        spec.check_pool(pool[:, :, :7])
    with pytest.raises(ValueError, match="contiguous"):
        spec.check_pool(torch.zeros(2, 2, 8, 8, 2, dtype=torch.float16).transpose(3, 4))
    with pytest.raises(ValueError, match="num_pages"):
        spec.alloc_pool(-1, "cpu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("impl", [gather_pages_triton, gather_pages_ref])
def test_gather_pages_wire_order(dtype, page_size, impl):
    gen = torch.Generator().manual_seed(page_size)
    spec = KVCacheSpec(num_layers=4, kv_heads=3, head_dim=5, dtype=dtype, page_size=page_size)
    pool = _random_pool(spec, num_pages=11, gen=gen)
    pages = torch.tensor([9, 0, 4, 10, 2])
    out = torch.empty((2, 2, 5 * page_size, 3, 5), dtype=dtype)
    out.view(torch.uint8).fill_(SENTINEL)
    got = impl(pool, pages, page_size, 1, 3, out)
    assert got is out
    assert torch.equal(_bytes(out), _bytes(_naive_gather(pool, pages, page_size, 1, 3)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.uint8])
@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("impl", [scatter_pages_triton, scatter_pages_ref])
def test_scatter_pages_into_another_pool(dtype, page_size, impl):
    gen = torch.Generator().manual_seed(page_size + 7)
    spec = KVCacheSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=dtype, page_size=page_size)
    src = _random_pool(spec, num_pages=9, gen=gen)
    src_pages = torch.tensor([8, 1, 5, 3])
    buf = gather_pages_ref(src, src_pages, page_size, 0, 3)
    dst = spec.alloc_pool(6, "cpu")  # a smaller pool, another page order
    dst.view(torch.uint8).fill_(SENTINEL)
    before = dst.clone()
    dst_pages = torch.tensor([2, 5, 0, 4], dtype=torch.int32)
    impl(buf, dst, dst_pages, page_size, 0, 3)
    for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
        rows = slice(d * page_size, (d + 1) * page_size)
        assert torch.equal(_bytes(dst[:, :, rows]), _bytes(src[:, :, s * page_size:
                                                                 (s + 1) * page_size]))
    for untouched in (1, 3):
        rows = slice(untouched * page_size, (untouched + 1) * page_size)
        assert torch.equal(_bytes(dst[:, :, rows]), _bytes(before[:, :, rows]))


def test_scatter_a_layer_range_leaves_other_layers():
    gen = torch.Generator().manual_seed(1)
    spec = KVCacheSpec(num_layers=4, kv_heads=1, head_dim=6, dtype=torch.float32, page_size=2)
    src = _random_pool(spec, num_pages=5, gen=gen)
    dst = _random_pool(spec, num_pages=7, gen=gen)
    pages = torch.tensor([6, 3])
    buf = gather_pages_triton(src, torch.tensor([0, 4]), 2, 1, 3)
    want = dst.clone()
    scatter_pages_ref(buf, want, pages, 2, 1, 3)
    scatter_pages_triton(buf, dst, pages, 2, 1, 3)
    assert torch.equal(_bytes(dst), _bytes(want))
    assert torch.equal(_bytes(gather_pages_triton(dst, pages, 2, 1, 3)), _bytes(buf))


def test_empty_page_list_and_dispatchers():
    spec = KVCacheSpec(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float16, page_size=2)
    pool = _random_pool(spec, num_pages=3, gen=torch.Generator().manual_seed(2))
    none = torch.empty(0, dtype=torch.int64)
    assert gather_pages_triton(pool, none, 2, 0, 2).shape == (2, 2, 0, 1, 4)
    pages = torch.tensor([2, 0])
    buf = gather_pages(pool, pages, 2, 0, 2)
    assert torch.equal(_bytes(buf), _bytes(_naive_gather(pool, pages, 2, 0, 2)))
    other = spec.alloc_pool(4, "cpu")
    scatter_pages(buf, other, torch.tensor([3, 1]), 2, 0, 2)
    assert torch.equal(_bytes(other[:, :, 6:8]), _bytes(pool[:, :, 4:6]))


@pytest.mark.parametrize("gather,scatter", [(gather_pages_triton, scatter_pages_triton),
                                            (gather_pages_ref, scatter_pages_ref)])
def test_page_copy_rejects_bad_arguments(gather, scatter):
    spec = KVCacheSpec(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float16, page_size=2)
    pool = spec.alloc_pool(3, "cpu")
    pages = torch.tensor([0, 2])
    buf = gather_pages_ref(pool, pages, 2, 0, 2)
    with pytest.raises(ValueError, match="pages holds 3"):
        gather(pool, torch.tensor([0, 3]), 2, 0, 2)
    with pytest.raises(ValueError, match="pages holds -1"):
        scatter(buf, pool, torch.tensor([-1, 0]), 2, 0, 2)
    with pytest.raises(ValueError, match="page twice"):
        scatter(buf, pool, torch.tensor([1, 1]), 2, 0, 2)
    with pytest.raises(ValueError, match="layer range"):
        gather(pool, pages, 2, 1, 3)
    with pytest.raises(ValueError, match="pages must be a 1-D int32/int64"):
        gather(pool, pages.float(), 2, 0, 2)
    with pytest.raises(ValueError, match="not a multiple of page_size 4"):
        gather(pool, pages, 4, 0, 2)
    with pytest.raises(ValueError, match="out has shape"):
        gather(pool, pages, 2, 0, 2, torch.empty(1, 2, 4, 1, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="buf.dtype"):
        scatter(buf.float(), pool, pages, 2, 0, 2)
    with pytest.raises(ValueError, match="pool must be"):
        gather(pool[0], pages, 2, 0, 1)
    with pytest.raises(ValueError, match="pages is on meta"):
        gather(pool, pages.to("meta"), 2, 0, 2)


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gather_scatter_gpu_bf16_round_trip(page_size):
    gen = torch.Generator(device="cuda").manual_seed(page_size)
    spec = KVCacheSpec(num_layers=8, kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                       page_size=page_size)
    num_pages = 4096 // page_size
    pool = spec.alloc_pool(num_pages, "cuda").normal_(generator=gen)
    pages = torch.randperm(num_pages, device="cuda", generator=gen)[: num_pages // 2]
    buf = gather_pages_triton(pool, pages, page_size, 2, 7)
    assert torch.equal(_bytes(buf), _bytes(gather_pages_ref(pool, pages, page_size, 2, 7)))
    dst = spec.alloc_pool(num_pages + 5, "cuda")
    want = dst.clone()
    dst_pages = torch.randperm(num_pages + 5, device="cuda", generator=gen)[: pages.numel()]
    scatter_pages_triton(buf, dst, dst_pages, page_size, 2, 7)
    scatter_pages_ref(buf, want, dst_pages, page_size, 2, 7)
    assert torch.equal(_bytes(dst), _bytes(want))
