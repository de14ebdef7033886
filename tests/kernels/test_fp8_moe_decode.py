"""moe_experts_fp8_decode: the sort-free decode kernels on block-FP8 expert weights
(interpreted on CPU) against the dequantized-weight reference, with repeated experts,
a block's edge inside the tiles and odd sizes; on the GPU at DeepSeek-V2-Lite's shapes
in bfloat16 and inside a CUDA graph."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lanekv.kernels.fp8.moe_decode import (
    FP8_DECODE_TILE_TABLE,
    Fp8SharedExpert,
    fp8_decode_tiles,
    moe_experts_fp8_decode,
    moe_experts_fp8_decode_ref,
    moe_experts_fp8_decode_triton,
)
from lanekv.kernels.fp8.weights import quantize_weight_blocks
from lanekv.kernels.moe.decode import DOWN, GATE_UP, MAX_DECODE_TOKENS, DecodeTiles

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


def _shared(hidden, inter, slices, block, seed):
    gen = torch.Generator().manual_seed(seed + 100)
    w13, s13 = quantize_weight_blocks(torch.randn(2 * slices * inter, hidden, generator=gen)
                                      * hidden ** -0.5, block)
    w2, s2 = quantize_weight_blocks(torch.randn(hidden, slices * inter, generator=gen)
                                    * (slices * inter) ** -0.5, block)
    return Fp8SharedExpert(w13, s13, w2, s2)


@pytest.mark.parametrize("tokens,top_k,experts,hidden,inter,block,slices", [
    (1, 2, 8, 64, 32, (16, 32), 2),  # batch 1, two shared slices (V2-Lite's count)
    (4, 3, 5, 40, 32, (16, 16), 1),  # hidden ends inside a block; experts picked twice
])
def test_fp8_decode_fuses_the_block_fp8_shared_expert(tokens, top_k, experts, hidden, inter, block,
                                                      slices):
    args = _inputs(tokens, top_k, experts, hidden, inter, block, seed=tokens)
    shared = _shared(hidden, inter, slices, block, seed=tokens)
    out = moe_experts_fp8_decode_triton(*args, block, shared=shared)
    ref = moe_experts_fp8_decode_ref(*args, block, shared=shared)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # the shared part is really there: the routed experts alone differ from it
    alone = moe_experts_fp8_decode_ref(*args, block)
    assert (alone - ref).abs().max() > 1e-2


def test_fp8_decode_refuses_a_shared_expert_across_blocks():
    args = _inputs(2, 2, 4, 32, 16, (16, 16))
    ragged = _shared(32, 16, 1, (16, 16), seed=0)._replace(
        w2=torch.zeros(32, 24, dtype=torch.float8_e4m3fn))  # 1.5 slices
    with pytest.raises(ValueError, match="shared.w2 must be"):
        moe_experts_fp8_decode_triton(*args, (16, 16), shared=ragged)
    # inter 16 spans whole 16-row blocks but not the 32-wide k blocks of the down GEMM
    args = _inputs(2, 2, 4, 32, 16, (16, 32))
    with pytest.raises(ValueError, match="multiple of both block dims"):
        moe_experts_fp8_decode_ref(*args, (16, 32), shared=_shared(32, 16, 2, (16, 32), seed=0))


def test_fp8_decode_refuses_tiles_across_blocks_and_batches_past_its_limit():
    args = _inputs(2, 2, 4, 32, 16, (16, 16))
    with pytest.raises(ValueError, match="must divide the weight block"):
        moe_experts_fp8_decode_triton(*args, (16, 16), config=DecodeTiles(16, 32, 16, 4, 1))
    big = _inputs(MAX_DECODE_TOKENS + 1, 2, 4, 32, 16, (16, 16))
    with pytest.raises(ValueError, match="at most"):
        moe_experts_fp8_decode(*big, (16, 16))


@requires_gpu
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_gpu_fp8_decode_matches_reference_and_captures(tokens, shared):
    # DeepSeek-V2-Lite's experts: 64, top 6, hidden 2048, intermediate 1408 (11 blocks),
    # two shared slices
    args = _inputs(tokens, 6, 64, 2048, 1408, (128, 128), device="cuda", dtype=torch.bfloat16)
    x, w13, s13, w2, s2, weights, ids = args
    extra = {"shared": Fp8SharedExpert(*(t.cuda() for t in _shared(2048, 1408, 2, (128, 128), 0)))
             } if shared else {}
    out = moe_experts_fp8_decode_triton(*args, (128, 128), **extra)
    ref = moe_experts_fp8_decode_ref(x.float(), w13, s13, w2, s2, weights, ids, (128, 128), **extra)
    assert (out.float() - ref).norm() <= 0.02 * ref.norm()  # bf16 rounding of each product only
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_experts_fp8_decode_triton(*args, (128, 128), **extra)
    ids.copy_(ids.roll(1, 0))
    graph.replay()
    torch.testing.assert_close(captured, moe_experts_fp8_decode_triton(*args, (128, 128), **extra))


def compiled_for_sm90(flag: str) -> list[dict]:
    """``bench/fp8_moe_decode_compile.py FLAG``'s records (the interpreter off, a process
    of its own)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "bench" / "fp8_moe_decode_compile.py"),
                           flag], env=env, capture_output=True, text=True, timeout=280, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_grouped_fp8_experts_compile_for_sm_90_with_scale_groups_of_16():
    """The grouped (prefill-size) FP8 expert kernels compiled for sm_90 offline: with the
    tiny test checkpoints' 16-wide scale groups Triton refuses an fp8 dot (K >= 32), so
    their dots are widened to float16 in the kernel (exact for e4m3 values) and compile
    at K = 16. An H200 found that case failing in an FP8 DeepSeek's decode warm-up."""
    recs = compiled_for_sm90("--grouped")
    assert sorted((r["kernel"], r["block_k"]) for r in recs) == [
        ("_fp8_down_kernel", 16), ("_fp8_down_kernel", 128),
        ("_fp8_gate_up_kernel", 16), ("_fp8_gate_up_kernel", 128)]
    for rec in recs:
        assert rec["local_bytes"] == 0 and rec["dot_operands"], rec
        assert all(d in (["f16", "f16"], ["f8E4M3FN", "f8E4M3FN"]) for d in rec["dot_operands"]), rec


def test_fp8_decode_tiles_take_the_measured_table_per_kernel_and_bucket(monkeypatch):
    """On a GPU with 128 x 128 blocks the table's tiles for the kernel and the batch's
    token bucket (V2-Lite shapes), else ``kernels.moe.decode``'s default, cut to one
    scale block; on the CPU the interpreter's small tiles."""
    class Props:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props())

    class OnGpu:  # what fp8_decode_tiles reads of x
        is_cuda, device, dtype = True, torch.device("cuda"), torch.bfloat16

        def __init__(self, tokens: int):
            self.shape = (tokens, 2048)

    args = (8, 1408, 2048, (128, 128))
    assert fp8_decode_tiles(OnGpu(1), DOWN, *args) == FP8_DECODE_TILE_TABLE[(DOWN, 1, 2048, 1408)]
    for tokens in (5, 16):  # the bucket of 16
        assert fp8_decode_tiles(OnGpu(tokens), GATE_UP, *args) == DecodeTiles(16, 64, 64, 4, 3)
        assert fp8_decode_tiles(OnGpu(tokens), DOWN, *args) == DecodeTiles(16, 64, 128, 4, 3)
    default = fp8_decode_tiles(OnGpu(1), GATE_UP, *args)  # not listed: the default
    assert default == DecodeTiles(16, 32, 128, 4, 4)
    assert fp8_decode_tiles(OnGpu(1), DOWN, 8, 1408, 2048, (64, 64)).block_k == 64  # not listed
    assert fp8_decode_tiles(torch.zeros(1, 2048), DOWN, *args) == DecodeTiles(16, 16, 16, 4, 1)
    with pytest.raises(ValueError, match="kernel='up' must be 'gate_up' or 'down'"):
        fp8_decode_tiles(OnGpu(1), "up", *args)
