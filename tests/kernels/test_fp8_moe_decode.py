"""moe_experts_fp8_decode: the sort-free decode kernels on block-FP8 expert weights
(interpreted on CPU) against the dequantized-weight reference, with repeated experts,
a block's edge inside the tiles and odd sizes; on the GPU at DeepSeek-V2-Lite's shapes
in bfloat16 and inside a CUDA graph."""

import pytest
import torch
from lanekv.kernels.fp8.moe_decode import (
    moe_experts_fp8_decode,
    moe_experts_fp8_decode_ref,
    moe_experts_fp8_decode_triton,
)
from lanekv.kernels.fp8.weights import quantize_weight_blocks
from lanekv.kernels.moe.decode import MAX_DECODE_TOKENS, DecodeTiles

from tests.markers import requires_gpu


def _inputs(tokens, top_k, experts, hidden, inter, block, seed=0, device="cpu", dtype=torch.float32,
            repeat=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13, s13 = quantize_weight_blocks(torch.randn(experts, 2 * inter, hidden, generator=gen)
                                      * hidden ** -0.5, block)
    w2, s2 = quantize_weight_blocks(torch.randn(experts, hidden, inter, generator=gen)
                                    * inter ** -0.5, block)
    if repeat:  # every token on the same experts: one program runs all their rows
        ids = torch.arange(top_k).repeat(tokens, 1)
    else:
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if (
            tokens) else torch.zeros(0, top_k, dtype=torch.int64)
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x, w13, s13, w2, s2, weights, ids)]


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,block,repeat", [
    (1, 2, 8, 64, 32, (16, 32), False),   # batch 1
    (5, 3, 6, 100, 48, (16, 16), False),  # hidden not a multiple of the tile or the block
    (3, 2, 4, 48, 32, (32, 16), True),    # several rows per expert
    (0, 2, 4, 32, 16, (16, 16), False),
])
def test_fp8_decode_kernels_equal_the_dequantized_reference(tokens, top_k, experts, hidden, inter, block,
                                                            repeat):
    args = _inputs(tokens, top_k, experts, hidden, inter, block, seed=tokens, repeat=repeat)
    out = moe_experts_fp8_decode_triton(*args, block)
    ref = moe_experts_fp8_decode_ref(*args, block)
    assert out.shape == ref.shape == (tokens, hidden)
    # float32 rows and weights dequantized the same way: only the sums' order differs
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_fp8_decode_refuses_tiles_across_blocks_and_batches_past_its_limit():
    args = _inputs(2, 2, 4, 32, 16, (16, 16))
    with pytest.raises(ValueError, match="must divide the weight block"):
        moe_experts_fp8_decode_triton(*args, (16, 16), config=DecodeTiles(16, 32, 16, 4, 1))
    big = _inputs(MAX_DECODE_TOKENS + 1, 2, 4, 32, 16, (16, 16))
    with pytest.raises(ValueError, match="at most"):
        moe_experts_fp8_decode(*big, (16, 16))


@requires_gpu
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_gpu_fp8_decode_matches_reference_and_captures(tokens):
    # DeepSeek-V2-Lite's experts: 64, top 6, hidden 2048, intermediate 1408 (11 blocks)
    args = _inputs(tokens, 6, 64, 2048, 1408, (128, 128), device="cuda", dtype=torch.bfloat16)
    x, w13, s13, w2, s2, weights, ids = args
    out = moe_experts_fp8_decode_triton(*args, (128, 128))
    ref = moe_experts_fp8_decode_ref(x.float(), w13, s13, w2, s2, weights, ids, (128, 128))
    assert (out.float() - ref).norm() <= 0.02 * ref.norm()  # bf16 rounding of each product only
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_fp8_decode_triton(*args, (128, 128))
    ids.copy_(ids.roll(1, 0))
    graph.replay()
    torch.testing.assert_close(captured, moe_experts_fp8_decode_triton(*args, (128, 128)))
