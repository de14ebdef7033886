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
"""

from __future__ import annotations

import torch
import triton
from lanekv.kernels.backend import use_triton
from lanekv.kernels.fp8.experts import _check_args, moe_experts_fp8_ref
from lanekv.kernels.moe.decode import (
    MAX_DECODE_TOKENS,
    DecodeTiles,
    _decode_combine_kernel,
    default_decode_tiles,
    launch_decode_down,
    launch_decode_gate_up,
)
from lanekv.kernels.pdl import pdl_args


def fp8_decode_tiles(x: torch.Tensor, active: int, inter: int, hidden: int,
                     block: tuple[int, int]) -> DecodeTiles:
    """``kernels.moe.decode``'s tiles, each inside one scale block (one scale per tile)."""
    cfg = default_decode_tiles(x, active, inter, hidden)
    return cfg._replace(block_n=min(cfg.block_n, block[0]), block_k=min(cfg.block_k, block[1]))


def _check_decode(x: torch.Tensor, w13, s13, w2, s2, weights, ids, block) -> None:
    _check_args(x, w13, s13, w2, s2, weights, ids, block)
    if x.shape[0] > MAX_DECODE_TOKENS:
        raise ValueError(f"x has {x.shape[0]} tokens; the decode kernels take at most "
                         f"{MAX_DECODE_TOKENS} (larger batches: moe_experts_fp8)")


def moe_experts_fp8_decode_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                                  w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                                  ids: torch.Tensor, block: tuple[int, int], *,
                                  config: DecodeTiles | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the tiles (each must lie in one scale block)."""
    _check_decode(x, w13, s13, w2, s2, weights, ids, block)
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    cfg = config or fp8_decode_tiles(x, min(experts, top_k), inter, hidden, tuple(block))
    if block[0] % cfg.block_n or block[1] % cfg.block_k:
        raise ValueError(f"config.block_n={cfg.block_n} and config.block_k={cfg.block_k} must "
                         f"divide the weight block {tuple(block)}")
    ids = ids.contiguous()
    h = launch_decode_gate_up(x, w13, ids, None, cfg, scales=s13, block=tuple(block))
    y = launch_decode_down(x, h, w2, ids, weights, None, cfg, scales=s2, block=tuple(block))
    out = torch.empty_like(x)
    combine = min(1024, max(16, triton.next_power_of_2(hidden)))
    _decode_combine_kernel[(tokens, triton.cdiv(hidden, combine))](
        y, out, tokens, hidden, y.stride(0), out.stride(0), TOP_K=top_k, SHARED=0, BLOCK=combine,
        **pdl_args(y),
    )
    return out


def moe_experts_fp8_decode_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                               w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                               ids: torch.Tensor, block: tuple[int, int], *,
                               config: DecodeTiles | None = None) -> torch.Tensor:
    """The dequantized weights against unquantized activations (``config``: how the
    kernel runs, not what it computes)."""
    _check_decode(x, w13, s13, w2, s2, weights, ids, block)
    return moe_experts_fp8_ref(x, w13, s13, w2, s2, weights, ids, block)


def moe_experts_fp8_decode(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                           w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, block: tuple[int, int], *,
                           config: DecodeTiles | None = None) -> torch.Tensor:
    run = moe_experts_fp8_decode_triton if use_triton(x) else moe_experts_fp8_decode_ref
    return run(x, w13, s13, w2, s2, weights, ids, block, config=config)
