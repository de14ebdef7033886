"""moe_experts_fp8_decode: the routed experts of a few tokens with block-FP8 expert weights.

The operation and the inputs of ``kernels.fp8.experts.moe_experts_fp8`` (``w13 [E, 2I, H]``
and ``w2 [E, H, I]`` in e4m3 with one float32 scale per ``block`` of weights), for
decode batches (at most ``kernels.moe.decode.MAX_DECODE_TOKENS`` tokens): the scheme of
``kernels.moe.decode`` (a slot per routing pair, the expert's first pair runs it, no sort,
three launches, captured in a CUDA graph: the same kernels, with their e4m3 switch on),
reading each touched expert's e4m3 weights once, half the bytes of the bf16 experts.

The activations stay in x's dtype: each weight tile is dequantized in the kernel (e4m3
times its block's scale, rounded to x's dtype, as ``dequantize_weight_blocks`` does)
and multiplied with the unquantized rows. So this is ``moe_experts_fp8_ref``'s
operation (the dequantized weights against unquantized activations; transformers runs
FP8 checkpoints the same way), to the accumulation order, and there are no activation
scales (``scale_ue8m0`` is about those: the grouped path takes it, this one has none).
At a decode batch the weights' bytes are the cost; the activations are a few rows.

The shared experts, block-FP8 as well (``shared_w13 [2SI, H]``, ``shared_w2 [H, SI]`` and
their block scales: the fused gate/up and the down projection of the shared SwiGLU), run
in the same three launches as ``S`` more slices of width ``I``, as in ``kernels.moe.decode``,
where ``I`` spans whole scale blocks both ways (each slice's tiles then lie in its own
blocks). Run apart they took six more launches a layer at V2-Lite's shapes (the gate/up
GEMM and its split-K reduction, the product's quantization, the down GEMM and its
reduction, the add; bench/notes_deepseek_decode.md).

One token takes ``moe_gemv.py``'s CUDA-core GEMVs instead (same three launches, same
slots; 1.57x faster at V2-Lite's shapes on an H200), unless ``LANEKV_FP8_MOE_GEMV=0``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import triton
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.experts import _check_args
from lanekv.kernels.fp8.gemm import check_fp8_weight
from lanekv.kernels.fp8.moe_gemv import gemv_fits, gemv_requested, moe_experts_fp8_gemv
from lanekv.kernels.fp8.weights import dequantize_weight_blocks
from lanekv.kernels.moe.decode import (
    DOWN,
    GATE_UP,
    MAX_DECODE_TOKENS,
    DecodeTiles,
    _decode_combine_kernel,
    default_decode_tiles,
    launch_decode_down,
    launch_decode_gate_up,
    moe_experts_decode_ref,
    table_tiles,
)
from lanekv.kernels.pdl import pdl_args

# Tiles by (kernel, token bucket, N, K) for e4m3 experts of 128 x 128 scale blocks on a
# GPU; N is the GEMM's output width, K its reduction (as ``kernels.moe.decode``'s table).
# The winners of bench/moe_decode_sweep.py --fp8 on one H200 over the default tiles
# (V2-Lite shapes: 6 routed experts and 2 shared slices; BENCHMARKS.md, tenth session);
# at batch 1 the default gate/up tiles won.
FP8_DECODE_TILE_TABLE: Mapping[tuple[str, int, int, int], DecodeTiles] = MappingProxyType({
    (GATE_UP, 16, 1408, 2048): DecodeTiles(16, 64, 64, 4, 3),
    (DOWN, 1, 2048, 1408): DecodeTiles(16, 64, 64, 4, 3),
    (DOWN, 16, 2048, 1408): DecodeTiles(16, 64, 128, 4, 3),
})


def fp8_decode_tiles(x: torch.Tensor, kernel: str, active: int, inter: int, hidden: int,
                     block: tuple[int, int]) -> DecodeTiles:
    """The tiles of ``kernel`` (GATE_UP or DOWN): ``FP8_DECODE_TILE_TABLE``'s entry for the
    batch's token bucket and the kernel's (N, K) where there is one (a GPU, 128 x 128
    blocks), else ``kernels.moe.decode``'s default; each tile inside one scale block."""
    listed = table_tiles(kernel, x.shape[0], inter, hidden, FP8_DECODE_TILE_TABLE)
    if not (x.is_cuda and tuple(block) == (128, 128)):
        listed = None  # the table's tiles were timed on a GPU at 128 x 128 blocks
    cfg = listed or default_decode_tiles(x, active, inter, hidden)
    return cfg._replace(block_n=min(cfg.block_n, block[0]), block_k=min(cfg.block_k, block[1]))


class Fp8SharedExpert(NamedTuple):
    """The shared SwiGLU in block FP8: ``w13 [2SI, H]`` (gate rows, then up rows) and
    ``w2 [H, SI]`` e4m3, with their float32 block scales."""

    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor


def shared_fits(inter: int, width: int, block: tuple[int, int]) -> bool:
    """Whether a shared SwiGLU of ``width`` runs as slices of routed width ``inter``:
    whole slices, each starting a scale block along both of its GEMMs' dims."""
    return width > 0 and width % inter == 0 and inter % block[0] == 0 and inter % block[1] == 0


def _check_decode(x: torch.Tensor, w13, s13, w2, s2, weights, ids, block,
                  shared: Fp8SharedExpert | None) -> int:
    """The checks of ``moe_experts_fp8``, the batch limit and the shared expert; the
    number of shared slices (0 without one)."""
    _check_args(x, w13, s13, w2, s2, weights, ids, block)
    if x.shape[0] > MAX_DECODE_TOKENS:
        raise ValueError(f"x has {x.shape[0]} tokens; the decode kernels take at most "
                         f"{MAX_DECODE_TOKENS} (larger batches: moe_experts_fp8)")
    if shared is None:
        return 0
    if not isinstance(shared, Fp8SharedExpert):
        raise ValueError(f"shared must be an Fp8SharedExpert, got {type(shared).__name__}")
    hidden, inter = x.shape[1], w13.shape[1] // 2
    width = shared.w2.shape[1] if shared.w2.dim() == 2 else 0
    if shared.w2.dim() != 2 or shared.w2.shape[0] != hidden or not shared_fits(
            inter, width, tuple(block)):
        raise ValueError(f"shared.w2 must be [{hidden}, S * {inter}] with {inter} a multiple of "
                         f"both block dims {tuple(block)}, got {tuple(shared.w2.shape)}")
    if tuple(shared.w13.shape) != (2 * width, hidden):
        raise ValueError(f"shared.w13 must be [{2 * width}, {hidden}], got {tuple(shared.w13.shape)}")
    check_fp8_weight(shared.w13, shared.s13, tuple(block), "shared.w13")
    check_fp8_weight(shared.w2, shared.s2, tuple(block), "shared.w2")
    check_same_device(x=x, shared_w13=shared.w13, shared_s13=shared.s13, shared_w2=shared.w2,
                      shared_s2=shared.s2)
    return width // inter


def moe_experts_fp8_decode_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                                  w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                                  ids: torch.Tensor, block: tuple[int, int], *,
                                  shared: Fp8SharedExpert | None = None,
                                  config: DecodeTiles | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` overrides both kernels' tiles (each must lie in one
    scale block)."""
    slices = _check_decode(x, w13, s13, w2, s2, weights, ids, block, shared)
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    if config is None and gemv_requested() and gemv_fits(tokens, inter, hidden, tuple(block)):
        return moe_experts_fp8_gemv(x, w13, s13, w2, s2, weights, ids, tuple(block), shared=shared)
    active = min(experts, top_k) + slices
    up_cfg, down_cfg = (config, config) if config is not None else (
        fp8_decode_tiles(x, kernel, active, inter, hidden, tuple(block)) for kernel in (GATE_UP, DOWN))
    for cfg in (up_cfg, down_cfg):
        if block[0] % cfg.block_n or block[1] % cfg.block_k:
            raise ValueError(f"config.block_n={cfg.block_n} and config.block_k={cfg.block_k} "
                             f"must divide the weight block {tuple(block)}")
    ids = ids.contiguous()
    sw13, ss13, sw2, ss2 = shared if shared is not None else (None,) * 4
    h = launch_decode_gate_up(x, w13, ids, sw13, up_cfg, scales=s13, block=tuple(block),
                              shared_scales=ss13)
    y = launch_decode_down(x, h, w2, ids, weights, sw2, down_cfg, scales=s2, block=tuple(block),
                           shared_scales=ss2)
    out = torch.empty_like(x)
    combine = min(1024, max(16, triton.next_power_of_2(hidden)))
    _decode_combine_kernel[(tokens, triton.cdiv(hidden, combine))](
        y, out, tokens, hidden, y.stride(0), out.stride(0), TOP_K=top_k, SHARED=slices,
        BLOCK=combine, **pdl_args(y),
    )
    return out


def moe_experts_fp8_decode_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                               w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                               ids: torch.Tensor, block: tuple[int, int], *,
                               shared: Fp8SharedExpert | None = None,
                               config: DecodeTiles | None = None) -> torch.Tensor:
    """``moe_experts_decode_ref`` on the dequantized weights, activations unquantized
    (``config``: how the kernel runs, not what it computes)."""
    _check_decode(x, w13, s13, w2, s2, weights, ids, block, shared)
    block = tuple(block)
    extra = {} if shared is None else {
        "shared_w13": dequantize_weight_blocks(shared.w13, shared.s13, block, x.dtype),
        "shared_w2": dequantize_weight_blocks(shared.w2, shared.s2, block, x.dtype)}
    return moe_experts_decode_ref(x, dequantize_weight_blocks(w13, s13, block, x.dtype),
                                  dequantize_weight_blocks(w2, s2, block, x.dtype), weights, ids,
                                  **extra)


def moe_experts_fp8_decode(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                           w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, block: tuple[int, int], *,
                           shared: Fp8SharedExpert | None = None,
                           config: DecodeTiles | None = None) -> torch.Tensor:
    """The routed experts (and the shared one) of a few tokens (see the module doc)."""
    run = moe_experts_fp8_decode_triton if use_triton(x) else moe_experts_fp8_decode_ref
    return run(x, w13, s13, w2, s2, weights, ids, block, shared=shared, config=config)
