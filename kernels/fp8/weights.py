"""Blockwise FP8 weights: quantize a dense weight and expand the scales back.

``quantize_weight_blocks(w, block)`` gives the e4m3 weight and float32
``scale_inv`` of the Hugging Face ``quant_method: fp8`` format (each block's
amax maps to e4m3's largest value, 448); ``dequantize_weight_blocks`` is its
inverse up to e4m3 rounding, the ``weight * scale_inv`` of every block, partial
blocks at the edges included. Plain torch: tests write checkpoints with it and
the CPU path of a quantized linear reads its weight through it.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """``[..., N, K]`` -> ``[..., cdiv(N, block_n), cdiv(K, block_k)]``."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int],
                  ) -> torch.Tensor:
    """``[..., Sn, Sk]`` -> ``[..., rows, cols]``: each block's scale over its block."""
    full = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


def dequantize_weight_blocks(weight: torch.Tensor, scale_inv: torch.Tensor,
                             block: tuple[int, int], dtype: torch.dtype = torch.float32,
                             ) -> torch.Tensor:
    """``weight [..., N, K]`` e4m3 times its block's float32 scale, computed in
    float32 and rounded once to ``dtype``."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight.dtype must be {FP8_DTYPE}, got {weight.dtype}")
    expected = scale_shape(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv must be float32 {expected} for weight "
                         f"{tuple(weight.shape)} and block {block}, got "
                         f"{scale_inv.dtype} {tuple(scale_inv.shape)}")
    rows, cols = weight.shape[-2:]
    return (weight.float() * expand_scales(scale_inv, rows, cols, block)).to(dtype)


def quantize_weight_blocks(weight: torch.Tensor, block: tuple[int, int],
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` -> (e4m3 ``[..., N, K]``, float32 ``scale_inv``): each
    block divided by ``amax / 448`` (1 for an all-zero block)."""
    rows, cols = weight.shape[-2:]
    shape = scale_shape(tuple(weight.shape), block)
    pad_rows, pad_cols = shape[-2] * block[0] - rows, shape[-1] * block[1] - cols
    w = torch.nn.functional.pad(weight.float(), (0, pad_cols, 0, pad_rows))
    blocks = w.reshape(*shape[:-2], shape[-2], block[0], shape[-1], block[1])
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., Sn, Sk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / expand_scales(scale, w.shape[-2], w.shape[-1], block)).clamp(-FP8_MAX, FP8_MAX)
    return q[..., :rows, :cols].to(FP8_DTYPE).contiguous(), scale.contiguous()
