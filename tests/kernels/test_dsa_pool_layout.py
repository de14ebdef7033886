"""The DSA pool row (latent, then the index-K bytes) and the kernels on its views:
the fused fp8 store into a strided index view equals torch's quantization bit
for bit (Triton interpreted), the paged scores read it in place, and a page's
digest and a wire chunk's checksum see one flipped index byte."""

import pytest
import torch
from lanekv.kernels.dsa.index_cache import (
    IndexCacheSpec,
    quantize_index_k_ref,
    store_index_k_ref,
    store_index_k_triton,
)
from lanekv.kernels.dsa.indexer import (
    index_scores_ref,
    paged_index_scores_ref,
    paged_index_scores_triton,
)
from lanekv.kernels.dsa.pool_layout import DSARowLayout, dsa_row_elements
from lanekv.kernels.dsa.select import decode_select
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode_ref, sparse_mla_decode_triton
from lanekv.kernels.kv_layout import KVCacheSpec
from lanekv.kernels.page_copy import gather_pages
from lanekv.kernels.page_digest import page_digest
from lanekv.transfer.protocol.agreement import dsa_row_elements as contract_row_elements
from lanekv.transfer.protocol.wire import encode_chunk

from tests.markers import requires_gpu

LATENT, DIM, PAGE = 20, 32, 4


def _pool(cache_dtype, dtype=torch.float32, pages=6, layers=2):
    lay = DSARowLayout(LATENT, IndexCacheSpec(DIM, cache_dtype, dtype, block=16))
    spec = KVCacheSpec(num_layers=layers, kv_heads=1, head_dim=lay.head_dim, dtype=dtype,
                       page_size=PAGE, kv=1)
    return lay, spec.alloc_pool(pages, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_bytes", [36, 64, 132])
def test_the_row_layout_matches_the_contract_rule(dtype, index_bytes):
    for latent in (20, 21, 576):
        elements = dsa_row_elements(latent, dtype.itemsize, index_bytes)
        assert elements == contract_row_elements(latent, dtype.itemsize, index_bytes)
        assert (elements * dtype.itemsize) % 16 == 0
        assert elements * dtype.itemsize >= -(-latent * dtype.itemsize // 4) * 4 + index_bytes
    v32 = DSARowLayout(576, IndexCacheSpec(128, "fp8_e4m3", torch.bfloat16))
    assert (v32.index_offset, v32.index.row_bytes, v32.head_dim) == (1152, 132, 648)


def test_views_alias_the_pool_row():
    lay, pool = _pool("model")
    plane = pool[1, 0, :, 0]
    lay.latent(plane)[3] = 7.0
    lay.index_rows(plane)[3] = 255
    assert (pool[1, 0, 3, 0, :LATENT] == 7.0).all()
    raw = pool[1, 0, 3, 0].view(torch.uint8)
    assert (raw[lay.index_offset : lay.index_offset + lay.index.row_bytes] == 255).all()
    assert (raw[: lay.index_offset].view(torch.float32)[:LATENT] == 7.0).all()
    with pytest.raises(ValueError, match="plane must be"):
        lay.latent(pool[1, 0, :, 0, :LATENT])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_fp8_store_into_the_strided_view_is_torch_bit_for_bit(dtype):
    lay, pool = _pool("fp8_e4m3", dtype)
    want = pool.clone()
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(9, DIM, generator=gen) * 3).to(dtype)
    locs = torch.tensor([0, 5, -1, 23, 7, 8, 9, -1, 2])
    store_index_k_triton(k, lay.index_rows(pool[0, 0, :, 0]), locs, lay.index)
    store_index_k_ref(k, lay.index_rows(want[0, 0, :, 0]), locs, lay.index)
    assert torch.equal(pool.view(torch.uint8), want.view(torch.uint8))
    rows = lay.index_rows(pool[0, 0, :, 0])
    assert torch.equal(rows[locs[locs >= 0]], quantize_index_k_ref(k[locs >= 0], lay.index))
    assert pool[0, 0, :, 0, :LATENT].eq(0).all()  # the latent part untouched


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "model"])
def test_paged_scores_and_selection_read_the_view_in_place(cache_dtype):
    lay, pool = _pool(cache_dtype, pages=8)
    index = lay.index_rows(pool[1, 0, :, 0])
    gen = torch.Generator().manual_seed(5)
    store_index_k_ref(torch.randn(index.shape[0], DIM, generator=gen), index,
                      torch.arange(index.shape[0]), lay.index)
    table = torch.tensor([[3, 0, 6, 1], [7, 2, 5, 4]], dtype=torch.int32)
    lens = torch.tensor([13, 6], dtype=torch.int32)
    q, w = torch.randn(2, 3, DIM, generator=gen), torch.randn(2, 3, generator=gen)
    ref = paged_index_scores_ref(q, w, index, table, lens, PAGE, 0.2, lay.index)
    got = paged_index_scores_triton(q, w, index, table, lens, PAGE, 0.2, lay.index)
    fin = ref.isfinite()
    assert torch.equal(got.isfinite(), fin)
    torch.testing.assert_close(got[fin], ref[fin], atol=1e-4, rtol=1e-4)
    chosen = decode_select(q, w, index, table, lens, PAGE, 0.2, 4, lay.index)
    for b, n in enumerate(lens.tolist()):  # the best 4 of exactly n keys, by the reference
        t = torch.arange(n)
        keys_scores = index_scores_ref(q[b : b + 1], _keys(index, table[b], t, lay),
                                       w[b : b + 1], torch.tensor([n - 1]), 0.2)
        assert torch.equal(chosen[b], keys_scores.topk(4).indices[0].int())
        assert set(chosen[b].tolist()) == set(ref[b].topk(4).indices.tolist())


def _keys(index, table_row, t, lay):
    from lanekv.kernels.dsa.index_cache import read_index_k_ref

    rows = table_row[t // PAGE].long() * PAGE + t % PAGE
    return read_index_k_ref(index, rows, lay.index).float()


def test_digest_and_wire_checksum_see_one_index_byte():
    lay, pool = _pool("fp8_e4m3", pages=4)
    gen = torch.Generator().manual_seed(1)
    pool.copy_(torch.randn(pool.shape, generator=gen))
    pages = torch.tensor([2, 0])
    digest = page_digest(pool, pages, PAGE, 0, 2)
    payload = gather_pages(pool, pages, PAGE, 0, 2)
    header, _ = encode_chunk("r", 0, 0, 0, [2, 0], payload)
    lay.index_rows(pool[1, 0, :, 0])[PAGE * 2 + 1, 5] ^= 0x08  # one index byte of page 2
    assert page_digest(pool, pages, PAGE, 0, 2) != digest
    damaged, _ = encode_chunk("r", 0, 0, 0, [2, 0], gather_pages(pool, pages, PAGE, 0, 2))
    assert damaged.checksum != header.checksum


@requires_gpu
def test_v32_rows_on_gpu_store_score_and_attend_in_place():
    """V3.2's bf16 rows (latent 576, fp8 index keys, 1296 bytes): the kernels on the
    two views of a pool plane equal their references."""
    lay = DSARowLayout(576, IndexCacheSpec(128, "fp8_e4m3", torch.bfloat16))
    gen = torch.Generator(device="cuda").manual_seed(0)
    plane = torch.randn(64 * 64, lay.head_dim, device="cuda", generator=gen).bfloat16()
    want = plane.clone()
    keys = (torch.randn(plane.shape[0], 128, device="cuda", generator=gen) * 2).bfloat16()
    every = torch.arange(plane.shape[0], device="cuda")
    store_index_k_triton(keys, lay.index_rows(plane), every, lay.index)
    store_index_k_ref(keys, lay.index_rows(want), every, lay.index)
    assert torch.equal(plane.view(torch.uint8), want.view(torch.uint8))
    table = torch.randperm(64, device="cuda", generator=gen)[:48].int().view(4, 12)
    lens = torch.tensor([768, 1, 100, 513], dtype=torch.int32, device="cuda")
    q = torch.randn(4, 64, 128, device="cuda", generator=gen).bfloat16()
    w = torch.randn(4, 64, device="cuda", generator=gen)
    index = lay.index_rows(plane)
    ref = paged_index_scores_ref(q, w, index, table, lens, 64, 0.1, lay.index)
    got = paged_index_scores_triton(q, w, index, table, lens, 64, 0.1, lay.index)
    assert torch.equal(got.isfinite(), ref.isfinite())
    torch.testing.assert_close(got[ref.isfinite()], ref[ref.isfinite()], atol=5e-2, rtol=2e-2)
    chosen = decode_select(q, w, index, table, lens, 64, 0.1, 256, lay.index)
    qa = torch.randn(4, 128, 576, device="cuda", generator=gen).bfloat16()
    out = sparse_mla_decode_triton(qa, lay.latent(plane), table, chosen, 64, 0.07, 512)
    torch.testing.assert_close(
        out.float(), sparse_mla_decode_ref(qa, lay.latent(plane), table, chosen, 64, 0.07,
                                           512).float(), atol=2e-2, rtol=2e-2)
