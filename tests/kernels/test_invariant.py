"""The batch-invariant CPU ops (``kernels/invariant``): a row's bits do not depend on the
rows beside it, where torch's own CPU ops (MKL's GEMM, the sigmoid's vector body and
scalar tail) do; the results stay the ops' values within float32 rounding."""

import math

import pytest
import torch
import torch.nn.functional as F
from lanekv.kernels.invariant.attention import blocked_attention
from lanekv.kernels.invariant.linear import RowInvariantLinear, row_invariant_linear
from torch import nn


def _rows(n, width, seed):
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bias", [False, True])
def test_row_invariant_linear_rows_do_not_depend_on_the_batch(bias):
    x, w = _rows(40, 64, 2), _rows(96, 64, 3)
    b = _rows(1, 96, 4)[0] if bias else None
    full = row_invariant_linear(x, w, b)
    for m in (1, 2, 3, 5, 9, 11, 17):
        assert torch.equal(row_invariant_linear(x[:m], w, b), full[:m])
        assert torch.equal(row_invariant_linear(x[7 : 7 + m], w, b), full[7 : 7 + m])
    torch.testing.assert_close(full, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert row_invariant_linear(x.view(5, 8, 64), w, b).shape == (5, 8, 96)


def test_row_invariant_linear_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="weight must be"):
        row_invariant_linear(_rows(3, 64, 0), _rows(8, 32, 1))


def test_the_mode_routes_linear_sigmoid_and_silu_on_float32_cpu_tensors():
    lin = nn.Linear(64, 32)
    x = _rows(40, 64, 5)
    half = _rows(40, 64, 7).bfloat16()
    want_half = torch.sigmoid(half)
    with torch.no_grad(), RowInvariantLinear():
        full, sig, act = lin(x), x.sigmoid(), F.silu(x[:, :24].contiguous())
        for m in range(1, 40):
            assert torch.equal(lin(x[:m]), full[:m])
            assert torch.equal(torch.sigmoid(x[:m]), sig[:m])
            assert torch.equal(F.silu(x[:m, :24].contiguous()), act[:m])
        assert torch.equal(torch.sigmoid(half), want_half)  # half precision: torch's own
    torch.testing.assert_close(full, lin(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sig, torch.sigmoid(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(act, F.silu(x[:, :24]), rtol=1e-6, atol=1e-6)


def _softmax_attention(q, k, v, q_pos, scale):
    group = q.shape[1] // k.shape[1]
    kh, vh = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kh.double()) * scale
    scores.masked_fill_(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], -math.inf)
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vh.double())
    return out.float(), torch.logsumexp(scores, -1).T.float()


def test_blocked_attention_is_attention_and_each_query_is_batch_invariant():
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(37, 4, 12, generator=gen), torch.randn(37, 2, 12, generator=gen),
               torch.randn(37, 2, 10, generator=gen))
    pos = torch.arange(37)
    out, lse = blocked_attention(q, k, v, pos, 0.3)
    want_out, want_lse = _softmax_attention(q, k, v, pos, 0.3)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    # a CP rank's segments: other query groupings and key ranges ending anywhere past
    # each query's position give its bits
    for lo, hi, keys in ((0, 1, 1), (5, 16, 16), (16, 17, 37), (20, 37, 37), (3, 9, 30)):
        got, got_lse = blocked_attention(q[lo:hi], k[:keys], v[:keys], pos[lo:hi], 0.3)
        assert torch.equal(got, out[lo:hi]) and torch.equal(got_lse, lse[lo:hi])
