"""rope_store_kv: Triton (interpreted on CPU) against the unfused reference
(``apply_rotary`` then ``store_kv``), on a poisoned pool."""

import pytest
import torch
from lanekv.kernels.kv_layout import KVCacheSpec
from lanekv.kernels.rope_store import (
    apply_rotary,
    mla_rope_ref,
    mla_rope_triton,
    rope_store_kv,
    rope_store_kv_ref,
    rope_store_kv_triton,
)

from tests.markers import requires_gpu

SENTINEL = 0x5A


def _case(dtype, num_tokens, q_heads, kv_heads, head_dim, gen, device="cpu"):
    spec = KVCacheSpec(num_layers=2, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       page_size=4)
    pool = spec.alloc_pool(max(8, num_tokens), device)  # 4 rows a page: room for every token
    pool.view(torch.uint8).fill_(SENTINEL)
    # q, k, v as slices of one fused projection (strided rows, as the model gives them)
    qkv = torch.randn(num_tokens, (q_heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    qkv = qkv.to(device)
    q, k, v = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(num_tokens, q_heads, head_dim)
    k = k.view(num_tokens, kv_heads, head_dim)
    v = v.view(num_tokens, kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen).to(device) * 50
    angles = torch.cat((angles, angles), -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    locs = torch.randperm(pool.shape[2], generator=gen)[:num_tokens].to(device)
    locs[::3] = -1  # padding rows: written nowhere
    return pool, q, k, v, cos, sin, locs


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("num_tokens,q_heads,kv_heads,head_dim", [(1, 2, 1, 8), (7, 4, 2, 16)])
def test_rope_store_matches_unfused(dtype, tol, num_tokens, q_heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    pool, q, k, v, cos, sin, locs = _case(dtype, num_tokens, q_heads, kv_heads, head_dim, gen)
    want_pool = pool.clone()
    want_q = rope_store_kv_ref(q, k, v, cos, sin, want_pool[1, 0], want_pool[1, 1], locs)
    torch.testing.assert_close(want_q, apply_rotary(q, cos, sin), rtol=0, atol=0)
    got_q = rope_store_kv_triton(q, k, v, cos, sin, pool[1, 0], pool[1, 1], locs)
    torch.testing.assert_close(got_q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(pool[1, 0], want_pool[1, 0], rtol=tol, atol=tol)
    assert torch.equal(pool[1, 1], want_pool[1, 1])  # v is copied bit for bit
    # Nothing but the kept locs' rows changed: layer 0 and every other row keep the poison.
    untouched = torch.ones(pool.shape[2], dtype=torch.bool)
    untouched[locs[locs >= 0]] = False
    assert (pool[:, :, untouched].view(torch.uint8) == SENTINEL).all()
    assert (pool[0].view(torch.uint8) == SENTINEL).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_rope_store_also_writes_every_row_into_kv_out(dtype, tol):
    """A CP prefill's block: every row's rotated k and its v, padding rows (loc < 0) included,
    in a strided slice of a larger block; the rows past it keep their poison."""
    gen = torch.Generator().manual_seed(5)
    pool, q, k, v, cos, sin, locs = _case(dtype, 7, 4, 2, 16, gen)
    block = torch.full((9, 2, 2, 16), float("nan"), dtype=dtype)  # 2 rows more than the tokens
    want_pool, want_block = pool.clone(), block.clone()
    want_q = rope_store_kv_ref(q, k, v, cos, sin, want_pool[1, 0], want_pool[1, 1], locs, kv_out=want_block[:7])
    torch.testing.assert_close(want_block[:7, 0], apply_rotary(k, cos, sin), rtol=0, atol=0)
    assert torch.equal(want_block[:7, 1], v)
    got_q = rope_store_kv_triton(q, k, v, cos, sin, pool[1, 0], pool[1, 1], locs, kv_out=block[:7])
    torch.testing.assert_close(got_q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(block[:7, 0], want_block[:7, 0], rtol=tol, atol=tol)
    assert torch.equal(block[:7, 1], v)  # v bit for bit
    assert block[7:].isnan().all()
    torch.testing.assert_close(pool, want_pool, rtol=tol, atol=tol, equal_nan=True)
    # The cache holds what the block holds, row for row, where a row has a loc.
    kept = locs >= 0
    assert torch.equal(pool[1, 0, locs[kept]], block[:7, 0][kept])


def test_rope_store_refuses_a_bad_kv_out():
    gen = torch.Generator().manual_seed(0)
    pool, q, k, v, cos, sin, locs = _case(torch.float32, 3, 2, 1, 8, gen)
    for bad in (torch.zeros(2, 2, 1, 8), torch.zeros(3, 2, 1, 8, dtype=torch.float16),
                torch.zeros(3, 2, 1, 16)[..., ::2]):
        with pytest.raises(ValueError, match="kv_out must be"):
            rope_store_kv(q, k, v, cos, sin, pool[0, 0], pool[0, 1], locs, kv_out=bad)


def test_rope_store_refuses_bad_args():
    gen = torch.Generator().manual_seed(0)
    pool, q, k, v, cos, sin, locs = _case(torch.float32, 3, 2, 1, 8, gen)
    with pytest.raises(ValueError, match="locs must be"):
        rope_store_kv(q, k, v, cos, sin, pool[0, 0], pool[0, 1], locs.int())
    with pytest.raises(ValueError, match="cos must be"):
        rope_store_kv(q, k, v, cos[:2], sin, pool[0, 0], pool[0, 1], locs)
    with pytest.raises(ValueError, match="beyond the"):
        rope_store_kv(q, k, v, cos, sin, pool[0, 0], pool[0, 1], locs.clamp(min=0) + 10**6)
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_store_kv(q[..., :7], k[..., :7], v[..., :7], cos[:, :7], sin[:, :7],
                      pool[0, 0, :, :, :7], pool[0, 1, :, :, :7], locs)


@requires_gpu
def test_rope_store_gpu_bf16():
    gen = torch.Generator().manual_seed(1)
    pool, q, k, v, cos, sin, locs = _case(torch.bfloat16, 37, 32, 8, 128, gen, "cuda")
    want_pool = pool.clone()
    want_q = rope_store_kv_ref(q, k, v, cos, sin, want_pool[1, 0], want_pool[1, 1], locs)
    got_q = rope_store_kv(q, k, v, cos, sin, pool[1, 0], pool[1, 1], locs)
    torch.testing.assert_close(got_q, want_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(pool, want_pool, rtol=2e-2, atol=2e-2)
    # With the block of a CP prefill: the same q and cache, and the block holds the cache's rows.
    block = torch.empty((37, 2, 8, 128), dtype=torch.bfloat16, device="cuda")
    again = want_pool.clone()
    got_again = rope_store_kv(q, k, v, cos, sin, again[1, 0], again[1, 1], locs, kv_out=block)
    assert torch.equal(got_again, got_q) and torch.equal(again, pool)
    kept = locs >= 0
    assert torch.equal(block[kept, 0], pool[1, 0, locs[kept]]) and torch.equal(block[:, 1], v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("interleave", [True, False])
def test_mla_rope_in_place_matches_reference(dtype, tol, interleave):
    """q_pe a strided view of the projected queries (after 16 nope dims), k_pe a view of
    the compressed KV; both rotated in place, the rest of the rows untouched."""
    gen = torch.Generator().manual_seed(int(interleave))
    tokens, heads, nope, rope, rank = 5, 3, 16, 8, 12
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(dtype)
    kv = torch.randn(tokens, rank + rope, generator=gen).to(dtype)
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3
    want_q, want_kv = q.clone(), kv.clone()
    mla_rope_ref(want_q[..., nope:], want_kv[:, rank:], cos, sin, interleave)
    # the reference is rope_pairs: pairs (or halves) rotated, firsts then seconds
    x = q[..., nope:].float()
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    assert torch.equal(want_q[..., nope:], torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(dtype))
    got_q, got_kv = q.clone(), kv.clone()
    mla_rope_triton(got_q[..., nope:], got_kv[:, rank:], cos, sin, interleave)
    torch.testing.assert_close(got_q, want_q, rtol=tol, atol=tol)
    torch.testing.assert_close(got_kv, want_kv, rtol=tol, atol=tol)
    assert torch.equal(got_q[..., :nope], q[..., :nope]) and torch.equal(got_kv[:, :rank], kv[:, :rank])


@pytest.mark.parametrize("change,match", [
    ({"q_pe": torch.zeros(2, 3, 7)}, "must be even"),
    ({"k_pe": torch.zeros(2, 6)}, "k_pe must be"),
    ({"cos": torch.zeros(2, 4, dtype=torch.float16)}, "cos must be"),
    ({"sin": torch.zeros(3, 4)}, "sin must be"),
])
def test_mla_rope_names_bad_arguments(change, match):
    args = {"q_pe": torch.zeros(2, 3, 8), "k_pe": torch.zeros(2, 8), "cos": torch.zeros(2, 4),
            "sin": torch.zeros(2, 4), "interleave": True}
    args.update(change)
    for impl in (mla_rope_ref, mla_rope_triton):
        with pytest.raises(ValueError, match=match):
            impl(**args)


@pytest.mark.parametrize("interleave", [False, True])
def test_mla_rope_without_k_pe_rotates_the_queries_only(interleave):
    """FP8 latent rows rotate the key as they store it: ``k_pe=None`` rotates q_pe alone,
    as the call with a key does."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 3, 16 + 6, generator=gen)
    k_pe = torch.randn(4, 6, generator=gen)
    angles = torch.rand(4, 3, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    want = q.clone()
    mla_rope_ref(want[..., 16:], k_pe.clone(), cos, sin, interleave)
    for impl in (mla_rope_ref, mla_rope_triton):
        got = q.clone()
        impl(got[..., 16:], None, cos, sin, interleave)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        assert not torch.equal(got, q)


@requires_gpu
def test_mla_rope_gpu_bf16_v2_lite_shapes():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(64, 16, 192, device="cuda", generator=gen).bfloat16()
    kv = torch.randn(64, 576, device="cuda", generator=gen).bfloat16()
    angles = torch.rand(64, 32, device="cuda", generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    want_q, want_kv, got_q, got_kv = q.clone(), kv.clone(), q.clone(), kv.clone()
    mla_rope_ref(want_q[..., 128:], want_kv[:, 512:], cos, sin, True)
    mla_rope_triton(got_q[..., 128:], got_kv[:, 512:], cos, sin, True)
    torch.testing.assert_close(got_q, want_q, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-2, atol=1e-2)
