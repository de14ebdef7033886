"""The fused RoPE + FP8 quantize + store kernels (GQA and MLA rows) equal their torch
references bit for bit: interpreted here on tiny odd float32 shapes over poisoned
caches, compiled (bf16, float32) in the gpu tests. The references are the unfused ops
(RoPE in float32 rounded once, then the packing of ``kernels/fp8/kv_rows.py``)."""

import pytest
import torch
from lanekv.kernels.fp8.kv_rows import (
    dequantize_kv_fp8_rows,
    kv_fp8_head_bytes,
    mla_fp8_row_bytes,
    mla_fp8_row_stride,
    pack_kv_fp8_rows_ref,
    pack_mla_fp8_rows_ref,
    unpack_mla_fp8_rows,
)
from lanekv.kernels.fp8.rope_store import (
    mla_rope_store_fp8,
    mla_rope_store_fp8_ref,
    mla_rope_store_fp8_triton,
    rope_store_kv_fp8,
    rope_store_kv_fp8_ref,
    rope_store_kv_fp8_triton,
    rotate_once,
)
from lanekv.kernels.rope_store import apply_rotary, rope_pairs

from tests.markers import requires_gpu

POISON = 0x5A


def _gqa_case(tokens, q_heads, kv_heads, head_dim, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as slices of one fused projection (strided rows, as the model gives them),
    # over four decades so the scales differ
    width = (q_heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(tokens, width, generator=gen) * torch.logspace(-2, 2, width)[
        torch.randperm(width, generator=gen)]
    qkv = qkv.to(dtype).to(device)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = (t.view(tokens, h, head_dim) for t, h in ((q, q_heads), (k, kv_heads), (v, kv_heads)))
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 50
    angles = torch.cat((angles, angles), -1).to(device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    rows = max(8, 2 * tokens)
    caches = torch.full((2, rows, kv_heads, kv_fp8_head_bytes(head_dim)), POISON, dtype=torch.uint8,
                        device=device)
    locs = torch.randperm(rows, generator=gen)[:tokens].to(device)
    locs[::3] = -1  # padding rows: written nowhere
    return q, k, v, cos, sin, caches, locs


@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [
    (1, 1, 1, 4), (5, 3, 1, 12), (7, 4, 2, 20), (3, 6, 3, 8), (0, 2, 1, 8)])
@pytest.mark.parametrize("with_block", [False, True])
def test_rope_store_kv_fp8_is_bit_exact(tokens, q_heads, kv_heads, head_dim, with_block):
    q, k, v, cos, sin, caches, locs = _gqa_case(tokens, q_heads, kv_heads, head_dim,
                                                tokens * 7 + head_dim)
    want_caches = caches.clone()
    # a block two rows longer than the tokens: the rows past them keep their poison
    block = torch.full((tokens + 2, 2, kv_heads, kv_fp8_head_bytes(head_dim)), POISON,
                       dtype=torch.uint8) if with_block else None
    want_block = None if block is None else block.clone()
    want_q = rope_store_kv_fp8_ref(q, k, v, cos, sin, want_caches[0], want_caches[1], locs,
                                   None if block is None else want_block[:tokens])
    got_q = rope_store_kv_fp8_triton(q, k, v, cos, sin, caches[0], caches[1], locs,
                                     None if block is None else block[:tokens])
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches, want_caches)
    kept = locs >= 0
    # the reference is the unfused ops: RoPE rounded once, then the packing
    assert torch.equal(want_caches[0, locs[kept]], pack_kv_fp8_rows_ref(rotate_once(k, cos, sin))[kept])
    assert torch.equal(want_caches[1, locs[kept]], pack_kv_fp8_rows_ref(v)[kept])
    untouched = torch.ones(caches.shape[1], dtype=torch.bool)
    untouched[locs[kept]] = False
    assert (caches[:, untouched] == POISON).all()
    if block is not None:
        assert torch.equal(block, want_block)
        assert torch.equal(block[:tokens, 0], pack_kv_fp8_rows_ref(rotate_once(k, cos, sin)))
        assert (block[tokens:] == POISON).all()
    # rotate_once is RoPE: within one float32 rounding of transformers' op order
    torch.testing.assert_close(got_q, apply_rotary(q, cos, sin), rtol=1e-5, atol=1e-4)


def test_rope_store_kv_fp8_rows_decode_to_the_rotated_keys():
    q, k, v, cos, sin, caches, locs = _gqa_case(6, 2, 2, 16, 3)
    locs = torch.arange(6)
    rope_store_kv_fp8_triton(q, k, v, cos, sin, caches[0], caches[1], locs)
    key = apply_rotary(k, cos, sin)
    back = dequantize_kv_fp8_rows(caches[0, :6], 16, torch.float32)
    assert float(((back - key).abs() - key.abs() / 16).max()) <= 1e-3  # e4m3: 3 mantissa bits


def test_rope_store_kv_fp8_refuses_bad_arguments():
    q, k, v, cos, sin, caches, locs = _gqa_case(3, 2, 1, 8, 1)
    with pytest.raises(ValueError, match="k_cache must be a uint8"):
        rope_store_kv_fp8(q, k, v, cos, sin, caches[0].float(), caches[1], locs)
    with pytest.raises(ValueError, match="kv_out must be a uint8"):
        rope_store_kv_fp8(q, k, v, cos, sin, caches[0], caches[1], locs,
                          torch.zeros((3, 2, 1, 8), dtype=torch.uint8))
    with pytest.raises(ValueError, match="beyond the 8 cache rows"):
        rope_store_kv_fp8(q, k, v, cos, sin, caches[0], caches[1], torch.tensor([0, 1, 8]))
    q6, k6, v6, cos6, sin6, caches6, locs6 = _gqa_case(2, 1, 1, 8, 1)
    with pytest.raises(ValueError, match="head_dim must be a positive multiple of 4"):
        rope_store_kv_fp8(q6[..., :6], k6[..., :6], v6[..., :6], cos6[:, :6], sin6[:, :6],
                          caches6[0], caches6[1], locs6)


def _mla_case(tokens, rank, rope, seed, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(tokens, rank + rope + 3, generator=gen) * torch.logspace(
        -2, 2, rank + rope + 3)[torch.randperm(rank + rope + 3, generator=gen)]
    latent = latent.to(dtype).to(device)[:, : rank + rope]  # strided rows
    angles = torch.rand(tokens, rope // 2, generator=gen).to(device) * 50
    stride = mla_fp8_row_stride(rank, rope)
    cache = torch.full((max(8, 2 * tokens), stride), POISON, dtype=torch.uint8, device=device)
    locs = torch.randperm(cache.shape[0], generator=gen)[:tokens].to(device)
    locs[1::3] = -1
    return latent, angles.cos(), angles.sin(), cache, locs


@pytest.mark.parametrize("tokens,rank,rope", [(1, 16, 2), (5, 48, 6), (4, 32, 8), (0, 16, 4),
                                              (3, 384, 10)])
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("with_rows", [False, True])
def test_mla_rope_store_fp8_is_bit_exact(tokens, rank, rope, interleave, with_rows):
    latent, cos, sin, cache, locs = _mla_case(tokens, rank, rope, tokens + rank + rope)
    want_cache = cache.clone()
    rows = torch.full((tokens, cache.shape[1]), POISON, dtype=torch.uint8) if with_rows else None
    want_rows = None if rows is None else rows.clone()
    mla_rope_store_fp8_ref(latent, cos, sin, interleave, want_cache, locs, rank, want_rows)
    mla_rope_store_fp8_triton(latent, cos, sin, interleave, cache, locs, rank, rows)
    assert torch.equal(cache, want_cache)
    packed = mla_fp8_row_bytes(rank, rope)
    roped = torch.cat((latent[:, :rank], rope_pairs(latent[:, None, rank:], cos, sin,
                                                    interleave)[:, 0]), dim=1)
    kept = locs >= 0
    assert torch.equal(cache[locs[kept], :packed], pack_mla_fp8_rows_ref(roped, rank)[kept])
    assert (cache[locs[kept], packed:] == 0).all()  # the padding is zero
    untouched = torch.ones(cache.shape[0], dtype=torch.bool)
    untouched[locs[kept]] = False
    assert (cache[untouched] == POISON).all()
    if rows is not None:
        assert torch.equal(rows, want_rows)
        assert torch.equal(rows[:, :packed], pack_mla_fp8_rows_ref(roped, rank))
    back = unpack_mla_fp8_rows(cache[locs[kept], :packed], rank, rope, torch.float32)
    torch.testing.assert_close(back[:, rank:], roped[kept, rank:], rtol=2 ** -8, atol=1e-6)


def test_mla_rope_store_fp8_refuses_bad_arguments():
    latent, cos, sin, cache, locs = _mla_case(3, 16, 4, 1)
    with pytest.raises(ValueError, match="cos must be a dense float32"):
        mla_rope_store_fp8(latent, cos.double(), sin, False, cache, locs, 16)
    with pytest.raises(ValueError, match="cache must be uint8"):
        mla_rope_store_fp8(latent, cos, sin, False, cache[:, :8], locs, 16)
    with pytest.raises(ValueError, match="kv_lora_rank must be a positive multiple of 16"):
        mla_rope_store_fp8(latent, cos, sin, False, cache, locs, 12)
    with pytest.raises(ValueError, match="interleave must be a bool"):
        mla_rope_store_fp8(latent, cos, sin, 1, cache, locs, 16)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim", [(1, 1, 1, 4), (37, 6, 3, 20),
                                                               (129, 32, 8, 128)])
def test_gpu_rope_store_kv_fp8_is_bit_exact(dtype, tokens, q_heads, kv_heads, head_dim):
    q, k, v, cos, sin, caches, locs = _gqa_case(tokens, q_heads, kv_heads, head_dim, tokens,
                                                dtype, "cuda")
    block = torch.zeros((tokens, 2, kv_heads, kv_fp8_head_bytes(head_dim)), dtype=torch.uint8,
                        device="cuda")
    want_caches, want_block = caches.clone(), block.clone()
    want_q = rope_store_kv_fp8_ref(q, k, v, cos, sin, want_caches[0], want_caches[1], locs,
                                   want_block)
    got_q = rope_store_kv_fp8(q, k, v, cos, sin, caches[0], caches[1], locs, block)
    assert torch.equal(got_q, want_q)
    assert torch.equal(caches, want_caches) and torch.equal(block, want_block)


@requires_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,rank,rope,interleave", [(1, 16, 2, False), (33, 48, 6, True),
                                                          (130, 512, 64, True)])
def test_gpu_mla_rope_store_fp8_is_bit_exact(dtype, tokens, rank, rope, interleave):
    latent, cos, sin, cache, locs = _mla_case(tokens, rank, rope, tokens, dtype, "cuda")
    rows = torch.zeros((tokens, cache.shape[1]), dtype=torch.uint8, device="cuda")
    want_cache, want_rows = cache.clone(), rows.clone()
    mla_rope_store_fp8_ref(latent, cos, sin, interleave, want_cache, locs, rank, want_rows)
    mla_rope_store_fp8(latent, cos, sin, interleave, cache, locs, rank, rows)
    assert torch.equal(cache, want_cache) and torch.equal(rows, want_rows)
