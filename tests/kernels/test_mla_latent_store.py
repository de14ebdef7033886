"""mla_rope_norm_store: the decode step's q_pe RoPE, kv_a norm, key RoPE and latent store
in one launch, Triton (interpreted on CPU) against the unfused reference, over plain
and FP8 rows. The inputs are strided views of one GEMM output, as the model hands
them; cache rows no loc names are poisoned and must stay so."""

from __future__ import annotations

import pytest
import torch
from lanekv.kernels.fp8.kv_rows import mla_fp8_row_bytes, mla_fp8_row_stride, unpack_mla_fp8_rows
from lanekv.kernels.mla.latent_store import (
    mla_rope_norm_store,
    mla_rope_norm_store_ref,
    mla_rope_norm_store_triton,
)
from lanekv.kernels.rmsnorm import add_rmsnorm_ref
from lanekv.kernels.rope_store import rope_pairs

from tests.markers import requires_gpu


def make_inputs(tokens, heads, nope, rope, rank, dtype, *, device="cpu", seed=0):
    """(q_pe, kv_a, weight, cos, sin): q_pe and kv_a views of one ``[T, ...]`` GEMM output."""
    gen = torch.Generator().manual_seed(seed)
    q_width = heads * (nope + rope)
    gemm = torch.randn(tokens, q_width + rank + rope + 5, generator=gen).to(device, dtype)
    q = gemm[:, :q_width].view(tokens, heads, nope + rope)
    kv_a = gemm[:, q_width: q_width + rank + rope]
    weight = (1 + 0.3 * torch.randn(rank, generator=gen)).to(device, dtype)
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6
    return q[..., nope:], kv_a, weight, angles.cos().to(device), angles.sin().to(device)


def run_both(inputs, interleave, cache, locs, rank):
    """Each implementation on its own copies: (q_pe, cache) of the kernel, then the reference's."""
    q_pe, kv_a, weight, cos, sin = inputs
    results = []
    for impl in (mla_rope_norm_store_triton, mla_rope_norm_store_ref):
        q, c = q_pe.clone(), cache.clone()
        impl(q, kv_a, weight, 1e-6, cos, sin, interleave, c, locs, rank)
        results.append((q, c))
    return results


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
@pytest.mark.parametrize("tokens,heads,nope,rope,rank", [(1, 3, 8, 6, 24), (4, 5, 16, 8, 40)])
def test_plain_rows(interleave, dtype, tol, tokens, heads, nope, rope, rank):
    inputs = make_inputs(tokens, heads, nope, rope, rank, dtype, seed=tokens + heads)
    rows = 2 * tokens + 3
    cache = torch.full((rows, rank + rope), float("nan"), dtype=dtype)
    locs = torch.tensor([rows - 1 - 2 * t if t % 3 != 1 else -1 for t in range(tokens)])
    before = inputs[1].clone()
    (q1, c1), (q2, c2) = run_both(inputs, interleave, cache, locs, rank)
    assert torch.equal(q1, q2)  # the rotation is the reference's ops in its order
    stored = locs[locs >= 0]
    assert c1.isnan().sum(1).eq(rank + rope).sum() == rows - len(stored)  # only those rows
    torch.testing.assert_close(c1[stored], c2[stored], rtol=tol, atol=tol)
    torch.testing.assert_close(c1[stored, rank:], c2[stored, rank:], rtol=0, atol=0)
    assert torch.equal(inputs[1], before)  # kv_a is read, never written
    # and the reference is the model's unfused ops
    keep = locs >= 0
    normed = add_rmsnorm_ref(before[:, :rank], None, inputs[2], 1e-6)[0]
    k_pe = rope_pairs(before[:, None, rank:], inputs[3], inputs[4], interleave)[:, 0]
    assert torch.equal(c2[locs[keep]], torch.cat((normed, k_pe), 1)[keep])


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("tokens,heads,rank,rope", [(3, 3, 32, 6), (2, 4, 256, 8)])
def test_fp8_rows(interleave, tokens, heads, rank, rope):
    """The packed row of ``mla_rope_store_fp8``: e4m3 values, scales, bf16 key, padding zero."""
    inputs = make_inputs(tokens, heads, 8, rope, rank, torch.float32, seed=rank)
    stride = mla_fp8_row_stride(rank, rope) + 4  # padding past the packed bytes
    cache = torch.full((tokens + 4, stride), 0xA5, dtype=torch.uint8)
    locs = torch.tensor([2 * t + 1 if t != 1 else -1 for t in range(tokens)])
    (q1, c1), (q2, c2) = run_both(inputs, interleave, cache, locs, rank)
    assert torch.equal(q1, q2)
    stored = locs[locs >= 0]
    others = torch.ones(cache.shape[0], dtype=torch.bool)
    others[stored] = False
    assert torch.equal(c1[others], cache[others])
    packed = mla_fp8_row_bytes(rank, rope)
    assert (c1[stored, packed:] == 0).all()
    # bytes equal but where the norm's float32 sum of squares rounds apart
    got = unpack_mla_fp8_rows(c1[stored][:, :packed], rank, rope, torch.float32)
    want = unpack_mla_fp8_rows(c2[stored][:, :packed], rank, rope, torch.float32)
    torch.testing.assert_close(got, want, rtol=0.07, atol=1e-5)
    assert (c1[stored] != c2[stored]).float().mean() < 0.02


def test_without_triton_the_dispatcher_takes_the_reference(monkeypatch):
    monkeypatch.delenv("LANEKV_CPU_KERNELS", raising=False)
    inputs = make_inputs(2, 3, 8, 6, 24, torch.float32)
    cache = torch.zeros(4, 30)
    locs = torch.tensor([0, 3])
    want_q, want = inputs[0].clone(), cache.clone()
    mla_rope_norm_store_ref(want_q, *inputs[1:3], 1e-6, *inputs[3:], True, want, locs, 24)
    mla_rope_norm_store(inputs[0], *inputs[1:3], 1e-6, *inputs[3:], True, cache, locs, 24)
    assert torch.equal(inputs[0], want_q) and torch.equal(cache, want)


def test_rejects_bad_arguments():
    q_pe, kv_a, w, cos, sin = make_inputs(2, 3, 8, 6, 32, torch.float32)
    cache, locs = torch.zeros(4, 38), torch.tensor([0, 1])
    good = dict(q_pe=q_pe, kv_a=kv_a, norm_weight=w, eps=1e-6, cos=cos, sin=sin, interleave=True,
                cache=cache, locs=locs, kv_lora_rank=32)
    bad = [
        (dict(kv_a=kv_a[0]), "kv_a must be a 2-D"),
        (dict(kv_a=kv_a.to(torch.int32)), "kv_a must be"),
        (dict(kv_lora_rank=33), "kv_lora_rank must be"),
        (dict(kv_lora_rank=True), "kv_lora_rank must be"),
        (dict(q_pe=q_pe[..., :4]), r"q_pe must be a torch.float32 \[2, H, 6\]"),
        (dict(q_pe=q_pe.half()), "q_pe must be"),
        (dict(norm_weight=w[:-1]), r"norm_weight must be a dense torch.float32 \[32\]"),
        (dict(eps=0.0), "eps must be"),
        (dict(eps=float("nan")), "eps must be"),
        (dict(interleave=1), "interleave must be a bool"),
        (dict(cos=cos.double()), "cos must be a dense float32"),
        (dict(sin=sin[:1]), "sin must be"),
        (dict(cache=torch.zeros(4, 37)), r"cache must be a torch.float32 \[rows, 38\]"),
        (dict(cache=torch.zeros(4, 38).half()), "cache must be"),
        (dict(cache=torch.zeros(4, 10, dtype=torch.uint8)), "cache must be uint8"),
        (dict(locs=locs.int()), "locs must be a"),
        (dict(locs=torch.tensor([0, 4])), "locs holds 4, beyond the 4 cache rows"),
    ]
    for impl in (mla_rope_norm_store_triton, mla_rope_norm_store_ref):
        for override, match in bad:
            with pytest.raises(ValueError, match=match):
                impl(**{**good, **override})


@requires_gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_bf16_deepseek_shapes(fp8, tokens):
    """V2-Lite's widths (16 heads, 128 + 64 query dims, 512 + 64 latent), compiled."""
    inputs = make_inputs(tokens, 16, 128, 64, 512, torch.bfloat16, device="cuda", seed=tokens)
    rows = 64
    if fp8:
        cache = torch.zeros(rows, mla_fp8_row_stride(512, 64), dtype=torch.uint8, device="cuda")
    else:
        cache = torch.zeros(rows, 576, dtype=torch.bfloat16, device="cuda")
    locs = torch.randperm(rows, device="cuda")[:tokens]
    locs[0] = -1
    (q1, c1), (q2, c2) = run_both(inputs, True, cache, locs, 512)
    assert torch.equal(q1, q2)
    if fp8:
        packed = mla_fp8_row_bytes(512, 64)
        c1 = unpack_mla_fp8_rows(c1[:, :packed], 512, 64, torch.float32)
        c2 = unpack_mla_fp8_rows(c2[:, :packed], 512, 64, torch.float32)
    torch.testing.assert_close(c1.float(), c2.float(), rtol=0.07, atol=1e-2)
