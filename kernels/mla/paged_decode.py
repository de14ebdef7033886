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

A request uses only the splits its own length fills (``kernels/mla/splits.py``): a
request whose keys fit one split is written by its stage-1 program straight to ``out``
(no partial) and the merge (``kernels/mla/merge.py``) leaves it alone, so at short
contexts stage 2 is a launch that exits.
``paged_mla_decode_stage1`` stops before stage 2 (``MLAPartials``): the model's decode
merges the partials in the prologue of the output's expansion instead
(``kernels/mla/expand_merge.py``, small batches), one launch fewer.
Arguments are checked, and the reference lives, in ``kernels/mla/paged_decode_ref.py``;
latent rows are read as ``kernels/mla/latent_rows.py`` says.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.mla.latent_rows import latent_views, load_latent_rows, row_stride_args
from lanekv.kernels.mla.merge import merge_mla_partials
from lanekv.kernels.mla.paged_decode_ref import (
    check_paged_decode_args,
    paged_mla_decode_attention_ref,
)
from lanekv.kernels.mla.splits import (
    MLADecodeConfig,
    _busy_splits,
    choose_mla_splits,
    choose_split_keys,
    default_mla_config,
)
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_LOG2E = 1.4426950408889634


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
    out = check_paged_decode_args(q, latent_cache, page_table, seq_lens, page_size, softmax_scale,
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
