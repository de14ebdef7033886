"""RoPE, FP8 quantization and the store of the new rows, in one launch.

``rope_store_kv_fp8(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out=None)``
(GQA): ``rope_store_kv``'s arguments with FP8 caches ``[R, Hkv, D + 4]`` uint8
(``kv_rows.pack_kv_fp8_rows``' rows). It returns the rotated q ``[T, Hq, D]``
and writes each token's rotated K and its V as FP8 rows to ``locs`` (``loc < 0``
skips the row; on CUDA a loc ``>= R`` is dropped, on CPU refused), and with
``kv_out [T, 2, Hkv, D + 4]`` uint8 every row's K/V rows, whatever its loc.

``mla_rope_store_fp8(latent, cos, sin, interleave, cache, locs, kv_lora_rank,
rows_out=None)``
(MLA): ``latent [T, R + P]`` holds the normed compressed KV and the shared key's
P RoPE values *before* RoPE; ``cos, sin [T, P/2]`` float32 (``mla_rope``'s).
The RoPE part is rotated (``rope_pairs``' order), rounded to the latent's dtype
and the whole row packed as ``pack_mla_fp8_rows`` packs it into ``cache [R,
row_stride]`` uint8 at ``locs`` (the padding past the packed bytes zeroed) and
into ``rows_out`` likewise when given.

Both rotate in float32 and round once to the model dtype before quantizing,
in the reference's op order (``x * c - x' * s``, no fused multiply-add: the
kernels compile with ``enable_fp_fusion=False``), and quantize as the packing
kernels do, so kernel and reference are equal bit for bit. Every path that
stores FP8 rows of a new token (CP prefill, decode step, the single-process run)
goes through these ops, so a token's bytes do not depend on the path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.kv_rows import (
    _views,
    bf16_rne,
    kv_fp8_head_bytes,
    kv_fp8_views,
    mla_fp8_group,
    mla_fp8_row_bytes,
    pack_kv_fp8_rows_ref,
    pack_mla_fp8_rows_ref,
)
from lanekv.kernels.fp8.quant import _quantize_tile, hw_cast
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from lanekv.kernels.rope_store import rope_lanes, rope_pairs, rotate_half
from lanekv.kernels.store_kv import store_kv_ref

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- GQA ----

@triton.jit(do_not_specialize=["num_tokens", "num_rows"])
def _rope_store_kv_fp8_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kq_ptr, ks_ptr, vq_ptr, vs_ptr, locs_ptr, qo_ptr,
    oq_ptr, os_ptr, num_tokens, num_rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kqr, stride_kqh, stride_ksr, stride_ksh, stride_vqr, stride_vqh, stride_vsr, stride_vsh,
    stride_qot, stride_qoh, stride_oqt, stride_oqp, stride_oqh, stride_ost, stride_osp, stride_osh,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
    WRITE_KV: tl.constexpr, HW_CAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    d = tl.arange(0, BLOCK)
    ok = d < HEAD_DIM
    first = d < half
    partner = tl.where(first, d + half, d - half)  # rotate_half's source of each value
    c = tl.load(cos_ptr + t * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_st + d, mask=ok, other=0.0).to(tl.float32)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
        rot = tl.where(first, x * c - xp * s, x * c + xp * s)
        tl.store(qo_ptr + t * stride_qot + head * stride_qoh + d,
                 rot.to(qo_ptr.dtype.element_ty), mask=ok)
    else:
        h = head - NUM_Q_HEADS
        loc = tl.load(locs_ptr + t)
        cached = (loc >= 0) & (loc < num_rows)
        if cached | WRITE_KV:
            src = k_ptr + t * stride_kt + h * stride_kh
            x = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
            xp = tl.load(src + partner, mask=ok, other=0.0).to(tl.float32)
            rot = tl.where(first, x * c - xp * s, x * c + xp * s)
            # the rotated key in the model dtype, the value the reference quantizes
            key = rot.to(k_ptr.dtype.element_ty).to(tl.float32)
            kq, ks = _quantize_tile(key[None, :], ok[None, :], False, HW_CAST)
            val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0)
            vq, vs = _quantize_tile(val.to(tl.float32)[None, :], ok[None, :], False, HW_CAST)
            one = tl.arange(0, 1)
            if cached:
                tl.store(kq_ptr + loc * stride_kqr + h * stride_kqh + d[None, :], kq, mask=ok[None, :])
                tl.store(ks_ptr + loc * stride_ksr + h * stride_ksh + one, ks)
                tl.store(vq_ptr + loc * stride_vqr + h * stride_vqh + d[None, :], vq, mask=ok[None, :])
                tl.store(vs_ptr + loc * stride_vsr + h * stride_vsh + one, vs)
            if WRITE_KV:
                row = oq_ptr + t * stride_oqt + h * stride_oqh + d[None, :]
                tl.store(row, kq, mask=ok[None, :])
                tl.store(row + stride_oqp, vq, mask=ok[None, :])
                scale = os_ptr + t * stride_ost + h * stride_osh + one
                tl.store(scale, ks)
                tl.store(scale + stride_osp, vs)


def _check_fp8_rows(name: str, t: object, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape[1:]) != shape[1:] \
            or (shape[0] >= 0 and t.shape[0] != shape[0]) or t.stride(-1) != 1:
        want = ["R" if shape[0] < 0 else shape[0], *shape[1:]]
        raise ValueError(f"{name} must be a uint8 {want} tensor with dense rows, got "
                         f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def _check_gqa(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _DTYPES or t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype is {t.dtype}; all must be q's dtype {q.dtype} "
                             f"(one of {_DTYPES})")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a dense head_dim, got strides {t.stride()}")
    num_tokens, _, head_dim = q.shape
    if head_dim <= 0 or head_dim % 4:
        raise ValueError(f"head_dim must be a positive multiple of 4 (even for RoPE, the FP8 "
                         f"scale 4-byte aligned), got {head_dim}")
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"[{num_tokens}, Hkv, {head_dim}]")
    row = (-1, k.shape[1], kv_fp8_head_bytes(head_dim))
    _check_fp8_rows("k_cache", k_cache, row)
    _check_fp8_rows("v_cache", v_cache, (k_cache.shape[0], *row[1:]))
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.shape != (num_tokens, head_dim) or (
                t.dtype != q.dtype) or t.stride(1) != 1:
            raise ValueError(f"{name} must be a dense {q.dtype} [{num_tokens}, {head_dim}] tensor, "
                             f"got {getattr(t, 'shape', type(t))}")
    if not isinstance(locs, torch.Tensor) or locs.shape != (num_tokens,) or locs.dtype != torch.int64:
        raise ValueError(f"locs must be a [{num_tokens}] int64 tensor, got "
                         f"{getattr(locs, 'shape', type(locs))}")
    if kv_out is not None:
        _check_fp8_rows("kv_out", kv_out, (num_tokens, 2, *row[1:]))
    check_same_device(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, locs=locs,
                      kv_out=kv_out)
    if not locs.is_cuda and num_tokens and int(locs.max()) >= k_cache.shape[0]:
        raise ValueError(f"locs holds {int(locs.max())}, beyond the {k_cache.shape[0]} cache rows")


def rope_store_kv_fp8_triton(q, k, v, cos, sin, k_cache, v_cache, locs,
                             kv_out=None) -> torch.Tensor:
    _check_gqa(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    (kq, ks), (vq, vs) = kv_fp8_views(k_cache, head_dim), kv_fp8_views(v_cache, head_dim)
    if kv_out is None:  # unread without WRITE_KV
        oq, os_, o_strides = kq, ks, (0,) * 6
    else:
        oq, os_ = kv_fp8_views(kv_out, head_dim)
        o_strides = (*oq.stride()[:3], *os_.stride()[:3])
    _rope_store_kv_fp8_kernel[(num_tokens, num_q_heads + k.shape[1])](
        q, k, v, cos, sin, kq, ks, vq, vs, locs, out, oq, os_, num_tokens, k_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), kq.stride(0), kq.stride(1), ks.stride(0), ks.stride(1),
        vq.stride(0), vq.stride(1), vs.stride(0), vs.stride(1), out.stride(0), out.stride(1),
        *o_strides,
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, BLOCK=triton.next_power_of_2(head_dim),
        WRITE_KV=kv_out is not None, HW_CAST=hw_cast(), num_warps=1, enable_fp_fusion=False,
        **pdl_args(q),
    )
    return out


def rotate_once(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated by ``cos, sin [T, D]`` (halves) in float32, rounded once to
    x's dtype: the kernels' arithmetic, op for op."""
    x32, c, s = x.float(), cos.float()[:, None, :], sin.float()[:, None, :]
    return (x32 * c + rotate_half(x32) * s).to(x.dtype)


def rope_store_kv_fp8_ref(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out=None) -> torch.Tensor:
    """``rotate_once`` on q and k, ``pack_kv_fp8_rows`` of k and v, then ``store_kv``."""
    _check_gqa(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out)
    k_rows = pack_kv_fp8_rows_ref(rotate_once(k, cos, sin))  # [T, Hkv, D + 4]
    v_rows = pack_kv_fp8_rows_ref(v)
    store_kv_ref(k_rows, v_rows, k_cache, v_cache, locs)
    if kv_out is not None:
        kv_out[:, 0], kv_out[:, 1] = k_rows, v_rows
    return rotate_once(q, cos, sin)


def rope_store_kv_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      locs: torch.Tensor, kv_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotated q; rotated k and v stored as FP8 rows at ``locs`` (and into ``kv_out``)."""
    run = rope_store_kv_fp8_triton if use_triton(q) else rope_store_kv_fp8_ref
    return run(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out)


# ---- MLA ----

@triton.jit(do_not_specialize=["num_rows"])
def _mla_rope_store_fp8_kernel(
    latent_ptr, cos_ptr, sin_ptr, locs_ptr, cq_ptr, cs_ptr, cr_ptr, cp_ptr,
    oq_ptr, os_ptr, or_ptr, op_ptr, num_rows,
    stride_l, stride_ct, stride_st, stride_c, stride_o,
    RANK: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, GROUPS: tl.constexpr,
    GROUPS_BLOCK: tl.constexpr, GROUP_SIZE: tl.constexpr, PAD: tl.constexpr,
    PAD_BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr, WRITE_ROWS: tl.constexpr,
    HW_CAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    """Strides are a row's, in bytes; the pointers are the row's parts (e4m3 values,
    float32 scales, bf16 RoPE values, padding bytes) of the cache and of ``rows_out``."""
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    loc = tl.load(locs_ptr + t)
    cached = (loc >= 0) & (loc < num_rows)
    if cached | WRITE_ROWS:
        g = tl.arange(0, GROUPS_BLOCK)
        k = tl.arange(0, GROUP_SIZE)
        g_ok = g < GROUPS
        mask = g_ok[:, None] & (k < GROUP_SIZE)[None, :]
        x = tl.load(latent_ptr + t * stride_l + g[:, None] * GROUP_SIZE + k[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        q, scale = _quantize_tile(x, (k < GROUP_SIZE)[None, :], False, HW_CAST)
        i, ok, c, s, first, second = rope_lanes(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF,
                                                HALF_BLOCK, INTERLEAVE)
        rope = latent_ptr + t * stride_l + RANK
        x1 = tl.load(rope + first, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(rope + second, mask=ok, other=0.0).to(tl.float32)
        # rotated, rounded to the model dtype (the latent the model holds), then to bf16
        r1 = (x1 * c - x2 * s).to(latent_ptr.dtype.element_ty).to(tl.float32)
        r2 = (x2 * c + x1 * s).to(latent_ptr.dtype.element_ty).to(tl.float32)
        b1, b2 = bf16_rne(r1, HW_CAST), bf16_rne(r2, HW_CAST)
        if cached:
            _store_mla_row(cq_ptr, cs_ptr, cr_ptr, cp_ptr, loc * stride_c, q, scale, b1, b2, g, k, mask, g_ok,
                           i, ok, HALF, GROUP_SIZE, PAD, PAD_BLOCK)
        if WRITE_ROWS:
            _store_mla_row(oq_ptr, os_ptr, or_ptr, op_ptr, t * stride_o, q, scale, b1, b2, g, k, mask, g_ok,
                           i, ok, HALF, GROUP_SIZE, PAD, PAD_BLOCK)


@triton.jit
def _store_mla_row(q_ptr, s_ptr, r_ptr, p_ptr, row, q, scale, b1, b2, g, k, mask, g_ok, i, ok,
                   HALF: tl.constexpr, GROUP_SIZE: tl.constexpr, PAD: tl.constexpr,
                   PAD_BLOCK: tl.constexpr):
    """One packed row at byte offset ``row``: e4m3 values, float32 scales, the two bf16
    RoPE halves, zero padding."""
    tl.store(q_ptr + row + g[:, None] * GROUP_SIZE + k[None, :], q, mask=mask)
    tl.store(s_ptr + row // 4 + g, scale, mask=g_ok)
    tl.store(r_ptr + row // 2 + i, b1, mask=ok)
    tl.store(r_ptr + row // 2 + HALF + i, b2, mask=ok)
    p = tl.arange(0, PAD_BLOCK)
    tl.store(p_ptr + row + p, tl.zeros((PAD_BLOCK,), dtype=tl.uint8), mask=p < PAD)


def _check_mla(latent, cos, sin, interleave, cache, locs, rows_out, kv_lora_rank) -> int:
    """The packed row's bytes; raises ValueError naming the argument."""
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2 or latent.dtype not in _DTYPES:
        raise ValueError(f"latent must be a 2-D tensor [T, R + P] of one of {_DTYPES}, got "
                         f"{getattr(latent, 'dtype', type(latent))} "
                         f"{tuple(getattr(latent, 'shape', ()))}")
    if latent.stride(1) != 1:
        raise ValueError(f"latent must be dense along its last dim, got strides {latent.stride()}")
    num_tokens, width = latent.shape
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or kv_lora_rank <= 0 \
            or kv_lora_rank % 16 or kv_lora_rank >= width or (width - kv_lora_rank) % 2:
        raise ValueError(f"kv_lora_rank must be a positive multiple of 16 below the latent width "
                         f"{width} leaving an even RoPE part, got kv_lora_rank={kv_lora_rank!r}")
    half = (width - kv_lora_rank) // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.shape != (num_tokens, half) or (
                t.dtype != torch.float32) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a dense float32 [{num_tokens}, {half}] tensor, got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if not isinstance(interleave, bool):
        raise ValueError(f"interleave must be a bool, got interleave={interleave!r}")
    packed = mla_fp8_row_bytes(kv_lora_rank, width - kv_lora_rank)
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 2 \
            or cache.shape[1] < packed or cache.stride(1) != 1 or cache.stride(0) % 4:
        raise ValueError(f"cache must be uint8 [R, row_stride >= {packed}] with dense rows "
                         f"4-byte aligned, got {getattr(cache, 'dtype', type(cache))} "
                         f"{tuple(getattr(cache, 'shape', ()))}")
    if rows_out is not None and (not isinstance(rows_out, torch.Tensor) or rows_out.dtype != torch.uint8
                                 or tuple(rows_out.shape) != (num_tokens, cache.shape[1])
                                 or rows_out.stride(1) != 1 or rows_out.stride(0) % 4):
        raise ValueError(f"rows_out must be uint8 [{num_tokens}, {cache.shape[1]}] with dense rows "
                         f"4-byte aligned, got {getattr(rows_out, 'dtype', type(rows_out))} "
                         f"{tuple(getattr(rows_out, 'shape', ()))}")
    if not isinstance(locs, torch.Tensor) or locs.shape != (num_tokens,) or locs.dtype != torch.int64:
        raise ValueError(f"locs must be a [{num_tokens}] int64 tensor, got "
                         f"{getattr(locs, 'shape', type(locs))}")
    check_same_device(latent=latent, cos=cos, sin=sin, cache=cache, locs=locs, rows_out=rows_out)
    if not locs.is_cuda and num_tokens and int(locs.max()) >= cache.shape[0]:
        raise ValueError(f"locs holds {int(locs.max())}, beyond the {cache.shape[0]} cache rows")
    return packed


def _row_parts(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, packed: int):
    """A ``[N, stride]`` uint8 tensor's parts as the kernel's pointers: the packed row's
    three typed views (``kv_rows._views``), then the padding bytes."""
    return (*_views(rows, kv_lora_rank, rope_dim), rows[:, packed:])


def mla_rope_store_fp8_triton(latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                              interleave: bool, cache: torch.Tensor, locs: torch.Tensor,
                              kv_lora_rank: int, rows_out: torch.Tensor | None = None) -> None:
    packed = _check_mla(latent, cos, sin, interleave, cache, locs, rows_out, kv_lora_rank)
    num_tokens, width = latent.shape
    if num_tokens == 0:
        return
    half, group = (width - kv_lora_rank) // 2, mla_fp8_group(kv_lora_rank)
    groups, pad = kv_lora_rank // group, cache.shape[1] - packed
    parts = _row_parts(cache, kv_lora_rank, width - kv_lora_rank, packed)
    out = parts if rows_out is None else _row_parts(rows_out, kv_lora_rank, width - kv_lora_rank, packed)
    _mla_rope_store_fp8_kernel[(num_tokens,)](
        latent, cos, sin, locs, *parts, *out, cache.shape[0],
        latent.stride(0), cos.stride(0), sin.stride(0), cache.stride(0),
        0 if rows_out is None else rows_out.stride(0),
        RANK=kv_lora_rank, HALF=half, HALF_BLOCK=max(2, triton.next_power_of_2(half)),
        GROUPS=groups, GROUPS_BLOCK=triton.next_power_of_2(groups), GROUP_SIZE=group,
        PAD=pad, PAD_BLOCK=max(2, triton.next_power_of_2(pad)), INTERLEAVE=interleave,
        WRITE_ROWS=rows_out is not None, HW_CAST=hw_cast(), num_warps=4, enable_fp_fusion=False,
        **pdl_args(latent),
    )


def mla_rope_store_fp8_ref(latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           interleave: bool, cache: torch.Tensor, locs: torch.Tensor,
                           kv_lora_rank: int, rows_out: torch.Tensor | None = None) -> None:
    """``rope_pairs`` on the RoPE part, ``pack_mla_fp8_rows`` of the row, the padding zero,
    stored at ``locs`` (and into ``rows_out``)."""
    packed = _check_mla(latent, cos, sin, interleave, cache, locs, rows_out, kv_lora_rank)
    rope = rope_pairs(latent[:, None, kv_lora_rank:], cos, sin, interleave)[:, 0]
    rows = torch.zeros((latent.shape[0], cache.shape[1]), dtype=torch.uint8, device=latent.device)
    rows[:, :packed] = pack_mla_fp8_rows_ref(torch.cat((latent[:, :kv_lora_rank], rope), dim=1),
                                             kv_lora_rank)
    keep = locs >= 0
    cache[locs[keep]] = rows[keep]
    if rows_out is not None:
        rows_out.copy_(rows)


def mla_rope_store_fp8(latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       interleave: bool, cache: torch.Tensor, locs: torch.Tensor,
                       kv_lora_rank: int, rows_out: torch.Tensor | None = None) -> None:
    """The latent's RoPE part rotated, the row packed as an FP8 MLA row and stored at
    ``locs`` (and into ``rows_out``): see the module doc."""
    run = mla_rope_store_fp8_triton if use_triton(latent) else mla_rope_store_fp8_ref
    run(latent, cos, sin, interleave, cache, locs, kv_lora_rank, rows_out)
