"""store_index_k / read_index_k: Triton (interpreted on CPU) against torch's fp8 cast."""

import pytest
import torch
from lanekv.kernels.dsa.index_cache import (
    IndexCacheSpec,
    quantize_index_k_ref,
    read_index_k,
    read_index_k_ref,
    read_index_k_triton,
    store_index_k,
    store_index_k_ref,
    store_index_k_triton,
)

from tests.markers import requires_gpu

SENTINEL = 0xA5


def _keys(rows, dim, dtype, gen, spread=True):
    k = torch.randn(rows, dim, generator=gen)
    if spread:  # blocks of very different magnitude, exact zeros, subnormal e4m3 targets
        k = k * torch.logspace(-6, 3, rows)[:, None]
        k[0, : dim // 2] = 0.0
    return k.to(dtype)


def test_row_bytes_follow_the_design():
    assert IndexCacheSpec(head_dim=128).row_bytes == 132
    assert IndexCacheSpec(head_dim=256, block=128).row_bytes == 264
    assert IndexCacheSpec(head_dim=128, cache_dtype="model").row_bytes == 256
    assert IndexCacheSpec(head_dim=64, cache_dtype="model", model_dtype=torch.float32,
                          block=64).row_bytes == 256


@pytest.mark.parametrize("bad,match", [
    (dict(head_dim=0), "head_dim must be a positive int, got 0"),
    (dict(head_dim=128, cache_dtype="fp8"), "cache_dtype must be one of"),
    (dict(head_dim=96, block=128), "block must be a positive int dividing head_dim 96"),
    (dict(head_dim=16, model_dtype=torch.int8, block=16), "model_dtype must be one of"),
])
def test_spec_refuses_bad_fields(bad, match):
    with pytest.raises(ValueError, match=match):
        IndexCacheSpec(**bad)


def test_ref_quantization_matches_the_scale_convention():
    gen = torch.Generator().manual_seed(0)
    k = _keys(5, 32, torch.float32, gen)
    spec = IndexCacheSpec(head_dim=32, block=16)
    rows = quantize_index_k_ref(k, spec)
    scale = rows[:, 32:].contiguous().view(torch.float32)
    amax = k.view(5, 2, 16).abs().amax(-1).clamp_min(1e-4)
    assert torch.equal(scale, amax / 448.0)
    back = read_index_k_ref(spec.alloc_pool(5).copy_(rows), torch.arange(5), spec)
    # e4m3 keeps 3 mantissa bits: within half an ulp (1/16 relative) of each block's values.
    err = (back - k).abs().view(5, 2, 16)
    assert (err <= amax[..., None] / 16 + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("dim,block", [(32, 16), (128, 128)])
def test_fp8_store_is_bit_exact_with_torch(dtype, dim, block):
    gen = torch.Generator().manual_seed(dim + block)
    spec = IndexCacheSpec(head_dim=dim, model_dtype=dtype, block=block)
    k = _keys(19, dim, dtype, gen)
    pool = spec.alloc_pool(40).fill_(SENTINEL)
    want = pool.clone()
    locs = torch.randperm(40, generator=gen)[:19]
    locs[::5] = -1
    store_index_k_triton(k, pool, locs, spec)
    store_index_k_ref(k, want, locs, spec)
    assert torch.equal(pool, want)
    assert (pool[locs[locs >= 0]] != SENTINEL).any()
    rows = torch.randperm(40, generator=gen)[:25]
    assert torch.equal(read_index_k_triton(pool, rows, spec), read_index_k_ref(pool, rows, spec))


def test_fp8_encoder_covers_every_byte_and_its_ties():
    # Every finite e4m3 value and every midpoint between neighbours, one block per value.
    allv = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    allv = allv[allv.isfinite()].unique()
    mids = (allv[1:] + allv[:-1]) / 2
    vals = torch.cat([allv, mids, mids.nextafter(torch.tensor(1e9)),
                      mids.nextafter(torch.tensor(-1e9))])
    # With 448 in each block the scale is exactly 1, so x / scale is x.
    k = torch.stack([vals, torch.full_like(vals, 448.0)], dim=1).repeat(1, 8)  # [N, 16]
    spec = IndexCacheSpec(head_dim=16, model_dtype=torch.float32, block=16)
    pool, want = spec.alloc_pool(len(vals)), spec.alloc_pool(len(vals))
    locs = torch.arange(len(vals))
    store_index_k_triton(k, pool, locs, spec)
    store_index_k_ref(k, want, locs, spec)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_model_dtype_rows_are_the_key_bytes(dtype):
    gen = torch.Generator().manual_seed(1)
    spec = IndexCacheSpec(head_dim=16, cache_dtype="model", model_dtype=dtype, block=16)
    k = _keys(7, 16, dtype, gen, spread=False)
    pool = spec.alloc_pool(9).fill_(SENTINEL)
    locs = torch.tensor([8, 0, -1, 3, 4, 2, 6])
    store_index_k_triton(k, pool, locs, spec)
    got = read_index_k_triton(pool, locs.clamp_min(0), spec)
    keep = locs >= 0
    assert torch.equal(got[keep], k[keep])
    assert (pool[[1, 5, 7]] == SENTINEL).all()


def test_dispatchers_match_reference_on_cpu():
    gen = torch.Generator().manual_seed(2)
    spec = IndexCacheSpec(head_dim=32, model_dtype=torch.float32, block=16)
    k = _keys(4, 32, torch.float32, gen)
    pool, want = spec.alloc_pool(6), spec.alloc_pool(6)
    locs = torch.tensor([5, -1, 0, 2])
    store_index_k(k, pool, locs, spec)
    store_index_k_ref(k, want, locs, spec)
    assert torch.equal(pool, want)
    assert torch.equal(read_index_k(pool, locs.abs(), spec), read_index_k_ref(want, locs.abs(), spec))


@pytest.mark.parametrize("impl", [store_index_k_triton, store_index_k_ref])
def test_store_refuses_bad_arguments(impl):
    spec = IndexCacheSpec(head_dim=16, model_dtype=torch.float32, block=16)
    pool = spec.alloc_pool(8)
    k = torch.zeros(3, 16)
    locs = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="locs holds 8"):
        impl(k, pool, torch.tensor([0, 8, 1]), spec)
    with pytest.raises(ValueError, match="locs must be a 1-D int64"):
        impl(k, pool, locs.int(), spec)
    with pytest.raises(ValueError, match="locs has 2 entries"):
        impl(k, pool, locs[:2], spec)
    with pytest.raises(ValueError, match="k must be a 2-D tensor"):
        impl(torch.zeros(3, 8), pool, locs, spec)
    with pytest.raises(ValueError, match="k.dtype is torch.float16"):
        impl(k.half(), pool, locs, spec)
    with pytest.raises(ValueError, match="pool rows are 16 bytes"):
        impl(k, torch.zeros(8, 16, dtype=torch.uint8), locs, spec)
    with pytest.raises(ValueError, match="pool must be a 2-D uint8"):
        impl(k, pool.float(), locs, spec)
    with pytest.raises(ValueError, match="4-byte aligned"):
        impl(k, torch.zeros(8, 21, dtype=torch.uint8)[:, 1:], locs, spec)
    with pytest.raises(ValueError, match="rows holds -1"):
        read_index_k_triton(pool, torch.tensor([-1]), spec)


@requires_gpu
@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "model"])
def test_index_cache_gpu_bf16_matches_reference(cache_dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    spec = IndexCacheSpec(head_dim=128, cache_dtype=cache_dtype, model_dtype=torch.bfloat16)
    k = (torch.randn(3000, 128, device="cuda", generator=gen) * 3).bfloat16()
    pool = spec.alloc_pool(8192, "cuda").fill_(SENTINEL)
    want = pool.clone()
    locs = torch.randperm(8192, device="cuda", generator=gen)[:3000]
    locs[::7] = -1
    store_index_k_triton(k, pool, locs, spec)
    store_index_k_ref(k, want, locs, spec)
    assert torch.equal(pool, want)
    rows = torch.randperm(8192, device="cuda", generator=gen)[:2000]
    assert torch.equal(read_index_k_triton(pool, rows, spec), read_index_k_ref(want, rows, spec))
