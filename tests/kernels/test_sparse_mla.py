"""Sparse MLA prefill and decode: Triton (interpreted) vs torch vs dense attention in float64."""

import pytest
import torch
from lanekv.kernels.dsa.sparse_mla import (
    SparseDecodeConfig,
    choose_sparse_splits,
    sparse_decode_grid,
    sparse_mla_decode,
    sparse_mla_decode_ref,
    sparse_mla_decode_triton,
    sparse_mla_prefill,
    sparse_mla_prefill_ref,
    sparse_mla_prefill_triton,
)
from lanekv.kernels.fp8.kv_rows import pack_mla_fp8_rows_ref

from tests.markers import requires_gpu


def _dense_masked(q, latent, keep, scale, rank):
    """float64 attention over all rows with a [Tq, N] keep mask; rows with none give 0."""
    s = torch.einsum("thd,nd->thn", q.double(), latent.double()) * scale
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return torch.einsum("thn,nr->thr", p, latent[:, :rank].double())


def _selection(tq, n, k, gen):
    idx = torch.stack([torch.randperm(n, generator=gen)[:k] for _ in range(tq)]).int()
    idx[1, k // 2:] = -1  # fewer selected than k
    idx[2] = -1  # nothing selected: zeros
    return idx


def _keep(idx, n):
    keep = torch.zeros(idx.shape[0], n, dtype=torch.bool)
    for i, row in enumerate(idx.tolist()):
        keep[i, [j for j in row if j >= 0]] = True
    return keep


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("heads,rank,rope,k", [(3, 32, 16, 9), (16, 24, 0, 40)])
@pytest.mark.parametrize("impl", [sparse_mla_prefill_triton, sparse_mla_prefill_ref])
def test_sparse_prefill_matches_masked_dense(dtype, tol, heads, rank, rope, k, impl):
    gen = torch.Generator().manual_seed(heads + rank)
    tq, n = 5, 50
    q = torch.randn(tq, heads, rank + rope, generator=gen).to(dtype)
    latent = torch.randn(n + 3, rank + rope, generator=gen).to(dtype)[3:]  # offset view
    idx = _selection(tq, n, k, gen)
    out = torch.full((tq, heads, rank), float("nan"), dtype=dtype)
    impl(q, latent, idx, 0.3, rank, out=out)
    want = _dense_masked(q, latent, _keep(idx, n), 0.3, rank)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert (out[2] == 0).all()


def test_sparse_prefill_dispatcher_is_the_reference_on_cpu():
    gen = torch.Generator().manual_seed(1)
    q, latent = torch.randn(4, 2, 20, generator=gen), torch.randn(11, 20, generator=gen)
    idx = _selection(4, 11, 6, gen)
    assert torch.equal(sparse_mla_prefill(q, latent, idx, 0.5, 16),
                       sparse_mla_prefill_ref(q, latent, idx, 0.5, 16))


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("impl", [sparse_mla_decode_triton, sparse_mla_decode_ref])
def test_sparse_decode_reads_selected_positions_through_the_page_table(page_size, impl):
    gen = torch.Generator().manual_seed(page_size)
    batch, heads, rank, rope, pages, width, k = 4, 4, 32, 16, 14, 3, 10
    rows = pages * page_size
    # Unused rows are NaN: a read of anything not selected would show.
    cache = torch.full((rows, rank + rope), float("nan"))
    # Requests own disjoint pages, in scrambled order.
    table = torch.randperm(pages, generator=gen)[:batch * width].view(batch, width).int()
    positions = width * page_size
    idx = _selection(batch, positions, min(k, positions), gen)
    dense = torch.empty(batch, positions, rank + rope)
    for b in range(batch):
        t = torch.arange(positions)
        r = table[b, t // page_size].long() * page_size + t % page_size
        dense[b] = torch.randn(positions, rank + rope, generator=gen)
        sel = idx[b][idx[b] >= 0].long()
        cache[r[sel]] = dense[b, sel]
    q = torch.randn(batch, heads, rank + rope, generator=gen)
    out = impl(q, cache, table, idx, page_size, 0.2, rank)
    for b in range(batch):
        keep = _keep(idx[b:b + 1], positions)
        want = _dense_masked(q[b:b + 1], torch.nan_to_num(dense[b]), keep, 0.2, rank)
        torch.testing.assert_close(out[b:b + 1].double(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(sparse_mla_decode(q, cache, table, idx, page_size, 0.2, rank).isnan(),
                       out.isnan())


@pytest.mark.parametrize("splits,topk,heads", [(2, 37, 3), (3, 70, 16), (5, 41, 20), (64, 9, 3)])
def test_split_decode_matches_reference(splits, topk, heads):
    """The selected slots cut into splits (partials merged): odd counts, a query with
    fewer slots than splits, one with none, and more splits than blocks (empty splits)."""
    gen = torch.Generator().manual_seed(splits + topk)
    page_size, rank, rope, batch, width = 4, 24, 8, 4, 30
    positions = width * page_size
    pages = batch * width
    cache = torch.randn(pages * page_size, rank + rope, generator=gen)
    table = torch.randperm(pages, generator=gen).view(batch, width).int()
    idx = _selection(batch, positions, topk, gen)
    idx[3, 2:] = -1  # two slots: most splits of this query are empty
    q = torch.randn(batch, heads, rank + rope, generator=gen)
    want = sparse_mla_decode_ref(q, cache, table, idx, page_size, 0.3, rank, num_splits=splits)
    got = sparse_mla_decode_triton(q, cache, table, idx, page_size, 0.3, rank, num_splits=splits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert (got[2] == 0).all()
    with pytest.raises(ValueError, match="num_splits must be None or a positive int"):
        sparse_mla_decode_triton(q, cache, table, idx, page_size, 0.3, rank, num_splits=0)


def test_split_count_fills_the_device():
    cfg = SparseDecodeConfig()
    # V3.2 at batch 1: 2 head blocks; top 2048 in runs of at least 32 slots (one block).
    assert choose_sparse_splits(2, 2048, 132, cfg) == 64
    assert choose_sparse_splits(32, 2048, 132, cfg) == 5  # batch 16
    assert choose_sparse_splits(128, 2048, 132, cfg) == 2
    assert choose_sparse_splits(256, 2048, 132, cfg) == 1
    assert choose_sparse_splits(2, 100, 132, cfg) == 4
    # one block a split, two programs an SM: 32-head blocks at batch 1 give 64 splits
    small = SparseDecodeConfig(block_h=32, min_split_rows=32, programs_per_sm=2)
    assert sparse_decode_grid(1, 128, 2048, 132, small) == (32, 4, 64)
    # the grid is the shapes' alone, and a head block never outgrows the heads
    assert sparse_decode_grid(3, 20, 9, 132, cfg) == (32, 1, 1)
    assert sparse_decode_grid(1, 128, 2048, 132, cfg, num_splits=7).num_splits == 7


def _fp8_rows(rows, rank, rope, gen):
    """FP8 latent rows of values over four decades (the groups' scales differ)."""
    x = torch.randn(rows, rank + rope, generator=gen) * torch.logspace(-2, 2, rank + rope)[
        torch.randperm(rank + rope, generator=gen)]
    return pack_mla_fp8_rows_ref(x, rank)


@pytest.mark.parametrize("rows_kind,dtype,rank,rope,heads,topk", [
    ("plain", torch.float32, 24, 8, 3, 53),
    ("plain", torch.float16, 32, 16, 20, 70),
    ("fp8", torch.float32, 48, 16, 3, 41),  # 3 groups of 16, rank not a power of two
    ("fp8", torch.float32, 256, 16, 2, 70),  # 2 groups of 128: scales once per row and group
    ("fp8", torch.float16, 32, 8, 5, 37),  # 1 group
])
def test_auto_splits_match_reference(rows_kind, dtype, rank, rope, heads, topk):
    """The split count the config picks (many one-block splits, more than a request's
    blocks: splits without rows), -1 padding, a request with no row, odd sizes."""
    gen = torch.Generator().manual_seed(rank + topk)
    page_size, batch, width = 4, 3, 25
    positions, pages = width * page_size, batch * width
    if rows_kind == "fp8":
        cache = _fp8_rows(pages * page_size, rank, rope, gen)
    else:  # rows 6 values apart from the next: a stride of no power of two past 2
        cache = torch.randn(pages * page_size, rank + rope + 6, generator=gen).to(dtype)
        cache = cache[:, : rank + rope]
    table = torch.randperm(pages, generator=gen).view(batch, width).int()
    idx = _selection(batch, positions, topk, gen)  # request 1 half padded, request 2 none
    q = (torch.randn(batch, heads, rank + rope, generator=gen) * 0.1).to(dtype)
    cfg = SparseDecodeConfig(block_h=16, block_n=16, min_split_rows=16, programs_per_sm=16)
    splits = sparse_decode_grid(batch, heads, topk, 1, cfg).num_splits
    assert splits == min(-(-16 // (batch * -(-heads // 16))), -(-topk // 16)) and splits > 1
    want = sparse_mla_decode_ref(q, cache, table, idx, page_size, 0.3, rank)
    got = sparse_mla_decode_triton(q, cache, table, idx, page_size, 0.3, rank, config=cfg,
                                   out=torch.full_like(want, float("nan")))
    # FP8 rows' values reach ~100; float32 sums in another order differ by ~1e-6 of that
    tol = 3e-3 if dtype == torch.float16 else 1e-4 if rows_kind == "fp8" else 2e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert (got[2] == 0).all()


def test_arguments_are_refused_by_name():
    q, latent = torch.zeros(3, 2, 20), torch.zeros(8, 20)
    idx = torch.zeros(3, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices holds 8, outside"):
        sparse_mla_prefill_triton(q, latent, idx + 8, 1.0, 16)
    with pytest.raises(ValueError, match="indices holds -2"):
        sparse_mla_prefill_ref(q, latent, idx - 2, 1.0, 16)
    with pytest.raises(ValueError, match="indices must be a 2-D int32"):
        sparse_mla_prefill_triton(q, latent, idx.long(), 1.0, 16)
    with pytest.raises(ValueError, match="latent rows have 16 values"):
        sparse_mla_prefill_triton(q, latent[:, :16], idx, 1.0, 16)
    with pytest.raises(ValueError, match="kv_lora_rank must be an int"):
        sparse_mla_prefill_ref(q, latent, idx, 1.0, 21)
    with pytest.raises(ValueError, match="latent.dtype is torch.float16"):
        sparse_mla_prefill_triton(q, latent.half(), idx, 1.0, 16)
    with pytest.raises(ValueError, match="out is"):
        sparse_mla_prefill_triton(q, latent, idx, 1.0, 16, out=torch.zeros(3, 2, 20))
    table = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices holds 8, outside \\[-1, 8\\)"):
        sparse_mla_decode_triton(q, latent, table, idx + 8, 4, 1.0, 16)
    with pytest.raises(ValueError, match="page_table holds 2"):
        sparse_mla_decode_ref(q, latent, table + 2, idx, 4, 1.0, 16)
    with pytest.raises(ValueError, match="page_size must be a positive int dividing"):
        sparse_mla_decode_triton(q, latent, table, idx, 3, 1.0, 16)
    with pytest.raises(ValueError, match="page_table must be a 2-D int32"):
        sparse_mla_decode_ref(q, latent, table[:2], idx, 4, 1.0, 16)


@requires_gpu
def test_sparse_mla_gpu_bf16_matches_reference():
    gen = torch.Generator(device="cuda").manual_seed(0)
    heads, rank, rope, topk, n = 128, 512, 64, 2048, 8192
    q = torch.randn(4, heads, rank + rope, device="cuda", generator=gen).bfloat16()
    latent = torch.randn(n, rank + rope, device="cuda", generator=gen).bfloat16()
    idx = torch.stack([torch.randperm(n, device="cuda", generator=gen)[:topk]
                       for _ in range(4)]).int()
    idx[1, 100:] = -1
    want = sparse_mla_prefill_ref(q, latent, idx, 0.07, rank)
    got = sparse_mla_prefill_triton(q, latent, idx, 0.07, rank)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    table = torch.arange(n // 64, device="cuda", dtype=torch.int32).flip(0)[None].repeat(4, 1)
    want = sparse_mla_decode_ref(q, latent, table, idx, 64, 0.07, rank)
    got = sparse_mla_decode_triton(q, latent, table, idx, 64, 0.07, rank)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    for splits in (1, 7, 16, 64):  # batch 1: the split path the decode step takes
        got = sparse_mla_decode_triton(q[:1], latent, table[:1], idx[:1], 64, 0.07, rank,
                                       num_splits=splits)
        torch.testing.assert_close(got.float(), want[:1].float(), atol=2e-2, rtol=2e-2)
