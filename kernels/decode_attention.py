"""paged_decode_attention: one query token per request against its paged K/V.

``q [B, Hq, D]`` is the token at position ``seq_lens[b] - 1`` of request
``b``; it attends all ``seq_lens[b]`` keys, its own included (the caller has
stored the current token's K/V first). Key ``t`` of request ``b`` lives at row
``page_table[b, t // page_size] * page_size + t % page_size`` of ``k_cache`` /
``v_cache [R, Hkv, D]``. GQA: query head ``h`` reads kv head
``h // (Hq // Hkv)``. fp16/bf16/fp32 in, fp32 accumulation, output in q's
dtype. A request with ``seq_lens[b] == 0`` gets zeros (not NaN).

Split-KV ("flash decoding"): stage 1 runs one program per (request, kv head,
split of the keys); it reads that split's K/V once for all the query heads of
the group and writes a partial output and its log-sum-exp; stage 2 merges the
splits. The split count is chosen from the batch and the page table's width
(known on the host, so no sync) so that a few long requests still fill the
GPU; each request's own ``seq_lens[b]`` keys are cut into that many splits in
the kernel, so a fixed grid (a captured step) serves any lengths. With one
split stage 1 writes the output directly.

FP8 rows (``kv_cache_dtype=fp8_e4m3``): uint8 caches ``[R, Hkv, D + 4]``, each
head's D e4m3 values then its float32 scale (``kernels/fp8/kv_rows.py``); the
kernel dequantizes K and V as it loads them, ``(e4m3 -> float32) * scale``
rounded once to q's dtype, and the reference dequantizes the rows it reads the
same way (``dequantize_kv_fp8_rows``).

On CPU the seq_lens and the page ids they reach are range-checked. On CUDA
those checks would cost a sync: the kernel clamps seq_lens to the page table's
width, and page ids are trusted.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.kv_rows import dequantize_kv_fp8_rows, kv_fp8_head_bytes, kv_fp8_views
from lanekv.kernels.kv_layout import check_page_table
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634


class DecodeConfig(NamedTuple):
    """Launch knobs of stage 1 (benchmarks sweep them)."""

    # H200 sweep (bench/notes_copy_kernels.md): 64 keys x 4 warps led at
    # batch 64 x 8k; 8 warps or 32/128 keys lost 8-30%.
    block_n: int = 64  # keys per loop step
    num_warps: int = 4
    num_stages: int = 3
    # Auto split count: aim for this many stage-1 programs per SM, but never
    # give a split fewer than min_split_keys keys (merging costs a pass).
    programs_per_sm: int = 2
    min_split_keys: int = 256


def choose_num_splits(
    batch: int, kv_heads: int, max_kv_len: int, num_sms: int, config: DecodeConfig
) -> int:
    """Splits per (request, kv head) so that stage 1 has enough programs."""
    if batch * kv_heads == 0 or max_kv_len <= 0:
        return 1
    wanted = triton.cdiv(num_sms * config.programs_per_sm, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_kv_len, config.min_split_keys)))


# Values that vary per step are never specialised on (no compile per batch shape).
@triton.jit(do_not_specialize=["max_kv_len", "num_splits", "stride_tb"])
def _paged_decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, part_o_ptr, part_lse_ptr, out_ptr,
    scale_log2, max_kv_len, num_q_heads, num_splits,
    stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
    stride_ksr, stride_ksh, stride_vsr, stride_vsh, stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, IEEE_DOT: tl.constexpr, KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.minimum(tl.load(lens_ptr + b), max_kv_len)
    # Each request's own keys are cut into num_splits whole key blocks, so the
    # grid can be fixed (a captured step) while the lengths vary.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    q_head = kv_head * GROUP + h
    h_ok = h < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + q_head[:, None] * stride_qh + d[None, :],
        mask=h_ok[:, None] & d_ok[None, :], other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = tl.load(table_ptr + b * stride_tb + t // PAGE_SIZE, mask=t_ok, other=0)
        row = page.to(tl.int64) * PAGE_SIZE + t % PAGE_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + row[:, None] * stride_kr + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # one float32 scale per row and head; one rounding to q's dtype
            k_scale = tl.load(ks_ptr + kv_head * stride_ksh + row * stride_ksr, mask=t_ok,
                              other=0.0)
            k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(t_ok[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(v_base + row[:, None] * stride_vr + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            v_scale = tl.load(vs_ptr + kv_head * stride_vsh + row * stride_vsr, mask=t_ok,
                              other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        if IEEE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    has_keys = l > 0.0  # false only for an empty split (or seq_len 0)
    o = acc / tl.where(has_keys, l, 1.0)[:, None]
    o_mask = h_ok[:, None] & d_ok[None, :]
    if WRITE_PARTIAL:
        # Partials are [B, Hq, num_splits] (lse) and [B, Hq, num_splits, BLOCK_D] (o).
        slot = (b * num_q_heads + q_head) * num_splits + split
        tl.store(part_o_ptr + slot[:, None] * BLOCK_D + d[None, :], o, mask=o_mask)
        lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + slot, lse, mask=h_ok)
    else:
        dst = out_ptr + b * stride_ob + q_head[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _paged_decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_q_heads, num_splits, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    slot = (b * num_q_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + slot, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    live = lse > float("-inf")
    weight = tl.where(live, tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
    total = tl.sum(weight, 0)
    d_ok = d < HEAD_DIM  # partial rows are padded to BLOCK_D; the padding is never written
    o = tl.load(part_o_ptr + slot[:, None] * BLOCK_D + d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    merged = tl.sum(o * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    dst = out_ptr + b * stride_ob + head * stride_oh + d
    tl.store(dst, merged.to(out_ptr.dtype.element_ty), mask=d_ok)


def _check_args(q, k_cache, v_cache, page_table, seq_lens, page_size, softmax_scale, out,
                num_splits) -> torch.Tensor:
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 3-D tensor, got {shape}")
        if t.dtype not in _DTYPES and not (name != "q" and t.dtype == torch.uint8):
            raise ValueError(f"{name}.dtype must be one of {_DTYPES}, got {t.dtype}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} must have a dense head_dim, got strides {t.stride()}")
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or (
        page_table.dtype != torch.int32
    ):
        raise ValueError(f"page_table must be a 2-D int32 tensor, got {page_table!r:.80}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or (
        seq_lens.dtype != torch.int32
    ):
        raise ValueError(f"seq_lens must be a 1-D int32 tensor, got {seq_lens!r:.80}")
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(softmax_scale, (int, float)) or not math.isfinite(softmax_scale):
        raise ValueError(f"softmax_scale must be a finite number, got {softmax_scale!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                      seq_lens=seq_lens, out=out)
    batch, q_heads, head_dim = q.shape
    rows, kv_heads = k_cache.shape[0], k_cache.shape[1]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)} but k_cache has "
                         f"{tuple(k_cache.shape)}")
    fp8 = k_cache.dtype == torch.uint8  # FP8 rows: D e4m3 bytes then a float32 scale per head
    row_dim = kv_fp8_head_bytes(head_dim) if fp8 else head_dim
    if k_cache.shape[2] != row_dim:
        raise ValueError(f"k_cache rows are {k_cache.shape[2]} wide but q's head_dim {head_dim} "
                         f"needs {row_dim}{' (FP8 rows: D + 4 bytes)' if fp8 else ''}")
    if fp8 and (head_dim % 4 or k_cache.stride(1) % 4 or v_cache.stride(1) % 4):
        raise ValueError(f"FP8 caches need head_dim and row strides of a multiple of 4 bytes, got "
                         f"head_dim={head_dim} strides {k_cache.stride()} {v_cache.stride()}")
    if kv_heads == 0 or q_heads % kv_heads != 0:
        raise ValueError(f"q has {q_heads} heads, not a multiple of k_cache's {kv_heads}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != (torch.uint8 if fp8 else q.dtype):
            raise ValueError(f"{name}.dtype is {t.dtype} but q.dtype is {q.dtype}")
    if rows % page_size != 0:
        raise ValueError(f"k_cache has {rows} rows, not a multiple of page_size {page_size}")
    if seq_lens.shape[0] != batch or page_table.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries and page_table "
                         f"{page_table.shape[0]} rows, but q has batch {batch}")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, expected "
                         f"{tuple(q.shape)} {q.dtype}")
    if head_dim > 1 and out.stride(2) != 1:
        raise ValueError(f"out must have a dense head_dim, got strides {out.stride()}")
    if not seq_lens.is_cuda and batch > 0:
        check_page_table(page_table, seq_lens, page_size, rows // page_size, "cache")
    return out


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the launch knobs (benchmarks sweep them)."""
    out = _check_args(q, k_cache, v_cache, page_table, seq_lens, page_size, softmax_scale, out,
                      num_splits)
    cfg = config or DecodeConfig()
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if out.numel() == 0:
        return out
    max_kv_len = page_table.shape[1] * page_size
    if num_splits is None:
        num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
                   if q.is_cuda else 1)  # the interpreter runs programs one by one
        num_splits = choose_num_splits(batch, kv_heads, max_kv_len, num_sms, cfg)
    # Splits are whole key blocks (the kernel cuts each request's keys).
    num_splits = max(1, min(num_splits, triton.cdiv(max_kv_len, cfg.block_n)))
    group = q_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows
    write_partial = num_splits > 1
    if write_partial:
        part_o = torch.empty((batch, q_heads, num_splits, block_d), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty((batch, q_heads, num_splits), dtype=torch.float32,
                               device=q.device)
    else:
        part_o = part_lse = out  # unused
    fp8 = k_cache.dtype == torch.uint8
    if fp8:  # e4m3 values [R, Hkv, D] and float32 scales [R, Hkv, 1], views of the rows
        k_vals, k_scales = kv_fp8_views(k_cache, head_dim)
        v_vals, v_scales = kv_fp8_views(v_cache, head_dim)
    else:
        k_vals, v_vals, k_scales, v_scales = k_cache, v_cache, k_cache, v_cache
    _paged_decode_attention_kernel[(batch, kv_heads, num_splits)](
        q, k_vals, v_vals, k_scales, v_scales, page_table, seq_lens, part_o, part_lse, out,
        softmax_scale * _LOG2E, max_kv_len, q_heads, num_splits,
        q.stride(0), q.stride(1), k_vals.stride(0), k_vals.stride(1),
        v_vals.stride(0), v_vals.stride(1), k_scales.stride(0), k_scales.stride(1),
        v_scales.stride(0), v_scales.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
        WRITE_PARTIAL=write_partial, IEEE_DOT=q.dtype == torch.float32, KV_FP8=fp8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q),
    )
    if write_partial:
        _paged_decode_merge_kernel[(batch, q_heads)](
            part_o, part_lse, out, q_heads, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)), **pdl_args(q),
        )
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time in float32; ``num_splits`` has no effect here."""
    out = _check_args(q, k_cache, v_cache, page_table, seq_lens, page_size, softmax_scale, out,
                      num_splits)
    group = q.shape[1] // k_cache.shape[1]
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        t = torch.arange(seq_len, device=q.device)
        rows = page_table[b, t // page_size].to(torch.int64) * page_size + t % page_size
        k, v = k_cache[rows], v_cache[rows]
        if k_cache.dtype == torch.uint8:  # FP8 rows, dequantized as the kernel does
            k = dequantize_kv_fp8_rows(k, q.shape[2], q.dtype)
            v = dequantize_kv_fp8_rows(v, q.shape[2], q.dtype)
        k = k.float().repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) * softmax_scale
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v).to(out.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of each request's one query token over its paged keys (see module doc)."""
    run = paged_decode_attention_triton if use_triton(q) else paged_decode_attention_ref
    return run(q, k_cache, v_cache, page_table, seq_lens, page_size, softmax_scale,
               out=out, num_splits=num_splits)
