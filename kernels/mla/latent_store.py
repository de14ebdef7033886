"""mla_rope_norm_store: an MLA decode step's RoPE, kv_a norm and latent store, one launch.

After the q/kv_a GEMM the absorbed decode needs q_pe rotated, the compressed KV
normed (``kv_a_layernorm``), the shared key's RoPE part rotated and the row
``[normed latent | rotated k_pe]`` stored at its cache row: three launches
(``mla_rope``, ``add_rmsnorm``, ``store_kv``) in the unfused model, now one
program per token.

``mla_rope_norm_store(q_pe, kv_a, norm_weight, eps, cos, sin, interleave, cache,
locs, kv_lora_rank)``: ``q_pe [T, H, P]`` (the queries' RoPE part, a strided view
of the projection) is rotated in place as ``mla_rope`` rotates it; ``kv_a [T, R + P]``
(before norm and RoPE; read only) gives the row, normed as ``add_rmsnorm`` norms
(float32 statistics, rounded to the model dtype before the weight) and rotated as
``rope_pairs``; ``cos, sin [T, P/2]`` float32. ``cache`` is a plain latent plane
``[rows, R + P]`` of the model dtype, or FP8 rows (uint8 ``[rows, row_stride]``),
which get ``mla_rope_store_fp8``'s packing (the pieces of ``kernels/fp8/rope_store.py``,
so a token's bytes do not depend on the path). ``locs [T]`` int64; ``loc < 0`` skips
the row, on CUDA a loc ``>= rows`` is dropped, on CPU refused.

A program loads every RoPE pair of its token's queries before it stores any (a
barrier between), so the in-place rotation never reads a rotated value. Rotations
compile without fused multiply-adds (as the FP8 store's do), in the reference's op
order; the norm's sum of squares may differ from torch's in its last bits.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.kv_rows import bf16_rne, mla_fp8_group, mla_fp8_row_bytes
from lanekv.kernels.fp8.quant import _quantize_tile, hw_cast
from lanekv.kernels.fp8.rope_store import (
    _check_mla,
    _row_parts,
    _store_mla_row,
    mla_rope_store_fp8_ref,
)
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from lanekv.kernels.rmsnorm import add_rmsnorm_ref
from lanekv.kernels.rope_store import mla_rope_ref, rope_lanes, rope_pairs

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _mla_rope_norm_store_kernel(
    q_ptr, kv_ptr, w_ptr, cos_ptr, sin_ptr, locs_ptr, c_ptr, cq_ptr, cs_ptr, cr_ptr, cp_ptr,
    num_heads, num_rows, eps,
    stride_qt, stride_qh, stride_kt, stride_ct, stride_st, stride_c,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUPS: tl.constexpr, GROUPS_BLOCK: tl.constexpr,
    GROUP_SIZE: tl.constexpr, PAD: tl.constexpr, PAD_BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr, KV_FP8: tl.constexpr, HW_CAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """``c_ptr`` is the plain cache; ``cq..cp`` the FP8 rows' parts (``_row_parts``),
    whose row stride ``stride_c`` is in bytes."""
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    dtype = kv_ptr.dtype.element_ty
    i, ok, c, s, first, second = rope_lanes(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF,
                                            HALF_BLOCK, INTERLEAVE)

    # Every load first (the queries' RoPE parts, the row, its loc), so that they wait
    # on one memory trip together, not one after another.
    h = tl.arange(0, BLOCK_H)
    q_mask = (h < num_heads)[:, None] & ok[None, :]
    q_row = q_ptr + t * stride_qt + h[:, None] * stride_qh  # [BLOCK_H, HALF_BLOCK]
    x1 = tl.load(q_row + first[None, :], mask=q_mask, other=0.0).to(tl.float32)
    x2 = tl.load(q_row + second[None, :], mask=q_mask, other=0.0).to(tl.float32)
    loc = tl.load(locs_ptr + t)
    kv_row = kv_ptr + t * stride_kt
    k1 = tl.load(kv_row + RANK + first, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(kv_row + RANK + second, mask=ok, other=0.0).to(tl.float32)
    if KV_FP8:  # the latent as the packing's [groups, group size] tile
        g = tl.arange(0, GROUPS_BLOCK)
        k = tl.arange(0, GROUP_SIZE)
        g_ok = g < GROUPS
        col = g[:, None] * GROUP_SIZE + k[None, :]
        mask = g_ok[:, None] & (k < GROUP_SIZE)[None, :]
    else:
        col = tl.arange(0, BLOCK_R)
        mask = col < RANK
    x = tl.load(kv_row + col, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + col, mask=mask, other=0.0).to(tl.float32)

    tl.debug_barrier()  # every query pair read before any is overwritten (in place)
    tl.store(q_row + i[None, :], (x1 * c[None, :] - x2 * s[None, :]).to(dtype), mask=q_mask)
    tl.store(q_row + HALF + i[None, :], (x2 * c[None, :] + x1 * s[None, :]).to(dtype),
             mask=q_mask)

    if (loc >= 0) & (loc < num_rows):
        # the shared key's RoPE part, rotated and rounded to the model dtype
        r1 = (k1 * c - k2 * s).to(dtype)
        r2 = (k2 * c + k1 * s).to(dtype)
        # add_rmsnorm's ops: float32 statistics, rounded before the weight
        if KV_FP8:
            inv = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, 1), 0) / RANK + eps)
        else:
            inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / RANK + eps)
        normed = ((x * inv).to(dtype).to(tl.float32) * w).to(dtype)
        if KV_FP8:
            q8, scale = _quantize_tile(normed.to(tl.float32), (k < GROUP_SIZE)[None, :], False,
                                       HW_CAST)
            b1 = bf16_rne(r1.to(tl.float32), HW_CAST)
            b2 = bf16_rne(r2.to(tl.float32), HW_CAST)
            _store_mla_row(cq_ptr, cs_ptr, cr_ptr, cp_ptr, loc * stride_c, q8, scale, b1, b2, g, k,
                           mask, g_ok, i, ok, HALF, GROUP_SIZE, PAD, PAD_BLOCK)
        else:
            dst = c_ptr + loc * stride_c
            tl.store(dst + col, normed, mask=mask)
            tl.store(dst + RANK + i, r1, mask=ok)
            tl.store(dst + RANK + HALF + i, r2, mask=ok)


def _check_args(q_pe, kv_a, norm_weight, eps, cos, sin, interleave, cache, locs,
                kv_lora_rank) -> None:
    """ValueError naming the argument."""
    if not isinstance(kv_a, torch.Tensor) or kv_a.dim() != 2 or kv_a.dtype not in _DTYPES \
            or kv_a.stride(1) != 1:
        raise ValueError(f"kv_a must be a 2-D [T, R + P] tensor of one of {_DTYPES} with a dense "
                         f"last dim, got {getattr(kv_a, 'dtype', type(kv_a))} "
                         f"{tuple(getattr(kv_a, 'shape', ()))}")
    num_tokens, width = kv_a.shape
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) \
            or not 0 < kv_lora_rank < width or (width - kv_lora_rank) % 2:
        raise ValueError(f"kv_lora_rank must be an int below kv_a's width {width} leaving an even "
                         f"RoPE part, got kv_lora_rank={kv_lora_rank!r}")
    rope = width - kv_lora_rank
    if not isinstance(q_pe, torch.Tensor) or q_pe.dim() != 3 or q_pe.shape[0] != num_tokens \
            or q_pe.shape[2] != rope or q_pe.dtype != kv_a.dtype or q_pe.stride(2) != 1:
        raise ValueError(f"q_pe must be a {kv_a.dtype} [{num_tokens}, H, {rope}] tensor with a "
                         f"dense last dim, got {getattr(q_pe, 'dtype', type(q_pe))} "
                         f"{tuple(getattr(q_pe, 'shape', ()))}")
    if not isinstance(norm_weight, torch.Tensor) or norm_weight.shape != (kv_lora_rank,) \
            or norm_weight.dtype != kv_a.dtype or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be a dense {kv_a.dtype} [{kv_lora_rank}] tensor, got "
                         f"{getattr(norm_weight, 'dtype', type(norm_weight))} "
                         f"{tuple(getattr(norm_weight, 'shape', ()))}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got eps={eps!r}")
    if not isinstance(interleave, bool):
        raise ValueError(f"interleave must be a bool, got interleave={interleave!r}")
    for name, x in (("cos", cos), ("sin", sin)):
        if not isinstance(x, torch.Tensor) or x.shape != (num_tokens, rope // 2) \
                or x.dtype != torch.float32 or x.stride(-1) != 1:
            raise ValueError(f"{name} must be a dense float32 [{num_tokens}, {rope // 2}] tensor, "
                             f"got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8:
        _check_mla(kv_a, cos, sin, interleave, cache, locs, None, kv_lora_rank)  # FP8 rows
    else:
        if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[1] != width \
                or cache.dtype != kv_a.dtype or cache.stride(1) != 1:
            raise ValueError(f"cache must be a {kv_a.dtype} [rows, {width}] tensor with a dense "
                             f"last dim (or uint8 FP8 rows), got "
                             f"{getattr(cache, 'dtype', type(cache))} "
                             f"{tuple(getattr(cache, 'shape', ()))}")
        if not isinstance(locs, torch.Tensor) or locs.shape != (num_tokens,) \
                or locs.dtype != torch.int64:
            raise ValueError(f"locs must be a [{num_tokens}] int64 tensor, got "
                             f"{getattr(locs, 'dtype', type(locs))} "
                             f"{tuple(getattr(locs, 'shape', ()))}")
        if not locs.is_cuda and num_tokens and int(locs.max()) >= cache.shape[0]:
            raise ValueError(f"locs holds {int(locs.max())}, beyond the {cache.shape[0]} cache "
                             f"rows")
    check_same_device(q_pe=q_pe, kv_a=kv_a, norm_weight=norm_weight, cos=cos, sin=sin,
                      cache=cache, locs=locs)


def mla_rope_norm_store_triton(q_pe: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                               eps: float, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                               cache: torch.Tensor, locs: torch.Tensor, kv_lora_rank: int) -> None:
    _check_args(q_pe, kv_a, norm_weight, eps, cos, sin, interleave, cache, locs, kv_lora_rank)
    num_tokens, width = kv_a.shape
    if num_tokens == 0:
        return
    rope = width - kv_lora_rank
    half = rope // 2
    kv_fp8 = cache.dtype == torch.uint8
    if kv_fp8:
        group = mla_fp8_group(kv_lora_rank)
        packed = mla_fp8_row_bytes(kv_lora_rank, rope)
        parts = _row_parts(cache, kv_lora_rank, rope, packed)
        groups, pad = kv_lora_rank // group, cache.shape[1] - packed
    else:
        group, groups, pad = 1, 1, 0
        parts = (cache,) * 4  # unread
    _mla_rope_norm_store_kernel[(num_tokens,)](
        q_pe, kv_a, norm_weight, cos, sin, locs, cache, *parts,
        q_pe.shape[1], cache.shape[0], float(eps),
        q_pe.stride(0), q_pe.stride(1), kv_a.stride(0), cos.stride(0), sin.stride(0),
        cache.stride(0),
        RANK=kv_lora_rank, BLOCK_R=triton.next_power_of_2(kv_lora_rank), HALF=half,
        HALF_BLOCK=max(2, triton.next_power_of_2(half)),
        BLOCK_H=max(2, triton.next_power_of_2(q_pe.shape[1])),
        GROUPS=groups, GROUPS_BLOCK=triton.next_power_of_2(groups), GROUP_SIZE=group,
        PAD=pad, PAD_BLOCK=max(2, triton.next_power_of_2(max(pad, 1))), INTERLEAVE=interleave,
        KV_FP8=kv_fp8, HW_CAST=hw_cast(), num_warps=4, enable_fp_fusion=False,
        **pdl_args(q_pe),
    )


def mla_rope_norm_store_ref(q_pe: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                            cache: torch.Tensor, locs: torch.Tensor, kv_lora_rank: int) -> None:
    """The unfused ops: ``mla_rope_ref`` on q_pe, ``add_rmsnorm_ref`` on the compressed KV,
    then ``mla_rope_store_fp8_ref`` (FP8 rows) or ``rope_pairs`` and the plain store."""
    _check_args(q_pe, kv_a, norm_weight, eps, cos, sin, interleave, cache, locs, kv_lora_rank)
    mla_rope_ref(q_pe, None, cos, sin, interleave)
    normed = add_rmsnorm_ref(kv_a[:, :kv_lora_rank], None, norm_weight, eps)[0]
    if cache.dtype == torch.uint8:
        latent = torch.cat((normed, kv_a[:, kv_lora_rank:]), dim=1)
        mla_rope_store_fp8_ref(latent, cos, sin, interleave, cache, locs, kv_lora_rank)
        return
    k_pe = rope_pairs(kv_a[:, None, kv_lora_rank:], cos, sin, interleave)[:, 0]
    keep = (locs >= 0) & (locs < cache.shape[0])
    cache[locs[keep]] = torch.cat((normed, k_pe), dim=1)[keep]


def mla_rope_norm_store(q_pe: torch.Tensor, kv_a: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
                        cache: torch.Tensor, locs: torch.Tensor, kv_lora_rank: int) -> None:
    """q_pe rotated in place; ``kv_a``'s row normed, rotated and stored at ``locs`` (module doc)."""
    run = mla_rope_norm_store_triton if use_triton(kv_a) else mla_rope_norm_store_ref
    run(q_pe, kv_a, norm_weight, eps, cos, sin, interleave, cache, locs, kv_lora_rank)
