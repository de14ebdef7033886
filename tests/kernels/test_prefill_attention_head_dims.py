"""cp_prefill_attention with a v head dim apart from the qk one and head dims off powers of two.

DeepSeek MLA decompressed to per-head K/V scores 192 = 128 nope + 64 rope dims
and reads 128 value dims; the interpreter cases use small odd dims that take
the same code paths (a head and a tail part of qk, padded and masked v).
"""

from __future__ import annotations

import math

import pytest
import torch
from lanekv.kernels.prefill.attention import cp_prefill_attention, cp_prefill_attention_triton
from lanekv.kernels.prefill.config import head_dim_split
from lanekv.kernels.prefill.reference import AttnSegments, cp_prefill_attention_ref

from tests.kernels.test_prefill_attention import (
    THREE_REQUESTS,
    TWO_REQUESTS,
    check_against_naive,
    make_batch,
    run_op,
)
from tests.markers import requires_gpu

CASES = {
    # name: (requests, hq, hkv, qk_dim, v_dim, dtype, page_size)
    "qk24_v16_contig_fp32": (THREE_REQUESTS, 2, 2, 24, 16, torch.float32, 0),
    "qk24_v16_paged1_fp16": (TWO_REQUESTS, 4, 1, 24, 16, torch.float16, 1),
    "qk48_v32_paged3_fp32": (THREE_REQUESTS, 4, 2, 48, 32, torch.float32, 3),
    "qk48_v32_contig_fp16": (TWO_REQUESTS, 2, 1, 48, 32, torch.float16, 0),
    "qk40_v40_paged16_fp16": (THREE_REQUESTS, 2, 1, 40, 40, torch.float16, 16),
    "qk12_v20_contig_fp32": (TWO_REQUESTS, 2, 2, 12, 20, torch.float32, 0),
}


def test_head_dim_split() -> None:
    # DeepSeek's 192 runs two exact power-of-two dots; odd dims mask the tail.
    assert head_dim_split(192, 128) == (128, 64, 128)
    assert head_dim_split(24, 16) == (16, 16, 16)
    assert head_dim_split(48, 32) == (32, 16, 32)
    assert head_dim_split(128, 128) == (128, 0, 128)
    assert head_dim_split(12, 20) == (16, 0, 32)
    assert head_dim_split(100, 200) == (64, 64, 256)


@pytest.mark.parametrize("name", list(CASES))
def test_head_dims_match_float64(name: str) -> None:
    requests, hq, hkv, qk_dim, v_dim, dtype, page_size = CASES[name]
    batch = make_batch(requests, hq=hq, hkv=hkv, head_dim=qk_dim, v_head_dim=v_dim, dtype=dtype,
                       page_size=page_size, seed=qk_dim + v_dim)
    scale = 1.0 / math.sqrt(qk_dim)
    for op in (cp_prefill_attention_triton, cp_prefill_attention_ref):
        out, lse = run_op(op, batch, scale)
        assert out.shape == (*batch.q.shape[:2], v_dim)
        check_against_naive(batch, out, lse, scale)


@pytest.mark.parametrize("op", [cp_prefill_attention_triton, cp_prefill_attention_ref])
def test_out_takes_the_v_head_dim(op) -> None:
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=1, head_dim=24, v_head_dim=16, dtype=torch.float32,
                       seed=5)
    got = op(batch.q, batch.k, batch.v, batch.segments, 0.2)
    assert got.shape == (batch.q.shape[0], 2, 16) and got.dtype == batch.q.dtype
    with pytest.raises(ValueError, match=r"out shape \(\d+, 2, 24\) must be \[Tq, Hq, Dv\]"):
        op(batch.q, batch.k, batch.v, batch.segments, 0.2, out=torch.empty_like(batch.q))
    with pytest.raises(ValueError, match="v shape"):
        op(batch.q, batch.k, batch.v[:-1], batch.segments, 0.2)
    with pytest.raises(ValueError, match="k head_dim 16 differs from q head_dim 24"):
        op(batch.q, batch.v, batch.v, batch.segments, 0.2)


def test_dispatcher_passes_the_v_head_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    batch = make_batch(TWO_REQUESTS, hq=2, hkv=2, head_dim=48, v_head_dim=32, dtype=torch.float32,
                       seed=6)
    got = cp_prefill_attention(batch.q, batch.k, batch.v, batch.segments, 0.15)
    want = cp_prefill_attention_triton(batch.q, batch.k, batch.v, batch.segments, 0.15)
    assert torch.equal(got[batch.covered], want[batch.covered])


# ---- GPU: bf16 at DeepSeek shapes (qk 192 = 128 + 64, v 128) -----------------


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@requires_gpu
@pytest.mark.parametrize("heads,seq_len", [(16, 4096), (128, 1000)])
def test_gpu_bf16_deepseek_dims(heads: int, seq_len: int) -> None:
    torch.manual_seed(heads)
    q = torch.randn(seq_len, heads, 192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(seq_len, heads, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(seq_len, heads, 128, device="cuda", dtype=torch.bfloat16)
    scale = 192**-0.5
    c = seq_len // 4
    for cols in (([0], [seq_len], [0], [0]), ([0, c], [c, c], [0, seq_len - c], [0, 0])):
        segs = AttnSegments(*(torch.tensor(x, dtype=torch.int32, device="cuda") for x in cols))
        rows = int(segs.q_len.sum())
        qs = q[:rows] if len(cols[0]) == 1 else torch.cat([q[:c], q[seq_len - c :]])
        got = cp_prefill_attention_triton(qs, k, v, segs, scale, return_lse=True, validate=True)
        want = cp_prefill_attention_ref(qs, k, v, segs, scale, return_lse=True)
        assert got.out.shape == (rows, heads, 128)
        assert _rel(got.out, want.out) < 1e-2
        torch.testing.assert_close(got.lse, want.lse, atol=2e-2, rtol=2e-2)


@requires_gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_gpu_bf16_deepseek_dims_paged(page_size: int) -> None:
    requests = [(700, [(0, 100), (500, 200)]), (333, [(300, 33)]), (64, [(63, 1)])]
    batch = make_batch(requests, hq=16, hkv=16, head_dim=192, v_head_dim=128,
                       dtype=torch.bfloat16, device="cuda", page_size=page_size, seed=page_size)
    scale = 192**-0.5
    out, lse = run_op(cp_prefill_attention_triton, batch, scale, validate=True)
    want_out, want_lse = run_op(cp_prefill_attention_ref, batch, scale)
    cov = batch.covered
    assert out[~cov].isnan().all() and not out[cov].isnan().any()
    assert _rel(out[cov], want_out[cov]) < 1e-2
    torch.testing.assert_close(lse[cov], want_lse[cov], atol=2e-2, rtol=2e-2)
