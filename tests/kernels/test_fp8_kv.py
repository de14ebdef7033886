"""FP8 KV rows: the packing kernels equal their references bit for bit (interpreted here,
compiled in the gpu tests), and the decode kernels reading FP8 rows (GQA, absorbed MLA,
sparse MLA) equal their references, which dequantize, within float32 summation order."""

import pytest
import torch
from lanekv.kernels.decode_attention import (
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode_ref, sparse_mla_decode_triton
from lanekv.kernels.fp8.kv_rows import (
    dequantize_kv_fp8_rows,
    kv_fp8_head_bytes,
    mla_fp8_row_bytes,
    pack_kv_fp8_rows_ref,
    pack_kv_fp8_rows_triton,
    pack_mla_fp8_rows_ref,
    pack_mla_fp8_rows_triton,
    unpack_mla_fp8_rows,
)
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention_triton
from lanekv.kernels.mla.paged_decode_ref import paged_mla_decode_attention_ref

from tests.markers import requires_gpu


def _wide(shape, seed, dtype=torch.float32, device="cpu"):
    """Values over four decades along the last dim: scales differ, e4m3 subnormals occur."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-2, 2, shape[-1])[
        torch.randperm(shape[-1], generator=gen)]
    if x.numel():
        x.view(-1, shape[-1])[0] = 0.0  # an all-zero head / row
    return x.to(dtype).to(device)


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 16), (5, 3, 12), (7, 2, 128), (0, 2, 8),
                                                    (9, 5, 20)])
def test_pack_kv_fp8_rows_is_bit_exact(tokens, heads, head_dim):
    x = _wide((tokens, heads, head_dim), tokens + heads + head_dim)
    got = pack_kv_fp8_rows_triton(x)
    assert got.shape == (tokens, heads, kv_fp8_head_bytes(head_dim)) and got.dtype == torch.uint8
    assert torch.equal(got, pack_kv_fp8_rows_ref(x))


def test_pack_kv_fp8_rows_reads_a_strided_input():
    x = _wide((6, 4, 32), 1)[:, 1:3]  # heads 1 and 2 of each token: strided
    assert torch.equal(pack_kv_fp8_rows_triton(x), pack_kv_fp8_rows_ref(x.contiguous()))


def test_kv_fp8_rows_round_trip_within_e4m3_precision():
    x = _wide((5, 3, 16), 2)
    back = dequantize_kv_fp8_rows(pack_kv_fp8_rows_ref(x), 16, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative, and subnormals step by
    # amax / 448 * 2^-9
    err = (back - x).abs()
    assert bool((err <= x.abs() / 16 + amax / 448 * 2.0 ** -9 + 1e-12).all())


def test_pack_kv_fp8_rows_refuses_a_head_dim_not_a_multiple_of_4():
    with pytest.raises(ValueError, match="head_dim a positive multiple of 4, got 6"):
        pack_kv_fp8_rows_ref(torch.zeros(2, 1, 6))


@pytest.mark.parametrize("tokens,rank,rope", [(3, 32, 8), (5, 48, 16), (2, 128, 64), (1, 512, 64)])
def test_pack_mla_fp8_rows_odd_ranks_are_bit_exact(tokens, rank, rope):
    latent = _wide((tokens, rank + rope), rank + rope)
    got = pack_mla_fp8_rows_triton(latent, rank)
    assert got.shape == (tokens, mla_fp8_row_bytes(rank, rope))
    assert torch.equal(got, pack_mla_fp8_rows_ref(latent, rank))


def test_mla_fp8_row_is_656_bytes_for_deepseek():
    assert mla_fp8_row_bytes(512, 64) == 656


def _paged(tokens_per_req, page_size, seed, width_pages):
    """A page table over a shuffled pool and each request's positions' rows."""
    gen = torch.Generator().manual_seed(seed)
    pages_needed = [-(-n // page_size) for n in tokens_per_req]
    num_pages = sum(pages_needed) + 3
    order = torch.randperm(num_pages, generator=gen)
    table = torch.zeros((len(tokens_per_req), width_pages), dtype=torch.int32)
    at = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[at:at + n].to(torch.int32)
        at += n
    return table, num_pages, torch.tensor(tokens_per_req, dtype=torch.int32)


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,page_size,splits", [
    ([5, 17], 4, 2, 16, 4, 1), ([33], 6, 3, 12, 8, 3), ([1, 0, 9], 2, 1, 32, 4, 2)])
def test_paged_decode_attention_reads_fp8_rows(lens, heads, kv_heads, head_dim, page_size, splits):
    table, num_pages, seq_lens = _paged(lens, page_size, 3, 5)
    rows = num_pages * page_size
    k = pack_kv_fp8_rows_ref(_wide((rows, kv_heads, head_dim), 4))
    v = pack_kv_fp8_rows_ref(_wide((rows, kv_heads, head_dim), 5))
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(6))
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention_triton(q, k, v, table, seq_lens, page_size, 0.3, out=out,
                                        num_splits=splits)
    want = paged_decode_attention_ref(q, k, v, table, seq_lens, page_size, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # values up to ~100
    # the reference is plain attention over the dequantized rows
    plain = paged_decode_attention_ref(q, dequantize_kv_fp8_rows(k, head_dim, q.dtype),
                                       dequantize_kv_fp8_rows(v, head_dim, q.dtype), table,
                                       seq_lens, page_size, 0.3)
    torch.testing.assert_close(want, plain, rtol=0, atol=0)


def test_paged_decode_attention_refuses_fp8_rows_of_the_wrong_width():
    table, _, lens = _paged([4], 4, 1, 1)
    k = torch.zeros((4, 1, 16), dtype=torch.uint8)  # 16 bytes: a head of 12, not of 16
    with pytest.raises(ValueError, match="needs 20"):
        paged_decode_attention_ref(torch.zeros(1, 2, 16), k, k, table, lens, 4, 1.0)


def _mla_cache(rows, rank, rope, seed, pad=0):
    """FP8 latent rows ``[rows, row_bytes + pad]`` (``pad``: a DSA row's index-K bytes)."""
    packed = pack_mla_fp8_rows_ref(_wide((rows, rank + rope), seed), rank)
    return torch.cat((packed, torch.full((rows, pad), 0xFF, dtype=torch.uint8)), dim=1)


@pytest.mark.parametrize("lens,heads,rank,rope,page_size,splits,pad", [
    ([6, 11], 4, 32, 8, 4, 1, 0), ([19], 3, 48, 16, 8, 2, 12), ([0, 3], 2, 32, 8, 4, 1, 0),
    ([21], 2, 256, 16, 8, 3, 16)])  # 256: two groups, scales loaded once per row and group
def test_paged_mla_decode_reads_fp8_rows(lens, heads, rank, rope, page_size, splits, pad):
    table, num_pages, seq_lens = _paged(lens, page_size, 7, 4)
    cache = _mla_cache(num_pages * page_size, rank, rope, 8, pad)
    q = torch.randn(len(lens), heads, rank + rope, generator=torch.Generator().manual_seed(9))
    got = paged_mla_decode_attention_triton(q, cache, table, seq_lens, page_size, 0.2, rank,
                                            num_splits=splits)
    want = paged_mla_decode_attention_ref(q, cache, table, seq_lens, page_size, 0.2, rank)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # values up to ~100
    plain = unpack_mla_fp8_rows(cache[:, : mla_fp8_row_bytes(rank, rope)], rank, rope, q.dtype)
    torch.testing.assert_close(
        want, paged_mla_decode_attention_ref(q, plain, table, seq_lens, page_size, 0.2, rank),
        rtol=0, atol=0)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("heads,rank,rope,topk,pad", [(4, 32, 8, 5, 16), (2, 48, 16, 40, 0)])
def test_sparse_mla_decode_reads_fp8_rows(heads, rank, rope, topk, pad, splits):
    """Whole, and with the selected slots split over programs (partials merged)."""
    lens, page_size = [9, 44], 4
    table, num_pages, _ = _paged(lens, page_size, 10, 12)
    cache = _mla_cache(num_pages * page_size, rank, rope, 11, pad)
    gen = torch.Generator().manual_seed(12)
    indices = torch.full((len(lens), topk), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        picked = torch.randperm(n, generator=gen)[:topk]
        indices[b, : len(picked)] = picked.to(torch.int32)
    indices[0, 0] = -1
    q = torch.randn(len(lens), heads, rank + rope, generator=gen)
    got = sparse_mla_decode_triton(q, cache, table, indices, page_size, 0.25, rank, num_splits=splits)
    want = sparse_mla_decode_ref(q, cache, table, indices, page_size, 0.25, rank)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # values up to ~100


# ---- on the GPU: compiled kernels, bf16 model dtype ----

@requires_gpu
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 8, 128), (37, 8, 128), (1000, 4, 64),
                                                    (5, 3, 20)])
def test_gpu_pack_kv_fp8_rows_is_bit_exact(tokens, heads, head_dim):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _wide((tokens, heads, head_dim), tokens, dtype, "cuda")
        assert torch.equal(pack_kv_fp8_rows_triton(x), pack_kv_fp8_rows_ref(x))


@requires_gpu
@pytest.mark.parametrize("tokens,rank,rope", [(1, 512, 64), (333, 512, 64), (7, 48, 16)])
def test_gpu_pack_mla_fp8_rows_odd_sizes_are_bit_exact(tokens, rank, rope):
    for dtype in (torch.bfloat16, torch.float32):
        latent = _wide((tokens, rank + rope), tokens, dtype, "cuda")
        assert torch.equal(pack_mla_fp8_rows_triton(latent, rank), pack_mla_fp8_rows_ref(latent, rank))


@requires_gpu
@pytest.mark.parametrize("lens", [[1, 700, 4096], [33]])
def test_gpu_decode_kernels_read_fp8_rows(lens):
    page_size, dev = 16, "cuda"
    table, num_pages, seq_lens = _paged(lens, page_size, 13, 256)
    table, seq_lens = table.to(dev), seq_lens.to(dev)
    rows = num_pages * page_size
    k = pack_kv_fp8_rows_ref(_wide((rows, 8, 128), 14, torch.bfloat16, dev))
    v = pack_kv_fp8_rows_ref(_wide((rows, 8, 128), 15, torch.bfloat16, dev))
    q = torch.randn(len(lens), 32, 128, device=dev, dtype=torch.bfloat16)
    got = paged_decode_attention_triton(q, k, v, table, seq_lens, page_size, 0.088)
    want = paged_decode_attention_ref(q, k, v, table, seq_lens, page_size, 0.088)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    cache = pack_mla_fp8_rows_ref(_wide((rows, 576), 16, torch.bfloat16, dev), 512)
    qm = torch.randn(len(lens), 16, 576, device=dev, dtype=torch.bfloat16) * 0.1
    got = paged_mla_decode_attention_triton(qm, cache, table, seq_lens, page_size, 0.07, 512)
    want = paged_mla_decode_attention_ref(qm, cache, table, seq_lens, page_size, 0.07, 512)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    idx = torch.stack([torch.randperm(max(n, 1), device=dev)[:1] for n in lens]).to(torch.int32)
    got = sparse_mla_decode_triton(qm, cache, table, idx, page_size, 0.07, 512)
    want = sparse_mla_decode_ref(qm, cache, table, idx, page_size, 0.07, 512)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
