"""paged_mla_decode_attention: one query token per request over its MLA latent pages.

The absorbed form of DeepSeek MLA decode: the caller multiplies q_nope by
kv_b_proj's K part into the latent space and appends q_pe, so ``q [B, H, R+P]``
(``R = kv_lora_rank``, ``P`` RoPE dims) scores each cached latent row over all
``R+P`` values, the values are the row's first ``R``, and ``out [B, H, R]``
goes back through kv_b_proj's V part in the caller. Key ``t`` of request ``b``
is row ``page_table[b, t // page_size] * page_size + t % page_size`` of
``latent_cache [rows, R+P]``, which may be a strided view (``pool[l, 0, :, 0, :]``).
A request with ``seq_lens[b] == 0`` gets zeros. fp32 accumulation, out in q's dtype.

Split-KV as in ``kernels/decode_attention.py``: stage 1 runs one program per
(block of heads, request, split of the keys); it loads each latent tile once
for scores and values of all the block's heads and, with several splits,
writes a partial output and log-sum-exp that stage 2 merges. The grid depends
only on shapes and ``num_splits``: lengths come from ``seq_lens`` on the
device, each request's keys are cut into the splits in the kernel, and the int
arguments that vary per batch are not specialized on, so a caller using CUDA
graphs fixes ``num_splits`` and the page table's width.

A captured step's ``num_splits`` is sized for the longest context its page table
allows (264 splits at batch 1 on an H200), so each request uses only as many of
them as its own length fills with ``split_keys`` keys each (``busy_splits_ref``,
computed alike on the device by both stages; ``choose_split_keys`` picks it from
shapes: one 32-key block at small batches, ``min_split_keys`` otherwise): a 1k-token
request at batch 1 runs 33 programs of 32 keys, the other programs exit at once and
write nothing, and the merge reads only the busy splits' partials. A request whose
keys fit one split is written by its stage-1 program straight to ``out`` (no partial)
and the merge leaves it alone, so at short contexts stage 2 is a launch that exits.
``paged_mla_decode_stage1`` stops before stage 2 (``MLAPartials``): the model's decode
merges the partials in the prologue of the output's expansion instead
(``kernels/mla/expand_merge.py``, small batches), one launch fewer.
On CPU the lengths and the page ids they reach are range-checked; on CUDA the
kernel clamps lengths to the page table's width and trusts the page ids.

Latent row strides reach the kernels divided by their largest power-of-two factor up
to 16 (``row_stride_args``), which goes as a constexpr: Triton marks only ints divisible
by 16, and a DSA pool plane's bf16 rows are 648 values apart, which it otherwise loads
one value at a time.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.kv_rows import (
    _views,
    mla_fp8_group,
    mla_fp8_row_bytes,
    unpack_mla_fp8_rows,
)
from lanekv.kernels.kv_layout import check_page_table
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 256


class MLADecodeConfig(NamedTuple):
    """Launch knobs of stage 1 (bench/kernels_mla.py sweeps them)."""

    block_h: int = 16  # query heads per program (tl.dot needs >= 16 rows)
    block_n: int = 32  # latent rows per loop step
    num_warps: int = 4
    num_stages: int = 2
    # Auto split count: aim for this many stage-1 programs per SM, but never
    # give a split fewer than min_split_keys keys (merging costs a pass); on the
    # device a request uses only the splits its own length fills this much.
    programs_per_sm: int = 2
    min_split_keys: int = 64
    # Keys per split where (head block, request) programs are few (``choose_split_keys``);
    # 0: min_split_keys at every batch.
    few_programs_split_keys: int = 32


def default_mla_config(heads: int) -> MLADecodeConfig:
    """Tiles by head count: with many heads, bigger head blocks reread the latent less."""
    if heads >= 64:
        # H200, 128 heads, batch 16 x 4k: 64-head blocks x 8 warps 1.4x the 16-head default
        # (BENCHMARKS.md).
        return MLADecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=2)
    return MLADecodeConfig()


def choose_split_keys(programs: int, num_sms: int, config: MLADecodeConfig) -> int:
    """Fewest keys a busy split takes, from shapes alone, rounded up to whole key blocks.
    Few (head block, request) programs (at most ``num_sms / 16``: batch 1 to 8 at 16 heads
    on an H200) take ``few_programs_split_keys`` (one 32-key block), so that a short
    context still spreads over many SMs (a 1k-token request at batch 1: 33 programs, not
    17; the merge costs no launch where the expansion does it); more programs take
    ``min_split_keys``, which keeps about ``programs_per_sm`` per SM at 1k tokens."""
    few = config.few_programs_split_keys > 0 and 0 < programs * 16 <= num_sms
    keys = config.few_programs_split_keys if few else config.min_split_keys
    return triton.cdiv(max(1, keys), config.block_n) * config.block_n


def choose_mla_splits(programs: int, max_kv_len: int, num_sms: int, config: MLADecodeConfig, *,
                      split_keys: int | None = None) -> int:
    """Splits per (head block, request) so that stage 1 has enough programs; a split never
    gets fewer than ``split_keys`` keys (``config.min_split_keys`` when None)."""
    if programs == 0 or max_kv_len <= 0:
        return 1
    keys = config.min_split_keys if split_keys is None else split_keys
    wanted = triton.cdiv(num_sms * config.programs_per_sm, programs)
    return max(1, min(wanted, triton.cdiv(max_kv_len, keys)))


def busy_splits_ref(seq_len: int, num_splits: int, split_keys: int, block_n: int) -> tuple[int, int]:
    """``(busy splits, keys per split)`` of a request of ``seq_len`` keys (host twin of
    ``_busy_splits``): at most ``num_splits``, ``ceil(seq_len / split_keys)`` of them where
    that is fewer (about ``split_keys`` keys each), whole ``block_n`` blocks; split ``i < busy`` holds keys
    ``[i * per_split, min((i + 1) * per_split, seq_len))``, never none."""
    used = min(max(triton.cdiv(seq_len, split_keys), 1), num_splits)
    per_split = max(triton.cdiv(triton.cdiv(seq_len, used), block_n), 1) * block_n
    return triton.cdiv(seq_len, per_split), per_split


@triton.jit
def _busy_splits(seq_len, num_splits, split_keys, BLOCK_N: tl.constexpr):
    """(busy splits, keys per split) of one request: ``busy_splits_ref`` on the device."""
    used = tl.minimum(tl.maximum(tl.cdiv(seq_len, split_keys), 1), num_splits)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len, used), BLOCK_N), 1) * BLOCK_N
    return tl.cdiv(seq_len, per_split), per_split


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


@triton.jit(do_not_specialize=["max_kv_len", "stride_tb", "split_keys"])
def _paged_mla_decode_kernel(
    q_ptr, latent_ptr, scale_ptr, rope_ptr, table_ptr, lens_ptr, part_o_ptr, part_lse_ptr,
    out_ptr, scale_log2, max_kv_len, num_heads, split_keys,
    stride_qb, stride_qh, stride_lr, stride_sr, stride_pr, stride_tb, stride_ob, stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP: tl.constexpr,
    KV_FP8: tl.constexpr, ALIGN_LR: tl.constexpr, ALIGN_SR: tl.constexpr,
    ALIGN_PR: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    # The row strides come divided by their known factors (stride_align), so that the
    # compiler sees the factors and loads the latent rows in whole 16-byte vectors.
    stride_lr = stride_lr * ALIGN_LR
    stride_sr = stride_sr * ALIGN_SR
    stride_pr = stride_pr * ALIGN_PR
    # Head blocks vary fastest, so the programs sharing a request's latent tiles run together.
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.minimum(tl.load(lens_ptr + b), max_kv_len)
    # A request takes only the splits its length fills with split_keys keys each, in
    # whole key blocks (a captured grid is sized for the longest context); the others
    # exit here and write nothing. Split 0 always runs (zeros for an empty request).
    busy, split_len = _busy_splits(seq_len, num_splits, split_keys, BLOCK_N)
    if (split > 0) & (split >= busy):
        return
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = RANK + tl.arange(0, BLOCK_P)
    h_ok = h < num_heads
    r_ok = r < RANK
    p_ok = p < RANK + ROPE
    q_row = q_ptr + b * stride_qb + h[:, None] * stride_qh
    q_nope = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_pe = tl.load(q_row + p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # The page ids of the next key block load one iteration ahead, so a block's latent
    # loads wait on one memory trip, not on the page table's and then their own.
    t_next = start + tl.arange(0, BLOCK_N)
    page_next = tl.load(table_ptr + b * stride_tb + t_next // PAGE_SIZE, mask=t_next < end,
                        other=0)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page = page_next
        t_next = t + BLOCK_N
        page_next = tl.load(table_ptr + b * stride_tb + t_next // PAGE_SIZE, mask=t_next < end,
                            other=0)
        rows = page.to(tl.int64) * PAGE_SIZE + t % PAGE_SIZE
        # Masked rows read 0, never a neighbour's (or a poisoned unused) row.
        kv, k_pe = load_latent_rows(latent_ptr, scale_ptr, rope_ptr, rows, t_ok, r, p, stride_lr,
                                    stride_sr, stride_pr, RANK, ROPE, GROUP, KV_FP8,
                                    q_ptr.dtype.element_ty)
        s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
        s = tl.where(t_ok[None, :], s * scale_log2, float("-inf"))
        # The loop runs only over blocks with a key, so m_new is finite.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m = m_new

    has_keys = l > 0.0  # false only for seq_len 0 (a busy split has keys)
    o = acc / tl.where(has_keys, l, 1.0)[:, None]
    o_mask = h_ok[:, None] & r_ok[None, :]
    busy_h = tl.zeros([BLOCK_H], tl.int32) + busy  # per row: masks take blocks
    if WRITE_PARTIAL:
        # Partials of the busy splits: lse [B, H, num_splits], o [B, H, num_splits, RANK];
        # a request with one busy split writes its output instead (nothing to merge).
        partial = h_ok & (busy_h > 1)
        slot = (b * num_heads + h) * num_splits + split
        tl.store(part_o_ptr + slot[:, None] * RANK + r[None, :], o,
                 mask=o_mask & partial[:, None])
        tl.store(part_lse_ptr + slot, m + tl.log2(tl.where(has_keys, l, 1.0)), mask=partial)
        direct = busy_h <= 1
    else:
        direct = busy_h >= 0  # always
    dst = out_ptr + b * stride_ob + h[:, None] * stride_oh + r[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask & direct[:, None])


@triton.jit(do_not_specialize=["num_splits", "max_kv_len", "split_keys"])
def _mla_decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lens_ptr, num_heads, num_splits, max_kv_len, split_keys,
    stride_ob, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HAS_LENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    first = (b * num_heads + h) * num_splits
    if HAS_LENS:  # the dense kernel's partials: only its busy splits wrote any
        seq_len = tl.minimum(tl.load(lens_ptr + b), max_kv_len)
        used, _ = _busy_splits(seq_len, num_splits, split_keys, BLOCK_N)
        fewest = 2  # one busy split: stage 1 wrote the output
    else:  # every split wrote its lse (-inf: no keys, its o unwritten)
        used = num_splits
        fewest = 1
    if used >= fewest:
        s = tl.arange(0, BLOCK_S)
        top = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, used, BLOCK_S):
            top = tl.maximum(top, tl.load(part_lse_ptr + first + s0 + s, mask=s0 + s < used,
                                          other=float("-inf")))
        top_all = tl.max(top, 0)
        top_all = tl.where(top_all > float("-inf"), top_all, 0.0)  # all empty: weights 0
        r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # this program's latent columns
        r_ok = r < RANK
        acc = tl.zeros([BLOCK_R], tl.float32)
        total = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, used, BLOCK_S):
            lse = tl.load(part_lse_ptr + first + s0 + s, mask=s0 + s < used, other=float("-inf"))
            weight = tl.exp2(lse - top_all)  # 0 past the used splits and for an empty one
            o = tl.load(part_o_ptr + (first + s0 + s)[:, None] * RANK + r[None, :],
                        mask=(weight > 0.0)[:, None] & r_ok[None, :], other=0.0)
            acc += tl.sum(weight[:, None] * o, 0)
            total += weight
        norm = tl.sum(total, 0)
        merged = acc / tl.where(norm > 0.0, norm, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + r,
                 merged.to(out_ptr.dtype.element_ty), mask=r_ok)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_args(q, latent_cache, page_table, seq_lens, page_size, softmax_scale, kv_lora_rank,
                out, num_splits) -> torch.Tensor:
    """Validate every argument (ValueError naming it); returns ``out``, allocated if None."""
    for name, t, dims in (("q", q, "[B, H, R+P]"), ("latent_cache", latent_cache, "[rows, R+P]")):
        want_dim = 3 if name == "q" else 2
        if not isinstance(t, torch.Tensor) or t.dim() != want_dim:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {want_dim}-D tensor {dims}, got {shape}")
        fp8_rows = name == "latent_cache" and t.dtype == torch.uint8  # FP8 latent rows
        if t.dtype not in _DTYPES and not fp8_rows:
            raise ValueError(f"{name}.dtype must be one of {_DTYPES} (or uint8 FP8 rows for "
                             f"latent_cache), got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a dense last dim, got strides {t.stride()}")
    batch, heads, width = q.shape
    check_latent_cache(latent_cache, q, kv_lora_rank)
    # A latent row is R values and then P >= 1 RoPE values (DESIGN.md, MLA pages).
    if not _is_int(kv_lora_rank) or not 1 <= kv_lora_rank <= min(width - 1, MAX_KV_LORA_RANK):
        raise ValueError(f"kv_lora_rank must be an int in [1, {min(width - 1, MAX_KV_LORA_RANK)}] "
                         f"(q.shape[2] = {width}), got {kv_lora_rank!r}")
    if width - kv_lora_rank > MAX_ROPE_DIM:
        raise ValueError(f"q.shape[2] - kv_lora_rank = {width - kv_lora_rank} RoPE dims, "
                         f"more than {MAX_ROPE_DIM}")
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or (
        page_table.dtype != torch.int32
    ):
        raise ValueError(f"page_table must be a 2-D int32 tensor, got {page_table!r:.80}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must have a dense last dim, got strides {page_table.stride()}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or (
        seq_lens.dtype != torch.int32
    ):
        raise ValueError(f"seq_lens must be a 1-D int32 tensor, got {seq_lens!r:.80}")
    if not _is_int(page_size) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    check_same_device(q=q, latent_cache=latent_cache, page_table=page_table, seq_lens=seq_lens,
                      out=out)
    rows = latent_cache.shape[0]
    if rows % page_size != 0:
        raise ValueError(f"latent_cache has {rows} rows, not a multiple of page_size {page_size}")
    if seq_lens.shape[0] != batch or page_table.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries and page_table "
                         f"{page_table.shape[0]} rows, but q has batch {batch}")
    shape = (batch, heads, kv_lora_rank)
    if out is None:
        out = q.new_empty(shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != q.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else repr(out)
        raise ValueError(f"out is {got}, expected {shape} {q.dtype}")
    if kv_lora_rank > 1 and out.stride(2) != 1:
        raise ValueError(f"out must have a dense last dim, got strides {out.stride()}")
    if not seq_lens.is_cuda and batch > 0:
        check_page_table(page_table, seq_lens, page_size, rows // page_size, "latent_cache")
    return out


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


class MLAPartials(NamedTuple):
    """Stage 1's result. ``out [B, H, R]`` holds the output of every request whose keys
    fit one split (of all of them without partials); with ``part_o [B, H, S, R]`` float32
    and ``part_lse [B, H, S]`` the others' busy splits' partials, still to be merged
    (``merge_mla_partials``, or the expansion's prologue: ``kernels/mla/expand_merge.py``).
    ``busy = (seq_lens, max_kv_len, split_keys, block_n)`` says which splits are busy."""

    out: torch.Tensor
    part_o: torch.Tensor | None = None
    part_lse: torch.Tensor | None = None
    busy: tuple[torch.Tensor, int, int, int] | None = None


def paged_mla_decode_stage1(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
) -> MLAPartials:
    """Stage 1 alone (Triton): the direct outputs and the partials left to merge."""
    out = _check_args(q, latent_cache, page_table, seq_lens, page_size, softmax_scale,
                      kv_lora_rank, out, num_splits)
    batch, heads, width = q.shape
    cfg = config or default_mla_config(heads)
    if out.numel() == 0:
        return MLAPartials(out)
    rope = width - kv_lora_rank
    block_h = max(16, min(triton.next_power_of_2(cfg.block_h), triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    max_kv_len = page_table.shape[1] * page_size
    num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 1)  # the interpreter runs programs one by one
    # whole key blocks, so that a busy split's keys start on a block
    split_keys = choose_split_keys(batch * head_blocks, num_sms, cfg)
    if num_splits is None:
        num_splits = choose_mla_splits(batch * head_blocks, max_kv_len, num_sms, cfg,
                                       split_keys=split_keys)
    # Splits are whole key blocks; a request uses those its length fills (module doc).
    write_partial = num_splits > 1
    if write_partial:
        part_o = torch.empty((batch, heads, num_splits, kv_lora_rank), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty((batch, heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))
    values, scales, rope_part, strides, group = latent_views(latent_cache, kv_lora_rank, rope)
    row_strides, aligns = row_stride_args(strides)
    _paged_mla_decode_kernel[(head_blocks, batch, num_splits)](
        q, values, scales, rope_part, page_table, seq_lens, part_o, part_lse, out,
        softmax_scale * _LOG2E, max_kv_len, heads, split_keys,
        q.stride(0), q.stride(1), *row_strides, page_table.stride(0),
        out.stride(0), out.stride(1),
        RANK=kv_lora_rank, ROPE=rope, PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_N=cfg.block_n, WRITE_PARTIAL=write_partial,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", GROUP=group,
        KV_FP8=latent_cache.dtype == torch.uint8, **aligns,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(q),
    )
    if not write_partial:
        return MLAPartials(out)
    return MLAPartials(out, part_o, part_lse, (seq_lens, max_kv_len, split_keys, cfg.block_n))


def paged_mla_decode_attention_triton(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the launch knobs (benchmarks sweep them)."""
    parts = paged_mla_decode_stage1(q, latent_cache, page_table, seq_lens, page_size,
                                    softmax_scale, kv_lora_rank, out=out, num_splits=num_splits,
                                    config=config)
    if parts.part_o is not None:
        merge_mla_partials(parts.part_o, parts.part_lse, parts.out, busy=parts.busy)
    return parts.out


def merge_mla_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, *,
                       busy: tuple[torch.Tensor, int, int, int] | None = None) -> None:
    """Stage 2 of a split decode: ``part_o [B, H, S, R]`` float32 partial outputs and
    ``part_lse [B, H, S]`` their log2-sum-exp (``-inf`` for a split without keys, whose
    ``o`` is never read) -> ``out [B, H, R]`` (any strides but a dense last dim), the
    softmax-weighted merge. Shared by the dense and the sparse (DSA) MLA decode kernels.
    ``busy = (seq_lens, max_kv_len, split_keys, block_n)`` (the dense kernel's): request
    ``b`` wrote only its ``busy_splits`` partials, and none (its output is written
    already) when that is one."""
    batch, heads, splits, rank = part_o.shape
    lens, max_kv_len, split_keys, block_n = busy if busy is not None else (part_lse, 0, 1, 1)
    # Columns of the latent cut over programs too, so that a long context's many partials
    # (264 splits x 2 KiB per head at batch 1) stream through several SMs per head.
    block_r = min(128, max(16, triton.next_power_of_2(rank))) if part_o.is_cuda else 16
    # 32 splits a loop step on the GPU: each step's loads wait on the one before, and the
    # sparse kernel at batch 1 writes 32 ([32, 128] float32 is 32 registers a thread at 4
    # warps). Fixed, not by split count: a warm-up's split count compiles the step's merge.
    block_s = 32 if part_o.is_cuda else 8
    _mla_decode_merge_kernel[(heads, batch, triton.cdiv(rank, block_r))](
        part_o, part_lse, out, lens, heads, splits, max_kv_len, split_keys, out.stride(0),
        out.stride(1), RANK=rank, BLOCK_R=block_r, BLOCK_S=block_s,
        HAS_LENS=busy is not None, BLOCK_N=block_n, **pdl_args(out),
    )


def paged_mla_decode_attention_ref(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time in float32; ``num_splits`` has no effect here."""
    out = _check_args(q, latent_cache, page_table, seq_lens, page_size, softmax_scale,
                      kv_lora_rank, out, num_splits)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        t = torch.arange(seq_len, device=q.device)
        rows = page_table[b, t // page_size].to(torch.int64) * page_size + t % page_size
        latent = dequantized_latent(latent_cache, rows, kv_lora_rank, q.shape[2] - kv_lora_rank,
                                    q.dtype).float()  # [seq_len, R+P]
        probs = (q[b].float() @ latent.T * softmax_scale).softmax(dim=-1)  # [H, seq_len]
        out[b] = (probs @ latent[:, :kv_lora_rank]).to(out.dtype)
    return out


def paged_mla_decode_attention(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode attention of each request's one query token (see module doc)."""
    run = paged_mla_decode_attention_triton if use_triton(q) else paged_mla_decode_attention_ref
    return run(q, latent_cache, page_table, seq_lens, page_size, softmax_scale, kv_lora_rank,
               out=out, num_splits=num_splits)


def paged_mla_decode_partials(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    num_splits: int | None = None,
) -> MLAPartials:
    """``paged_mla_decode_attention`` before the merge: stage 1 (Triton), or the
    reference's finished output as ``MLAPartials`` without partials."""
    if use_triton(q):
        return paged_mla_decode_stage1(q, latent_cache, page_table, seq_lens, page_size,
                                       softmax_scale, kv_lora_rank, num_splits=num_splits)
    return MLAPartials(paged_mla_decode_attention_ref(
        q, latent_cache, page_table, seq_lens, page_size, softmax_scale, kv_lora_rank,
        num_splits=num_splits))


# ---- the absorbed form's projections: q_nope into the latent space, the output out of it ----

# Decode batches up to this many tokens take the Triton projections below; larger ones
# (DSA's sparse prefill) the batched GEMMs of the references.
MAX_PROJECTION_TOKENS = 64


@triton.jit(do_not_specialize=["num_tokens"])
def _absorb_query_kernel(
    q_ptr, w_ptr, out_ptr, num_tokens,
    stride_qt, stride_qh, stride_wh, stride_wd, stride_ot, stride_oh,
    NOPE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    q_head = q_ptr + h * stride_qh
    o_head = out_ptr + h * stride_oh
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for d0 in range(0, NOPE, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < NOPE
            a = tl.load(q_head + t[:, None].to(tl.int64) * stride_qt + d[None, :],
                        mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(w_ptr + h * stride_wh + d[:, None] * stride_wd + r[None, :],
                        mask=d_ok[:, None] & r_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        tl.store(o_head + t[:, None].to(tl.int64) * stride_ot + r[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & r_ok[None, :])
        if tl.program_id(1) == 0:  # q_pe goes after the latent part as it is
            p = tl.arange(0, BLOCK_P)
            p_ok = p < ROPE
            pe = tl.load(q_head + t[:, None].to(tl.int64) * stride_qt + NOPE + p[None, :],
                         mask=t_ok[:, None] & p_ok[None, :], other=0.0)
            tl.store(o_head + t[:, None].to(tl.int64) * stride_ot + RANK + p[None, :], pe,
                     mask=t_ok[:, None] & p_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _expand_output_kernel(
    o_ptr, w_ptr, out_ptr, num_tokens,
    stride_ot, stride_oh, stride_wh, stride_wv, stride_yt, stride_yh,
    RANK: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V_DIM
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < RANK
            a = tl.load(o_ptr + t[:, None].to(tl.int64) * stride_ot + h * stride_oh + r[None, :],
                        mask=t_ok[:, None] & r_ok[None, :], other=0.0)
            w = tl.load(w_ptr + h * stride_wh + v[None, :] * stride_wv + r[:, None],
                        mask=r_ok[:, None] & v_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        tl.store(out_ptr + t[:, None].to(tl.int64) * stride_yt + h * stride_yh + v[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


def _check_projection(name: str, x: torch.Tensor, w: torch.Tensor, w_name: str, x_dim: int,
                      w_shape: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be a 3-D tensor [T, H, {x_dim}] of {_DTYPES}, got "
                         f"{getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != x.shape[1]:
        raise ValueError(f"{w_name} must be a 3-D tensor {w_shape} with {name}'s "
                         f"{x.shape[1]} heads, got {getattr(w, 'shape', type(w))}")
    if w.dtype != x.dtype:
        raise ValueError(f"{w_name}.dtype is {w.dtype} but {name}.dtype is {x.dtype}")
    for n, t in ((name, x), (w_name, w)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{n} must have a dense last dim, got strides {t.stride()}")
    check_same_device(**{name: x, w_name: w})


def _check_absorb(q, w_k) -> None:
    _check_projection("q", q, w_k, "w_k", "D + P", "[H, D, R]")
    if not 1 <= w_k.shape[1] <= q.shape[2]:
        raise ValueError(f"w_k has {w_k.shape[1]} rows per head (qk_nope), more than q's "
                         f"{q.shape[2]} values")
    if q.shape[2] - w_k.shape[1] > MAX_ROPE_DIM or w_k.shape[2] > MAX_KV_LORA_RANK:
        raise ValueError(f"w_k {tuple(w_k.shape)} and q {tuple(q.shape)}: at most "
                         f"{MAX_KV_LORA_RANK} latent and {MAX_ROPE_DIM} RoPE values")


def _check_expand(o_latent, w_v) -> None:
    _check_projection("o_latent", o_latent, w_v, "w_v", "R", "[H, V, R]")
    if w_v.shape[2] != o_latent.shape[2]:
        raise ValueError(f"w_v rows have {w_v.shape[2]} values but o_latent has "
                         f"{o_latent.shape[2]}")


def mla_absorb_query_triton(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    _check_absorb(q, w_k)
    tokens, heads, width = q.shape
    nope, rank = w_k.shape[1], w_k.shape[2]
    rope = width - nope
    out = q.new_empty((tokens, heads, rank + rope))
    if out.numel() == 0:
        return out
    block_r = 64 if q.is_cuda else 16
    _absorb_query_kernel[(heads, triton.cdiv(rank, block_r))](
        q, w_k, out, tokens,
        q.stride(0), q.stride(1), w_k.stride(0), w_k.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, RANK=rank, ROPE=rope, BLOCK_T=16, BLOCK_D=64 if q.is_cuda else 16,
        BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(max(rope, 1))),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=2, **pdl_args(q),
    )
    return out


def mla_absorb_query_ref(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    _check_absorb(q, w_k)
    q_nope, q_pe = q.split([w_k.shape[1], q.shape[2] - w_k.shape[1]], dim=-1)
    return torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_k), q_pe), dim=-1)


def mla_absorb_query(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """``q [T, H, D + P]`` (q_nope, then q_pe) and kv_b_proj's K part ``w_k [H, D, R]`` ->
    ``[T, H, R + P]``: q_nope through ``w_k`` into the latent space, then q_pe. One launch
    for a decode batch (the batched GEMM, transposes and concatenation otherwise)."""
    small = q.shape[0] <= MAX_PROJECTION_TOKENS if isinstance(q, torch.Tensor) else False
    return (mla_absorb_query_triton if small and use_triton(q) else mla_absorb_query_ref)(q, w_k)


def mla_expand_output_triton(o_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    _check_expand(o_latent, w_v)
    tokens, heads, rank = o_latent.shape
    v_dim = w_v.shape[1]
    out = o_latent.new_empty((tokens, heads, v_dim))
    if out.numel() == 0:
        return out
    # On the GPU: 32 columns per program, 16 where that leaves SMs idle (few heads).
    block_v = 32 if o_latent.is_cuda and heads * triton.cdiv(v_dim, 32) >= 128 else 16
    _expand_output_kernel[(heads, triton.cdiv(v_dim, block_v))](
        o_latent, w_v, out, tokens,
        o_latent.stride(0), o_latent.stride(1), w_v.stride(0), w_v.stride(1),
        out.stride(0), out.stride(1),
        RANK=rank, V_DIM=v_dim, BLOCK_T=16, BLOCK_R=128 if o_latent.is_cuda else 16,
        BLOCK_V=block_v, DOT_PRECISION="ieee" if o_latent.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2, **pdl_args(o_latent),
    )
    return out


def mla_expand_output_ref(o_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    _check_expand(o_latent, w_v)
    return torch.einsum("thr,hvr->thv", o_latent, w_v)


def mla_expand_output(o_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """Attention output in the latent space ``o_latent [T, H, R]`` through kv_b_proj's V
    part ``w_v [H, V, R]`` -> ``[T, H, V]``, contiguous (o_proj reads it as ``[T, H*V]``
    without a copy). One launch for a decode batch."""
    small = o_latent.shape[0] <= MAX_PROJECTION_TOKENS if isinstance(o_latent, torch.Tensor) else False
    run = mla_expand_output_triton if small and use_triton(o_latent) else mla_expand_output_ref
    return run(o_latent, w_v)
