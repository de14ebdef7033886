"""The one-token CUDA-core block-FP8 experts (``kernels/fp8/moe_gemv.py``): equal to the
dequantized reference with and without the shared slices, taken by
``moe_experts_fp8_decode`` only for one token of whole scale groups with
``LANEKV_FP8_MOE_GEMV=1``, compiled for sm_90 into 16-byte weight loads without spills,
and on a GPU captured in a CUDA graph that follows the routing on the device."""

from __future__ import annotations

import pytest
import torch
from lanekv.kernels.fp8 import moe_decode
from lanekv.kernels.fp8.moe_decode import (
    moe_experts_fp8_decode,
    moe_experts_fp8_decode_ref,
    moe_experts_fp8_decode_triton,
)
from lanekv.kernels.fp8.moe_gemv import (
    GEMV_ENV,
    MoEGemvTiles,
    gemv_fits,
    gemv_requested,
    moe_experts_fp8_gemv,
)

from tests.kernels.test_fp8_moe_decode import _inputs, _shared, compiled_for_sm90
from tests.markers import requires_gpu

SMALL = MoEGemvTiles(16, 16, 4)  # several column programs at the tests' widths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("top_k,experts,hidden,inter,block,slices", [
    (2, 8, 64, 32, (16, 32), 2),   # two shared slices (V2-Lite's count)
    (3, 5, 96, 48, (16, 16), 0),   # no shared expert, three groups of the width
    (1, 3, 32, 64, (32, 16), 1),   # one choice, wider than the hidden size
])
def test_gemv_equals_the_dequantized_reference(dtype, top_k, experts, hidden, inter, block, slices):
    args = _inputs(1, top_k, experts, hidden, inter, block, seed=hidden, dtype=dtype)
    shared = _shared(hidden, inter, slices, block, seed=inter) if slices else None
    assert gemv_fits(1, inter, hidden, block, SMALL)
    out = moe_experts_fp8_gemv(*args, block, shared=shared, tiles=SMALL)
    ref = moe_experts_fp8_decode_ref(*args, block, shared=shared)
    assert out.shape == ref.shape == (1, hidden) and out.dtype == dtype
    if dtype == torch.float32:  # the same dequantized products: only the sums' order differs
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    else:  # float16 h and per-slot rounding on both sides, in other orders
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_gemv_follows_the_ids_on_the_device():
    x, w13, s13, w2, s2, weights, ids = _inputs(1, 2, 6, 64, 32, (16, 32), seed=3)
    first = moe_experts_fp8_gemv(x, w13, s13, w2, s2, weights, ids, (16, 32), tiles=SMALL)
    ids2 = (ids + 1) % 6
    second = moe_experts_fp8_gemv(x, w13, s13, w2, s2, weights, ids2, (16, 32), tiles=SMALL)
    torch.testing.assert_close(second, moe_experts_fp8_decode_ref(x, w13, s13, w2, s2, weights,
                                                                   ids2, (16, 32)),
                               rtol=1e-4, atol=1e-5)
    assert not torch.equal(first, second)


def test_fits_and_the_switch(monkeypatch: pytest.MonkeyPatch):
    assert gemv_fits(1, 1408, 2048, (128, 128))  # V2-Lite
    assert gemv_fits(1, 2048, 7168, (128, 128))  # V3
    assert not gemv_fits(2, 1408, 2048, (128, 128))  # one token only
    assert not gemv_fits(1, 1400, 2048, (128, 128))  # a ragged last group
    assert not gemv_fits(1, 1408, 2000, (128, 128))
    assert not gemv_fits(1, 64, 64, (16, 16))  # columns of a program across scale blocks
    monkeypatch.delenv(GEMV_ENV, raising=False)
    assert gemv_requested() is True  # on by default since the H200 timed it
    for value, want in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv(GEMV_ENV, value)
        assert gemv_requested() is want
    monkeypatch.setenv(GEMV_ENV, "yes")
    with pytest.raises(ValueError, match="^LANEKV_FP8_MOE_GEMV must be 0 or 1, got 'yes'$"):
        gemv_requested()


@pytest.mark.parametrize("tokens,on,taken", [(1, "1", True), (1, "0", False), (2, "1", False)])
def test_the_decode_launcher_takes_it_for_one_token_when_asked(monkeypatch, tokens, on, taken):
    block = (32, 32)  # the default tiles' 32 columns inside one scale block
    args = _inputs(tokens, 2, 4, 64, 32, block, seed=5)
    calls = []
    real = moe_decode.moe_experts_fp8_gemv
    monkeypatch.setattr(moe_decode, "moe_experts_fp8_gemv",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(GEMV_ENV, on)
    out = moe_experts_fp8_decode_triton(*args, block)
    assert bool(calls) is taken
    torch.testing.assert_close(out, moe_experts_fp8_decode_ref(*args, block), rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(300)
def test_gemv_compiles_for_sm_90_into_vector_loads_without_spills():
    recs = compiled_for_sm90("--gemv")
    assert sorted(r["kernel"] for r in recs) == ["_down_gemv_kernel", "_gate_up_gemv_kernel"]
    for rec in recs:  # CUDA cores only, the e4m3 rows in 16-byte loads
        assert rec["local_bytes"] == 0 and rec["dot_operands"] == [] and rec["vector_loads"] > 0, rec


@requires_gpu
@pytest.mark.parametrize("shared", [False, True])
def test_gpu_gemv_matches_reference_and_captures(shared, monkeypatch):
    monkeypatch.setenv(GEMV_ENV, "1")
    args = _inputs(1, 6, 64, 2048, 1408, (128, 128), device="cuda", dtype=torch.bfloat16)
    x, w13, s13, w2, s2, weights, ids = args
    extra = {"shared": moe_decode.Fp8SharedExpert(
        *(t.cuda() for t in _shared(2048, 1408, 2, (128, 128), 0)))} if shared else {}
    out = moe_experts_fp8_decode(*args, (128, 128), **extra)
    ref = moe_experts_fp8_decode_ref(x.float(), w13, s13, w2, s2, weights, ids, (128, 128), **extra)
    assert (out.float() - ref).norm() <= 0.02 * ref.norm()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_fp8_decode(*args, (128, 128), **extra)
    ids.copy_((ids + 7) % 64)
    graph.replay()
    torch.testing.assert_close(captured, moe_experts_fp8_decode(*args, (128, 128), **extra))
