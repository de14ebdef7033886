"""The FP8 MLA latent row (656 bytes for DeepSeek's 512 + 64): pack and unpack.

One token's row, as FlashMLA's FP8 cache lays it out:

    bytes [0, R)             the latent's first R = kv_lora_rank values in e4m3,
                             quantized in groups of 128 (one scale per group)
    bytes [R, R + 4 R/128)   those groups' float32 scales
    then  2 P bytes          the P = qk_rope_head_dim RoPE'd key values in bfloat16

so R = 512, P = 64 gives 512 + 16 + 128 = 656 bytes against 1152 in bf16. The
RoPE part stays 16-bit because the positional key is small and sensitive; the
scales sit right after the values they scale, 4-byte aligned since R is a
multiple of 128. ``pack_mla_fp8_rows(latent [T, R + P], kv_lora_rank)`` ->
``[T, row_bytes]`` uint8; ``unpack_mla_fp8_rows(rows, kv_lora_rank, rope_dim,
dtype)`` -> ``[T, R + P]``. The packing quantizes exactly as
``per_token_group_quant_fp8`` (bit for bit between kernel and reference).
The FP8 MLA pool rows of ``model/attention/rows.py`` are these rows.

The FP8 GQA row of one head (``pack_kv_fp8_rows(x [T, H, D])`` ->
``[T, H, D + 4]`` uint8): the head's D values in e4m3, then its float32 scale
(``amax / 448`` over the D values, one per token and head, as
``per_token_group_quant_fp8`` with one group per head), so a K or V plane of
an FP8 GQA pool is ``[rows, Hkv, D + 4]`` bytes: 132 per head of 128 against
256 in bf16. ``D`` must be a multiple of 4 (the scale stays 4-byte aligned).

Dequantizing (``dequantize_kv_fp8_rows``, ``unpack_mla_fp8_rows`` and the
decode kernels on load) is ``(e4m3 -> float32) * scale`` in float32, then the
model dtype: one rounding, the same in every path, so what the prefill
attends is what the decode reads.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.fp8.quant import (
    AMAX_FLOOR,
    _quantize_tile,
    hw_cast,
    per_token_group_quant_fp8_ref,
)
from lanekv.kernels.fp8.weights import FP8_DTYPE, FP8_MAX

GROUP = 128


def mla_fp8_group(kv_lora_rank: int) -> int:
    """Latent values per scale: 128 (FlashMLA's), or the rank itself for a smaller rank
    (the tiny test models), as ``gcd(kv_lora_rank, 128)``."""
    return math.gcd(kv_lora_rank, GROUP)


def mla_fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """656 for DeepSeek's 512 + 64."""
    return kv_lora_rank + 4 * (kv_lora_rank // mla_fp8_group(kv_lora_rank)) + 2 * rope_dim


def mla_fp8_row_stride(kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes a pool gives an FP8 MLA row: ``mla_fp8_row_bytes`` rounded up to 16 (656 stays
    656). Compiled kernels read rows that do not start 16-byte aligned at a misaligned
    address (on an H200: 52-, 68-, 164- and 260-byte rows faulted, 64-byte ones did not)."""
    return -(-mla_fp8_row_bytes(kv_lora_rank, rope_dim) // 16) * 16


def check_mla_fp8_rank(kv_lora_rank: int) -> None:
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or kv_lora_rank <= 0 or (
            kv_lora_rank % 16):
        raise ValueError(f"an FP8 MLA row needs kv_lora_rank a positive multiple of 16, got "
                         f"kv_lora_rank={kv_lora_rank!r}")


def _check(latent: torch.Tensor, kv_lora_rank: int) -> int:
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2:
        raise ValueError(f"latent must be a 2-D tensor [T, R + P], got "
                         f"{getattr(latent, 'shape', type(latent))}")
    check_mla_fp8_rank(kv_lora_rank)
    if latent.shape[1] <= kv_lora_rank:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be below the latent width "
                         f"{latent.shape[1]}")
    if latent.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"latent.dtype must be float32, bfloat16 or float16, got {latent.dtype}")
    if latent.stride(1) != 1:
        raise ValueError(f"latent must be dense along its last dim, got strides {latent.stride()}")
    return latent.shape[1] - kv_lora_rank


@triton.jit
def _pack_mla_fp8_kernel(latent_ptr, q_ptr, s_ptr, rope_ptr, stride_l, stride_q, stride_s,
                         stride_r, RANK: tl.constexpr, ROPE: tl.constexpr,
                         ROPE_BLOCK: tl.constexpr, GROUPS: tl.constexpr, GROUPS_BLOCK: tl.constexpr,
                         GROUP_SIZE: tl.constexpr, HW_CAST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS_BLOCK)  # GROUPS need not be a power of two (rank 384: 3)
    k = tl.arange(0, GROUP_SIZE)
    g_ok = g < GROUPS
    mask = g_ok[:, None] & (k < GROUP_SIZE)[None, :]
    x = tl.load(latent_ptr + t * stride_l + g[:, None] * GROUP_SIZE + k[None, :], mask=mask,
                other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x, (k < GROUP_SIZE)[None, :], False, HW_CAST)
    tl.store(q_ptr + t * stride_q + g[:, None] * GROUP_SIZE + k[None, :], q, mask=mask)
    tl.store(s_ptr + t * stride_s + g, scale, mask=g_ok)
    r = tl.arange(0, ROPE_BLOCK)
    rope = tl.load(latent_ptr + t * stride_l + RANK + r, mask=r < ROPE, other=0.0).to(tl.float32)
    tl.store(rope_ptr + t * stride_r + r, bf16_rne(rope, HW_CAST), mask=r < ROPE)


@triton.jit
def bf16_rne(x, HW_CAST: tl.constexpr):
    """float32 ``x`` rounded to the nearest-even bfloat16, as torch's cast rounds."""
    if HW_CAST:  # the hardware's conversion
        y = x.to(tl.bfloat16, fp_downcast_rounding="rtne")
    else:  # in the float32 bits (the interpreter's cast truncates)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        y = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return y


def _views(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int):
    """The row's three parts as typed views: e4m3 [T, R], float32 [T, R/128], bf16 [T, P]."""
    groups = kv_lora_rank // mla_fp8_group(kv_lora_rank)
    q = rows[:, :kv_lora_rank].view(torch.float8_e4m3fn)
    s = rows[:, kv_lora_rank:kv_lora_rank + 4 * groups].view(torch.float32)
    rope = rows[:, kv_lora_rank + 4 * groups:].view(torch.bfloat16)
    return q, s, rope[:, :rope_dim]


def pack_mla_fp8_rows_triton(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    rope_dim = _check(latent, kv_lora_rank)
    rows = torch.empty((latent.shape[0], mla_fp8_row_bytes(kv_lora_rank, rope_dim)),
                       dtype=torch.uint8, device=latent.device)
    if latent.shape[0]:
        q, s, rope = _views(rows, kv_lora_rank, rope_dim)
        group = mla_fp8_group(kv_lora_rank)
        _pack_mla_fp8_kernel[(latent.shape[0],)](
            latent, q, s, rope, latent.stride(0), q.stride(0), s.stride(0), rope.stride(0),
            RANK=kv_lora_rank, ROPE=rope_dim, ROPE_BLOCK=triton.next_power_of_2(rope_dim),
            GROUPS=kv_lora_rank // group, GROUPS_BLOCK=triton.next_power_of_2(kv_lora_rank // group),
            GROUP_SIZE=group, HW_CAST=hw_cast(), num_warps=4)
    return rows


def pack_mla_fp8_rows_ref(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    rope_dim = _check(latent, kv_lora_rank)
    rows = torch.empty((latent.shape[0], mla_fp8_row_bytes(kv_lora_rank, rope_dim)),
                       dtype=torch.uint8, device=latent.device)
    q, s, rope = _views(rows, kv_lora_rank, rope_dim)
    q_ref, s_ref = per_token_group_quant_fp8_ref(latent[:, :kv_lora_rank],
                                                 mla_fp8_group(kv_lora_rank))
    q.copy_(q_ref)
    s.copy_(s_ref)
    rope.copy_(latent[:, kv_lora_rank:].to(torch.bfloat16))
    return rows


def pack_mla_fp8_rows(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    run = pack_mla_fp8_rows_triton if use_triton(latent) else pack_mla_fp8_rows_ref
    return run(latent, kv_lora_rank)


def unpack_mla_fp8_rows(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """``[T, row_bytes]`` uint8 -> ``[T, R + P]`` in ``dtype`` (plain torch)."""
    expected = mla_fp8_row_bytes(kv_lora_rank, rope_dim)
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != expected:
        raise ValueError(f"rows must be uint8 [T, {expected}], got {rows.dtype} "
                         f"{tuple(rows.shape)}")
    q, s, rope = _views(rows, kv_lora_rank, rope_dim)
    latent = q.float() * s.repeat_interleave(mla_fp8_group(kv_lora_rank), dim=1)
    return torch.cat((latent, rope.float()), dim=1).to(dtype)


# ---- FP8 GQA rows: per head, D e4m3 values then one float32 scale ----

SCALE_BYTES = 4


def kv_fp8_head_bytes(head_dim: int) -> int:
    """Bytes of one head's FP8 row: 132 for a head of 128."""
    return head_dim + SCALE_BYTES


def _check_kv(x: torch.Tensor) -> int:
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a 3-D tensor [T, H, D], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"x.dtype must be float32, bfloat16 or float16, got {x.dtype}")
    head_dim = x.shape[2]
    if head_dim <= 0 or head_dim % 4:
        raise ValueError(f"an FP8 KV head needs head_dim a positive multiple of 4, got {head_dim}")
    if x.stride(2) != 1:
        raise ValueError(f"x must be dense along its last dim, got strides {x.stride()}")
    return head_dim


def kv_fp8_views(rows: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., H, D + 4]`` uint8 rows -> (e4m3 ``[..., H, D]``, float32 ``[..., H, 1]``) views."""
    if rows.dtype != torch.uint8 or rows.shape[-1] != kv_fp8_head_bytes(head_dim):
        raise ValueError(f"rows must be uint8 [..., H, {kv_fp8_head_bytes(head_dim)}], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    return rows[..., :head_dim].view(FP8_DTYPE), rows[..., head_dim:].view(torch.float32)


@triton.jit(do_not_specialize=["heads"])
def _pack_kv_fp8_kernel(x_ptr, q_ptr, s_ptr, heads, stride_xt, stride_xh, stride_qt, stride_qh,
                        stride_st, stride_sh, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_D: tl.constexpr, HW_CAST: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < heads
    d_ok = (d < HEAD_DIM)[None, :]
    mask = h_ok[:, None] & d_ok
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask,
                other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x, d_ok, False, HW_CAST)
    tl.store(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], q, mask=mask)
    tl.store(s_ptr + t * stride_st + h * stride_sh, scale, mask=h_ok)


def pack_kv_fp8_rows_triton(x: torch.Tensor) -> torch.Tensor:
    head_dim = _check_kv(x)
    tokens, heads = x.shape[:2]
    rows = torch.empty((tokens, heads, kv_fp8_head_bytes(head_dim)), dtype=torch.uint8,
                       device=x.device)
    if tokens and heads:
        q, s = kv_fp8_views(rows, head_dim)
        block_d = triton.next_power_of_2(head_dim)
        block_h = max(1, min(triton.next_power_of_2(heads), 4096 // block_d))
        _pack_kv_fp8_kernel[(tokens, triton.cdiv(heads, block_h))](
            x, q, s, heads, x.stride(0), x.stride(1), q.stride(0), q.stride(1), s.stride(0),
            s.stride(1), HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, HW_CAST=hw_cast(),
            num_warps=4)
    return rows


def pack_kv_fp8_rows_ref(x: torch.Tensor) -> torch.Tensor:
    head_dim = _check_kv(x)
    rows = torch.empty((*x.shape[:2], kv_fp8_head_bytes(head_dim)), dtype=torch.uint8,
                       device=x.device)
    q, s = kv_fp8_views(rows, head_dim)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)  # [T, H, 1]
    scale = amax / torch.full_like(amax, FP8_MAX)  # a tensor divisor: correctly rounded
    q.copy_((xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    s.copy_(scale)
    return rows


def pack_kv_fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` -> ``[T, H, D + 4]`` uint8 FP8 rows (e4m3 values, float32 scale)."""
    run = pack_kv_fp8_rows_triton if use_triton(x) else pack_kv_fp8_rows_ref
    return run(x)


def dequantize_kv_fp8_rows(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[..., H, D + 4]`` uint8 -> ``[..., H, D]`` in ``dtype`` (plain torch; the decode
    kernel computes the same float32 product and rounds it once to ``dtype``)."""
    q, s = kv_fp8_views(rows, head_dim)
    return (q.float() * s).to(dtype)
