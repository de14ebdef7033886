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
These are the building blocks of FP8 MLA pages; the pool, the store and the
attention kernels do not use them yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.fp8.quant import _quantize_tile, per_token_group_quant_fp8_ref

GROUP = 128


def mla_fp8_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """656 for DeepSeek's 512 + 64."""
    return kv_lora_rank + 4 * (kv_lora_rank // GROUP) + 2 * rope_dim


def _check(latent: torch.Tensor, kv_lora_rank: int) -> int:
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2:
        raise ValueError(f"latent must be a 2-D tensor [T, R + P], got "
                         f"{getattr(latent, 'shape', type(latent))}")
    if kv_lora_rank <= 0 or kv_lora_rank % GROUP or latent.shape[1] <= kv_lora_rank:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be a positive multiple of {GROUP} "
                         f"below the latent width {latent.shape[1]}")
    if latent.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"latent.dtype must be float32, bfloat16 or float16, got {latent.dtype}")
    if latent.stride(1) != 1:
        raise ValueError(f"latent must be dense along its last dim, got strides {latent.stride()}")
    return latent.shape[1] - kv_lora_rank


@triton.jit
def _pack_mla_fp8_kernel(latent_ptr, q_ptr, s_ptr, rope_ptr, stride_l, stride_q, stride_s,
                         stride_r, RANK: tl.constexpr, ROPE: tl.constexpr,
                         ROPE_BLOCK: tl.constexpr, GROUPS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, GROUPS)
    k = tl.arange(0, 128)
    x = tl.load(latent_ptr + t * stride_l + g[:, None] * 128 + k[None, :]).to(tl.float32)
    q, scale = _quantize_tile(x, (k < 128)[None, :], False)
    tl.store(q_ptr + t * stride_q + g[:, None] * 128 + k[None, :], q)
    tl.store(s_ptr + t * stride_s + g, scale)
    r = tl.arange(0, ROPE_BLOCK)
    rope = tl.load(latent_ptr + t * stride_l + RANK + r, mask=r < ROPE, other=0.0).to(tl.float32)
    # rounded to nearest-even bfloat16 in the float32 bits (the interpreter's cast truncates)
    bits = rope.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    tl.store(rope_ptr + t * stride_r + r, bits.to(tl.float32, bitcast=True).to(tl.bfloat16),
             mask=r < ROPE)


def _views(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int):
    """The row's three parts as typed views: e4m3 [T, R], float32 [T, R/128], bf16 [T, P]."""
    groups = kv_lora_rank // GROUP
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
        _pack_mla_fp8_kernel[(latent.shape[0],)](
            latent, q, s, rope, latent.stride(0), q.stride(0), s.stride(0), rope.stride(0),
            RANK=kv_lora_rank, ROPE=rope_dim, ROPE_BLOCK=triton.next_power_of_2(rope_dim),
            GROUPS=kv_lora_rank // GROUP, num_warps=4)
    return rows


def pack_mla_fp8_rows_ref(latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
    rope_dim = _check(latent, kv_lora_rank)
    rows = torch.empty((latent.shape[0], mla_fp8_row_bytes(kv_lora_rank, rope_dim)),
                       dtype=torch.uint8, device=latent.device)
    q, s, rope = _views(rows, kv_lora_rank, rope_dim)
    q_ref, s_ref = per_token_group_quant_fp8_ref(latent[:, :kv_lora_rank], GROUP)
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
    latent = q.float() * s.repeat_interleave(GROUP, dim=1)
    return torch.cat((latent, rope.float()), dim=1).to(dtype)
