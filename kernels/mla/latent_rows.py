"""How the MLA decode kernels read a latent cache's rows, plain or FP8.

A latent row is ``R = kv_lora_rank`` values, then ``P`` RoPE values (DESIGN.md, MLA
pages); FP8 rows (a uint8 cache) are FlashMLA's layout (``kernels/fp8/kv_rows.py``) and
are dequantized as they load, with the references' float32 product and one rounding.
The dense (``kernels/mla/paged_decode.py``) and the sparse (``kernels/dsa/sparse_mla.py``)
decode kernels share these reads, their checks and the references' read.

Latent row strides reach the kernels divided by their largest power-of-two factor up
to 16 (``row_stride_args``), which goes as a constexpr: Triton marks only ints divisible
by 16, and a DSA pool plane's bf16 rows are 648 values apart, which it otherwise loads
one value at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.fp8.kv_rows import (
    _views,
    mla_fp8_group,
    mla_fp8_row_bytes,
    unpack_mla_fp8_rows,
)

# The widest latent and RoPE parts the kernels take (their tiles are one power of two).
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 256


@triton.jit
def load_latent_rows(latent_ptr, scale_ptr, rope_ptr, rows, ok, r, p, stride_lr, stride_sr,
                     stride_pr, RANK: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr,
                     KV_FP8: tl.constexpr, dtype: tl.constexpr):
    """Latent rows ``rows [N]`` (int64) -> (``[N, BLOCK_R]`` values, ``[N, BLOCK_P]`` RoPE
    part) in ``dtype``; masked rows read 0. FP8 rows are dequantized as they load:
    ``(e4m3 -> float32) * scale``, rounded once to ``dtype`` (``unpack_mla_fp8_rows``).

    A row's scales load once per group (``[N, BLOCK_R / GROUP]``) and broadcast over the
    group, where the rank fills ``BLOCK_R`` (a power of two: V3's 512 is 4 groups of 128);
    an odd rank (the tiny test checkpoints') loads one scale per value instead."""
    r_ok = r < RANK
    p_ok = p < RANK + ROPE
    if KV_FP8:
        BLOCK_N: tl.constexpr = rows.shape[0]
        BLOCK_R: tl.constexpr = r.shape[0]
        q8 = tl.load(latent_ptr + rows[:, None] * stride_lr + r[None, :],
                     mask=ok[:, None] & r_ok[None, :], other=0.0)
        if RANK == BLOCK_R and BLOCK_R % GROUP == 0:
            NUM_GROUPS: tl.constexpr = BLOCK_R // GROUP
            g = tl.arange(0, NUM_GROUPS)
            sc = tl.load(scale_ptr + rows[:, None] * stride_sr + g[None, :], mask=ok[:, None],
                         other=0.0)  # [N, NUM_GROUPS]
            kv = tl.reshape(q8.to(tl.float32), [BLOCK_N, NUM_GROUPS, GROUP]) * sc[:, :, None]
            kv = tl.reshape(kv, [BLOCK_N, BLOCK_R]).to(dtype)
        else:
            sc = tl.load(scale_ptr + rows[:, None] * stride_sr + r[None, :] // GROUP,
                         mask=ok[:, None] & r_ok[None, :], other=0.0)
            kv = (q8.to(tl.float32) * sc).to(dtype)
        k_pe = tl.load(rope_ptr + rows[:, None] * stride_pr + (p - RANK)[None, :],
                       mask=ok[:, None] & p_ok[None, :], other=0.0).to(dtype)
    else:
        row = latent_ptr + rows[:, None] * stride_lr
        kv = tl.load(row + r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
        k_pe = tl.load(row + p[None, :], mask=ok[:, None] & p_ok[None, :], other=0.0)
    return kv, k_pe


def stride_align(stride: int) -> int:
    """The largest power of two up to 16 dividing a row stride (in elements). The kernels
    hint it (``tl.multiple_of``): Triton marks only ints divisible by 16, so rows of a DSA
    pool plane (648 bf16 values apart, 16-byte aligned) would load one value at a time."""
    return min(16, stride & -stride) if stride > 0 else 16


def row_stride_args(strides: tuple[int, int, int]) -> tuple[tuple[int, int, int], dict]:
    """``latent_views``' row strides as the kernels take them: each divided by its
    ``stride_align``, which goes as the constexpr ``ALIGN_LR/SR/PR`` (the kernel multiplies
    back; ``tl.multiple_of`` on a scalar argument is dropped)."""
    aligns = [stride_align(s) for s in strides]
    divided = tuple(s // a for s, a in zip(strides, aligns))
    return divided, dict(ALIGN_LR=aligns[0], ALIGN_SR=aligns[1], ALIGN_PR=aligns[2])


def latent_views(latent_cache: torch.Tensor, kv_lora_rank: int, rope_dim: int):
    """What the kernels read of a latent cache: (values, scales, RoPE part) and their row
    strides, and the group size; plain rows are the one tensor thrice (group 1)."""
    if latent_cache.dtype != torch.uint8:
        s = latent_cache.stride(0)
        return latent_cache, latent_cache, latent_cache, (s, s, s), 1
    values, scales, rope = _views(latent_cache[:, : mla_fp8_row_bytes(kv_lora_rank, rope_dim)],
                                  kv_lora_rank, rope_dim)
    return (values, scales, rope, (values.stride(0), scales.stride(0), rope.stride(0)),
            mla_fp8_group(kv_lora_rank))


def dequantized_latent(latent_cache: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int,
                       rope_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The references' read of ``rows`` of a latent cache, FP8 rows dequantized."""
    if latent_cache.dtype != torch.uint8:
        return latent_cache[rows]
    width = mla_fp8_row_bytes(kv_lora_rank, rope_dim)
    return unpack_mla_fp8_rows(latent_cache[rows][:, :width], kv_lora_rank, rope_dim, dtype)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_latent_cache(latent_cache: torch.Tensor, q: torch.Tensor, kv_lora_rank: int) -> None:
    """``latent_cache`` is ``[rows, R + P]`` of q's dtype, or FP8 rows (uint8, at least
    ``mla_fp8_row_bytes`` wide: a DSA row's latent part is its first bytes)."""
    width = q.shape[-1]
    if latent_cache.dtype == torch.uint8:
        if not _is_int(kv_lora_rank) or not 16 <= kv_lora_rank < width or kv_lora_rank % 16:
            raise ValueError(f"FP8 latent rows need kv_lora_rank a multiple of 16 below "
                             f"q.shape[2] = {width}, got {kv_lora_rank!r}")
        need = mla_fp8_row_bytes(kv_lora_rank, width - kv_lora_rank)
        if latent_cache.shape[1] < need or latent_cache.stride(0) % 4:
            raise ValueError(f"FP8 latent_cache must be uint8 [rows, >= {need}] with rows of a "
                             f"multiple of 4 bytes, got {tuple(latent_cache.shape)} strides "
                             f"{latent_cache.stride()}")
        return
    if latent_cache.dtype != q.dtype:
        raise ValueError(f"latent_cache.dtype is {latent_cache.dtype} but q.dtype is {q.dtype}")
    if latent_cache.shape[1] != width:
        raise ValueError(f"latent_cache must be [rows, {width}] (q.shape[2]), got "
                         f"{tuple(latent_cache.shape)}")


def latent_out(q: torch.Tensor, out: torch.Tensor | None, shape: tuple[int, int, int]) -> torch.Tensor:
    """The ``[rows, heads, kv_lora_rank]`` output of an MLA decode in q's dtype: ``out``
    checked (dense last dim), or a new one."""
    if out is None:
        return q.new_empty(shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != q.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(out)
        raise ValueError(f"out is {got}, expected {shape} {q.dtype}")
    if shape[2] > 1 and out.stride(2) != 1:
        raise ValueError(f"out must have a dense last dim, got strides {out.stride()}")
    return out
