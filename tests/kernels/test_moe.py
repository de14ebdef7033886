"""moe_experts: the grouped-GEMM Triton kernels (interpreted on CPU) against the torch
reference, and the reference against a plain per-token loop over each token's experts."""

import pytest
import torch
import torch.nn.functional as F
from lanekv.kernels.moe.experts import MoETiles, moe_experts, moe_experts_ref, moe_experts_triton

from tests.markers import requires_gpu


def _inputs(tokens, top_k, experts, hidden, inter, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if (
        tokens) else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


def _per_token(x, w13, w2, weights, ids):
    """Each token through each of its experts, one at a time (the unfused modules' ops)."""
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t:t + 1], w13[e, :inter]), F.linear(x[t:t + 1], w13[e, inter:])
            y = F.linear(F.silu(gate) * up, w2[e])
            out[t] += (y[0] * weights[t, j]).to(x.dtype)
    return out


@pytest.mark.parametrize("tokens,top_k,experts", [(1, 2, 8), (7, 3, 8), (40, 2, 4)])
def test_reference_equals_per_token_loop(tokens, top_k, experts):
    args = _inputs(tokens, top_k, experts, 24, 20, torch.float32, seed=tokens)
    torch.testing.assert_close(moe_experts_ref(*args), _per_token(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter", [
    (1, 2, 8, 32, 24),  # decode: one token, most experts idle
    (5, 3, 6, 40, 16),  # dims off the tiles
    (37, 2, 4, 32, 48),  # several row blocks per expert
])
def test_triton_matches_reference(dtype, tol, tokens, top_k, experts, hidden, inter):
    args = _inputs(tokens, top_k, experts, hidden, inter, dtype, seed=tokens)
    torch.testing.assert_close(moe_experts_triton(*args), moe_experts_ref(*args), rtol=tol,
                               atol=tol)


def test_skewed_routing_and_empty_batch():
    """Every token on the same two experts: one expert's rows span many row blocks
    while the others have none; no tokens gives zeros."""
    x, w13, w2, weights, _ = _inputs(45, 2, 8, 16, 16, torch.float32, seed=3)
    ids = torch.tensor([[5, 1]] * 45)
    torch.testing.assert_close(moe_experts_triton(x, w13, w2, weights, ids),
                               moe_experts_ref(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    empty = _inputs(0, 2, 4, 16, 16, torch.float32)
    assert moe_experts_triton(*empty).shape == (0, 16)
    assert moe_experts_ref(*empty).shape == (0, 16)


@pytest.mark.parametrize("impl", [moe_experts_ref, moe_experts_triton])
def test_skipped_pairs_leave_the_real_ones_bit_for_bit(impl):
    """Pairs of id -1 (the capturable EP dispatch's padding, one pair a row) sort last and
    join no expert's rows: every real pair's output has the bits of the same batch without
    them; the reference adds nothing for them, and a token of k > 1 with one -1 choice
    sums its other choices."""
    x, w13, w2, weights, ids = _inputs(30, 1, 5, 24, 20, torch.float32, seed=4)
    skipped = torch.arange(30) % 3 == 1
    ids = torch.where(skipped[:, None], -1, ids)
    keep = ~skipped
    got = impl(x, w13, w2, weights, ids)
    assert torch.equal(got[keep], impl(x[keep], w13, w2, weights[keep], ids[keep]))
    if impl is moe_experts_ref:
        assert not got[skipped].any()
    pairs = _inputs(6, 2, 5, 24, 20, torch.float32, seed=5)
    pairs[4][:, 1] = -1
    want = moe_experts_ref(pairs[0], pairs[1], pairs[2], pairs[3][:, :1], pairs[4][:, :1])
    assert torch.equal(moe_experts_ref(*pairs), want)


def test_explicit_tiles_and_dispatcher(monkeypatch: pytest.MonkeyPatch):
    args = _inputs(9, 2, 4, 24, 40, torch.float32, seed=9)
    want = moe_experts_ref(*args)
    got = moe_experts_triton(*args, config=MoETiles(32, 32, 16, 4, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    torch.testing.assert_close(moe_experts(*args), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    ({"x": torch.zeros(4, 16, dtype=torch.int32)}, "x.dtype"),
    ({"x": torch.zeros(4)}, "x must be a 2-D"),
    ({"w13": torch.zeros(4, 31, 16)}, "w13 must be"),
    ({"w2": torch.zeros(4, 16, 8)}, "w2 must be"),
    ({"w2": torch.zeros(4, 16, 16, dtype=torch.float16)}, "w2.dtype"),
    ({"ids": torch.zeros(4, 2, dtype=torch.int32)}, "ids must be an int64"),
    ({"ids": torch.full((4, 2), 4)}, "ids holds expert 4"),
    ({"ids": torch.full((4, 2), -2)}, "ids holds expert -2"),
    ({"weights": torch.zeros(4, 3)}, "weights must be"),
])
@pytest.mark.parametrize("impl", [moe_experts_ref, moe_experts_triton])
def test_bad_arguments_are_named(impl, change, match):
    args = {"x": torch.zeros(4, 16), "w13": torch.zeros(4, 32, 16), "w2": torch.zeros(4, 16, 16),
            "weights": torch.zeros(4, 2), "ids": torch.zeros(4, 2, dtype=torch.int64)}
    args.update(change)
    with pytest.raises(ValueError, match=match):
        impl(**args)


@requires_gpu
@pytest.mark.parametrize("tokens", [1, 16, 64, 2048])
def test_gpu_bf16_v2_lite_shapes(tokens):
    """DeepSeek-V2-Lite's experts (64 x 2048 -> 1408, top 6) at decode and prefill sizes."""
    args = _inputs(tokens, 6, 64, 2048, 1408, torch.bfloat16, seed=tokens, device="cuda")
    want = moe_experts_ref(*(a.float() if a.is_floating_point() else a for a in args))
    got = moe_experts_triton(*args).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2


@requires_gpu
def test_gpu_captured_in_a_cuda_graph():
    """No host sync: the whole op captures, and a replay with other routing and inputs
    (copied into the captured buffers) gives the reference's result."""
    x, w13, w2, weights, ids = _inputs(16, 6, 64, 256, 128, torch.bfloat16, seed=1, device="cuda")
    moe_experts_triton(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts_triton(x, w13, w2, weights, ids)
    x2, _, _, weights2, ids2 = _inputs(16, 6, 64, 256, 128, torch.bfloat16, seed=2, device="cuda")
    ids2[:8] = torch.tensor([3, 9, 17, 33, 40, 63], device="cuda")  # crowd a few experts
    x.copy_(x2)
    weights.copy_(weights2)
    ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(out, moe_experts_ref(x, w13, w2, weights, ids), rtol=2e-2,
                               atol=2e-2)
