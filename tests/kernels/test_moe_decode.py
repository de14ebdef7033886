"""moe_experts_decode: the sort-free decode kernels (interpreted on CPU) against their
per-pair torch reference, the reference against the grouped-GEMM reference plus a plain
shared SwiGLU, and on the GPU against both in bfloat16 and inside a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F
from lanekv.kernels.moe.decode import (
    DECODE_TILE_TABLE,
    DOWN,
    GATE_UP,
    TOKEN_BUCKETS,
    DecodeTiles,
    decode_tiles,
    moe_experts_decode,
    moe_experts_decode_ref,
    moe_experts_decode_triton,
    table_tiles,
    token_bucket,
)
from lanekv.kernels.moe.experts import moe_experts_ref

from tests.markers import requires_gpu


def _inputs(tokens, top_k, experts, hidden, inter, shared, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if (
        tokens) else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=gen)
    sw13 = (torch.randn(2 * shared * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    sw2 = (torch.randn(hidden, shared * inter, generator=gen) * max(1, shared * inter) ** -0.5).to(dtype)
    args = [t.to(device) for t in (x, w13, w2, weights, ids)]
    extra = {"shared_w13": sw13.to(device), "shared_w2": sw2.to(device)} if shared else {}
    return args, extra


def _grouped_plus_shared(args, extra):
    out = moe_experts_ref(*args).float()
    if extra:
        gate, up = F.linear(args[0], extra["shared_w13"]).chunk(2, dim=-1)
        out += F.linear(F.silu(gate) * up, extra["shared_w2"]).float()
    return out.to(args[0].dtype)


@pytest.mark.parametrize("tokens,top_k,experts,shared", [(1, 2, 8, 0), (3, 3, 8, 2), (6, 2, 5, 1)])
def test_reference_equals_grouped_reference(tokens, top_k, experts, shared):
    args, extra = _inputs(tokens, top_k, experts, 24, 20, shared, torch.float32, seed=tokens)
    torch.testing.assert_close(moe_experts_decode_ref(*args, **extra),
                               _grouped_plus_shared(args, extra), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,shared", [
    (1, 2, 8, 64, 40, 0),  # batch 1, most experts idle
    (1, 3, 8, 96, 40, 2),  # batch 1 with two shared slices
    (5, 3, 8, 64, 40, 1),  # odd batch
    (13, 2, 8, 96, 40, 1),  # an expert with more pairs than one row block (16)
])
def test_triton_matches_reference(dtype, tol, tokens, top_k, experts, hidden, inter, shared):
    args, extra = _inputs(tokens, top_k, experts, hidden, inter, shared, dtype, seed=tokens + shared)
    torch.testing.assert_close(moe_experts_decode_triton(*args, **extra),
                               moe_experts_decode_ref(*args, **extra), rtol=tol, atol=tol)


def test_skewed_routing_spans_row_blocks_and_empty_batch():
    """All 21 tokens on experts 5 and 1 (21 pairs each, two row blocks of 16); other
    experts idle. No tokens gives an empty result."""
    (x, w13, w2, weights, _), extra = _inputs(21, 2, 8, 32, 24, 1, torch.float32, seed=3)
    ids = torch.tensor([[5, 1]] * 21)
    torch.testing.assert_close(moe_experts_decode_triton(x, w13, w2, weights, ids, **extra),
                               moe_experts_decode_ref(x, w13, w2, weights, ids, **extra),
                               rtol=1e-5, atol=1e-5)
    empty, _ = _inputs(0, 2, 4, 16, 16, 0, torch.float32)
    assert moe_experts_decode_triton(*empty).shape == (0, 16)


def test_explicit_tiles_and_dispatcher(monkeypatch: pytest.MonkeyPatch):
    args, extra = _inputs(4, 3, 8, 64, 40, 2, torch.float32, seed=9)
    want = moe_experts_decode_ref(*args, **extra)
    got = moe_experts_decode_triton(*args, **extra, config=DecodeTiles(16, 32, 32, 4, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    torch.testing.assert_close(moe_experts_decode(*args, **extra), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,shared", [
    (2, 3, 7, 72, 24, 3),  # three shared slices, an odd expert count, hidden 4.5 blocks
    (1, 1, 3, 17, 9, 1),  # top 1, widths off every block
])
def test_odd_sizes_with_separate_tiles(tokens, top_k, experts, hidden, inter, shared):
    """Gate/up and down on different tiles (as DECODE_TILE_TABLE may give them)."""
    args, extra = _inputs(tokens, top_k, experts, hidden, inter, shared, torch.float32, seed=7)
    got = moe_experts_decode_triton(*args, **extra, config=DecodeTiles(16, 16, 32, 4, 1),
                                    down_config=DecodeTiles(16, 32, 16, 4, 1))
    torch.testing.assert_close(got, moe_experts_decode_ref(*args, **extra), rtol=1e-5, atol=1e-5)


def test_tile_table_and_buckets():
    assert [token_bucket(t) for t in (1, 2, 4, 5, 16, 17, 64)] == [1, 4, 4, 16, 16, 64, 64]
    assert TOKEN_BUCKETS[-1] == 64 and list(TOKEN_BUCKETS) == sorted(TOKEN_BUCKETS)
    for (kernel, bucket, n, k), tiles in DECODE_TILE_TABLE.items():
        assert kernel in (GATE_UP, DOWN) and bucket in TOKEN_BUCKETS
        inter, hidden = (n, k) if kernel == GATE_UP else (k, n)
        assert table_tiles(kernel, bucket, inter, hidden) == tiles
        assert tiles.block_m >= 16 and tiles.block_n >= 16 and tiles.block_k >= 16
    # DeepSeek-V2-Lite's shapes are listed for every bucket of the model's decode batches
    for tokens in (1, 2, 3, 4, 8, 16):
        for kernel in (GATE_UP, DOWN):
            assert table_tiles(kernel, tokens, 1408, 2048) is not None
    assert table_tiles(GATE_UP, 1, 2048, 7168) is None  # V3: the default tiles
    with pytest.raises(ValueError, match="kernel='up'"):
        table_tiles("up", 1, 1408, 2048)
    # the interpreter keeps its small tiles whatever the table says
    x = torch.zeros(1, 2048)
    assert decode_tiles(x, GATE_UP, 8, 1408, 2048) == DecodeTiles(16, 16, 16, 4, 1)


@pytest.mark.parametrize("change,match", [
    ({"shared_w13": torch.zeros(80, 64)}, "shared_w13 and shared_w2 go together"),
    ({"shared_w13": torch.zeros(80, 64), "shared_w2": torch.zeros(64, 30)}, "shared_w2 must be"),
    ({"shared_w13": torch.zeros(81, 64), "shared_w2": torch.zeros(64, 40)}, "shared_w13 must be"),
    ({"shared_w13": torch.zeros(80, 64, dtype=torch.float16),
      "shared_w2": torch.zeros(64, 40)}, "shared_w13.dtype"),
])
def test_bad_shared_weights_are_refused(change, match):
    args, _ = _inputs(2, 2, 8, 64, 40, 0, torch.float32)
    with pytest.raises(ValueError, match=match):
        moe_experts_decode_triton(*args, **change)
    with pytest.raises(ValueError, match=match):
        moe_experts_decode_ref(*args, **change)


def test_too_many_tokens_are_refused():
    args, _ = _inputs(65, 2, 8, 16, 16, 0, torch.float32)
    with pytest.raises(ValueError, match="65 tokens, more than the 64"):
        moe_experts_decode_triton(*args)


@requires_gpu
@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,shared", [
    (1, 6, 64, 2048, 1408, 2),  # DeepSeek-V2-Lite: the table's tiles at each bucket
    (3, 6, 64, 2048, 1408, 2),
    (13, 6, 64, 2048, 1408, 2),
    (16, 8, 256, 1024, 256, 1),
    (64, 6, 64, 2048, 1408, 2),
])
def test_gpu_bf16_matches_and_captures(tokens, top_k, experts, hidden, inter, shared):
    args, extra = _inputs(tokens, top_k, experts, hidden, inter, shared, torch.bfloat16,
                          seed=tokens, device="cuda")
    want = _grouped_plus_shared([a.cpu().float() if a.is_floating_point() else a.cpu() for a in args],
                                {k: v.cpu().float() for k, v in extra.items()})
    got = moe_experts_decode_triton(*args, **extra)
    # bf16 outputs of sums over up to 8 experts: a few bf16 steps apart at most (the H200 showed
    # one element of 131072 at 0.022 with top-6 of 64 experts).
    torch.testing.assert_close(got.float().cpu(), want, rtol=2e-2, atol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_decode_triton(*args, **extra)
    args[4].copy_(torch.roll(args[4], 1, dims=0))  # new routing, same shapes
    args[3].copy_(torch.roll(args[3], 1, dims=0))
    graph.replay()
    torch.testing.assert_close(captured, moe_experts_decode_triton(*args, **extra), rtol=0, atol=0)
