"""kernels/prefill/sdpa.py: prefill attention segment by segment through SDPA (cuDNN on a
GPU, its float32 torch twin on the CPU), against the float64 per-row attention of
test_prefill_attention.py: CP chunks past position 0 (split and merged by log-sum-exp),
whole prompts (one call), MLA's unequal head dims, grouped-query KV heads, and the
refusals."""

from __future__ import annotations

import pytest
import torch
from lanekv.kernels.prefill import sdpa
from lanekv.kernels.prefill.sdpa import (
    PREFILL_ATTENTION_ENV,
    attend_ref,
    merge_by_lse,
    prefill_attention_backend,
    sdpa_prefill_attention,
)

from tests.kernels.test_prefill_attention import make_batch, naive_attention
from tests.markers import requires_gpu

# CP-like segments: a request's first chunk at 0 and a later one, a chunk after a prefix,
# a whole prompt, and an empty segment.
REQUESTS = [(40, [(0, 7), (29, 11)]), (23, [(5, 9)]), (16, [(0, 16)]), (9, [(4, 0)])]


def _host(batch):
    return list(zip(*(t.tolist() for t in batch.segments), strict=True))


def _check(batch, out, lse, scale, tol, lse_tol):
    want_out, want_lse = naive_attention(batch, scale)
    cov = batch.covered.cpu()
    out, lse = out.cpu().double(), lse.cpu().double()
    err = (out[cov] - want_out[cov]).norm() / want_out[cov].norm()
    assert err < tol, f"output relative error {err:.2e}"
    assert (lse[cov] - want_lse[cov]).abs().max() < lse_tol


@pytest.mark.parametrize("dims,hkv", [((24, 24), 4), ((24, 16), 4), ((16, 16), 2), ((16, 16), 1)])
def test_segments_give_the_attention_and_its_log_sum_exp(dims, hkv):
    """MLA's unequal qk and v dims; grouped-query KV heads (2 and 1 for 4 query heads)."""
    batch = make_batch(REQUESTS, hq=4, hkv=hkv, head_dim=dims[0], v_head_dim=dims[1],
                       dtype=torch.float32, device="cpu")
    got = sdpa_prefill_attention(batch.q, batch.k, batch.v, _host(batch), 0.3, return_lse=True)
    assert got.out.shape == (batch.q.shape[0], 4, dims[1]) and got.lse.dtype == torch.float32
    _check(batch, got.out, got.lse, 0.3, 2e-5, 1e-4)
    plain = sdpa_prefill_attention(batch.q, batch.k, batch.v, _host(batch), 0.3)
    cov = batch.covered
    torch.testing.assert_close(plain[cov], got.out[cov], rtol=0, atol=0)


def test_a_whole_prompt_is_one_call_and_a_later_chunk_two(monkeypatch):
    calls = []
    real = sdpa._attend

    def counting(q, k, v, causal, scale, with_lse):
        calls.append((q.shape[2], k.shape[2], causal, with_lse))
        return real(q, k, v, causal, scale, with_lse)

    monkeypatch.setattr(sdpa, "_attend", counting)
    whole = make_batch([(16, [(0, 16)])], hq=2, hkv=2, head_dim=8, dtype=torch.float32,
                       device="cpu", q_gap=0)
    out = sdpa_prefill_attention(whole.q, whole.k, whole.v, _host(whole), 0.5)
    assert calls == [(16, 16, True, False)]
    want = naive_attention(whole, 0.5)[0]
    assert (out.double() - want).norm() / want.norm() < 2e-5
    calls.clear()
    later = make_batch([(20, [(6, 5)])], hq=2, hkv=2, head_dim=8, dtype=torch.float32, device="cpu")
    sdpa_prefill_attention(later.q, later.k, later.v, _host(later), 0.5)
    # its own keys (causal, a square), then the six before it (unmasked), merged
    assert calls == [(5, 5, True, True), (5, 6, False, True)]


def test_merge_by_lse_equals_one_softmax_over_both_key_sets():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 3, 7, d, generator=gen) for d in (8, 8, 5))
    k2, v2 = torch.randn(1, 3, 11, 8, generator=gen), torch.randn(1, 3, 11, 5, generator=gen)
    whole, whole_lse = attend_ref(q, torch.cat([k, k2], 2), torch.cat([v, v2], 2), False, 0.4)
    merged, merged_lse = merge_by_lse(*attend_ref(q, k, v, False, 0.4), *attend_ref(q, k2, v2, False, 0.4))
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, whole_lse, rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_what_is_wrong(monkeypatch):
    q, k, v = torch.randn(10, 4, 8), torch.randn(12, 4, 8), torch.randn(12, 4, 6)
    for segments, match in (([(0, 10, 0, 0, 1)], r"segments\[0\] must be 4 ints"),
                            ([(0, 10.0, 0, 0)], r"segments\[0\] must be 4 ints"),
                            ([(0, True, 0, 0)], r"segments\[0\] must be 4 ints"),
                            ([(0, 4, 0, 0), (0, -1, 0, 0)], r"segments\[1\] = \(0, -1, 0, 0\) has a negative"),
                            ([(5, 6, 0, 0)], r"q_start \+ q_len = 11 passes q's 10 rows"),
                            ([(0, 5, 6, 2)], r"its keys reach row 13 of k's 12"),
                            ([(0, 5, 0, 0), (4, 3, 0, 0)], "overlap")):
        with pytest.raises(ValueError, match=match):
            sdpa_prefill_attention(q, k, v, segments, 0.3)
    with pytest.raises(ValueError, match="q heads 4 must be a multiple of k heads 3"):
        sdpa_prefill_attention(q, k[:, :3], v[:, :3], [(0, 5, 0, 0)], 0.3)
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        sdpa_prefill_attention(q, k, v, [(0, 5, 0, 0)], float("nan"))
    monkeypatch.delenv(PREFILL_ATTENTION_ENV, raising=False)
    assert prefill_attention_backend() == "triton"
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "cudnn")
    assert prefill_attention_backend() == "cudnn"
    monkeypatch.setenv(PREFILL_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="LANEKV_PREFILL_ATTENTION must be triton or cudnn, got 'flash'"):
        prefill_attention_backend()


@requires_gpu
@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("shape", ["mla", "gqa"])
def test_gpu_cudnn_segments_match_the_float64_attention(whole, shape):
    """bf16 through cuDNN, MLA's decompressed dims (qk 192, v 128) and Llama's grouped
    heads (d128, 4 query heads a KV head): the split chunks' merge needs its log-sum-exp,
    the whole prompt takes the public SDPA call."""
    requests = [(300, [(0, 300)])] if whole else [(700, [(0, 130), (500, 200)]), (333, [(97, 236)])]
    dims = dict(hq=16, hkv=16, head_dim=192, v_head_dim=128) if shape == "mla" else dict(
        hq=16, hkv=4, head_dim=128, v_head_dim=128)
    batch = make_batch(requests, **dims, dtype=torch.bfloat16, device="cuda", q_gap=0 if whole else 2)
    scale = dims["head_dim"] ** -0.5
    if whole:
        out = sdpa_prefill_attention(batch.q, batch.k, batch.v, _host(batch), scale)
        want, _ = naive_attention(batch, scale)
        err = (out.cpu().double() - want).norm() / want.norm()
        assert err < 1e-2, f"output relative error {err:.2e}"
        return
    got = sdpa_prefill_attention(batch.q, batch.k, batch.v, _host(batch), scale, return_lse=True)
    _check(batch, got.out, got.lse, scale, 1e-2, 2e-2)
