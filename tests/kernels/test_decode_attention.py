"""paged_decode_attention against float64 math written out page by page."""

import math

import pytest
import torch
from lanekv.kernels.decode_attention import (
    DecodeConfig,
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
)

from tests.markers import requires_gpu


def _naive_decode(q, k_cache, v_cache, page_table, seq_lens, page_size, scale):
    """float64, one (request, head) at a time; keys gathered page by page."""
    batch, q_heads, head_dim = q.shape
    group = q_heads // k_cache.shape[1]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        rows = []
        for slot in range(math.ceil(n / page_size)):
            first = int(page_table[b, slot]) * page_size
            rows.extend(range(first, first + page_size))
        rows = torch.tensor(rows[:n])
        for h in range(q_heads):
            keys = k_cache[rows, h // group].double()  # [n, D]
            values = v_cache[rows, h // group].double()
            logits = keys @ q[b, h].double() * scale
            weights = torch.exp(logits - logits.max())
            out[b, h] = (weights / weights.sum()) @ values
    return out


def _problem(batch, q_heads, kv_heads, head_dim, page_size, seq_lens, dtype, seed,
             device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    max_pages = max(1, max(math.ceil(n / page_size) for n in seq_lens) + 1)
    num_pages = batch * max_pages + 3
    rows = num_pages * page_size
    k_cache = torch.randn(rows, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(rows, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    # Every request gets distinct pages of the pool in scrambled order.
    perm = torch.randperm(num_pages, generator=gen, device=device)[: batch * max_pages]
    page_table = perm.view(batch, max_pages).to(torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, q_heads, head_dim, generator=gen, device=device).to(dtype)
    return q, k_cache, v_cache, page_table, lens


def _rel_err(got, want):
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-12)).item()


CASES = [
    # (q_heads, kv_heads, head_dim, page_size, seq_lens)
    (4, 4, 16, 1, [1, 9, 70]),
    (8, 2, 32, 3, [70, 0, 5]),
    (8, 1, 40, 16, [130, 17]),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,page_size,seq_lens", CASES)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_matches_float64(dtype, q_heads, kv_heads, head_dim, page_size, seq_lens,
                                num_splits):
    args = _problem(len(seq_lens), q_heads, kv_heads, head_dim, page_size, seq_lens, dtype,
                    seed=page_size * 10 + q_heads)
    scale = head_dim ** -0.5
    want = _naive_decode(*args, page_size, scale)
    out = torch.full_like(args[0], float("nan"))
    got = paged_decode_attention_triton(*args, page_size, scale, out=out, num_splits=num_splits,
                                        config=DecodeConfig(block_n=16))
    assert got is out
    assert not torch.isnan(out).any()
    # fp16 rounds the probabilities before the PV product (as flash decoding does).
    assert _rel_err(out, want) < (2e-3 if dtype == torch.float16 else 1e-5)
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_reference_matches_float64(dtype):
    seq_lens = [33, 0, 1, 12]
    args = _problem(4, 8, 2, 16, 3, seq_lens, dtype, seed=11)
    want = _naive_decode(*args, 3, 0.3)
    got = paged_decode_attention_ref(*args, 3, 0.3)
    assert _rel_err(got, want) < (1e-3 if dtype == torch.float16 else 1e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(paged_decode_attention(*args, 3, 0.3), got)


def test_decode_into_strided_out_and_default_config():
    args = _problem(2, 4, 2, 16, 16, [40, 3], torch.float32, seed=4)
    want = _naive_decode(*args, 16, 0.25)
    wide = torch.full((2, 4, 48), float("nan"))
    out = wide[:, :, 8:24]
    paged_decode_attention_triton(*args, 16, 0.25, out=out)
    assert _rel_err(out, want) < 1e-5
    assert torch.isnan(wide[:, :, :8]).all() and torch.isnan(wide[:, :, 24:]).all()


def test_choose_num_splits_fills_the_gpu():
    cfg = DecodeConfig()
    # One long request on 8 kv heads needs many splits to give 132 SMs work ...
    assert choose_num_splits(1, 8, 32768, 132, cfg) * 8 >= 132
    # ... but a split never gets fewer than min_split_keys keys ...
    assert choose_num_splits(1, 8, 512, 132, cfg) == 2
    # ... and a big batch needs no split at all.
    assert choose_num_splits(64, 8, 8192, 132, cfg) == 1


@pytest.mark.parametrize("impl", [paged_decode_attention_triton, paged_decode_attention_ref])
def test_decode_rejects_bad_arguments(impl):
    q, k, v, table, lens = _problem(2, 4, 2, 16, 2, [3, 4], torch.float32, seed=0)
    with pytest.raises(ValueError, match="not a multiple of k_cache's 3"):
        impl(q, k[:, :1].expand(-1, 3, -1), k[:, :1].expand(-1, 3, -1), table, lens, 2, 1.0)
    with pytest.raises(ValueError, match="k_cache.dtype"):
        impl(q, k.half(), v, table, lens, 2, 1.0)
    with pytest.raises(ValueError, match="seq_lens holds 99"):
        impl(q, k, v, table, torch.tensor([3, 99], dtype=torch.int32), 2, 1.0)
    bad_table = table.clone()
    bad_table[1, 1] = 10_000
    with pytest.raises(ValueError, match="page_table holds page 10000"):
        impl(q, k, v, bad_table, lens, 2, 1.0)
    with pytest.raises(ValueError, match="page_table must be a 2-D int32"):
        impl(q, k, v, table.long(), lens, 2, 1.0)
    with pytest.raises(ValueError, match="seq_lens has 1 entries"):
        impl(q, k, v, table, lens[:1], 2, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        impl(q, k, v, table, lens, 2, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="page_size"):
        impl(q, k, v, table, lens, 0, 1.0)
    with pytest.raises(ValueError, match="out is"):
        impl(q, k, v, table, lens, 2, 1.0, out=torch.empty(2, 4, 8))
    with pytest.raises(ValueError, match="q.dtype must be"):
        impl(q.to(torch.int32), k, v, table, lens, 2, 1.0)


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("batch,max_len", [(1, 20000), (16, 3000)])
def test_decode_gpu_bf16(page_size, batch, max_len):
    gen = torch.Generator().manual_seed(batch + page_size)
    seq_lens = torch.randint(1, max_len, (batch,), generator=gen).tolist()
    seq_lens[0] = max_len
    args = _problem(batch, 32, 8, 128, page_size, seq_lens, torch.bfloat16, seed=page_size,
                    device="cuda")
    want = paged_decode_attention_ref(*args, page_size, 128 ** -0.5).double()
    for num_splits in (None, 1, 7):
        got = paged_decode_attention_triton(*args, page_size, 128 ** -0.5, num_splits=num_splits)
        assert _rel_err(got, want.cpu()) < 1e-2
