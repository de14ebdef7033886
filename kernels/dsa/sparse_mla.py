"""Sparse MLA attention (DSA): each query attends only to its selected latent rows.

The absorbed form, as ``kernels/mla/paged_decode.py``: ``q [., H, R+P]`` (q_nope
through kv_b_proj's K part, then q_pe) scores a latent row over all ``R+P``
values, the values are the row's first ``R``, and ``out [., H, R]`` goes back
through kv_b_proj's V part in the caller. fp32 accumulation, out in q's dtype.

- ``sparse_mla_prefill(q [Tq, H, R+P], latent [N, R+P], indices [Tq, K] int32,
  softmax_scale, kv_lora_rank)``: ``indices[i]`` are rows of ``latent`` (the
  request's gathered rows, in position order), ``-1`` padded.
- ``sparse_mla_decode(q [B, H, R+P], latent_cache [rows, R+P], page_table [B, W]
  int32, indices [B, K] int32, page_size, softmax_scale, kv_lora_rank)``:
  ``indices[b]`` are token positions of request ``b`` (``index_topk``'s
  output), ``-1`` padded; position ``t`` is row ``page_table[b, t // page_size]
  * page_size + t % page_size``.

A query without any selected row gets zeros. Order and repeats inside a row of
``indices`` do not matter beyond rounding (a repeated row counts twice). On CPU
the indices and the page ids they reach are range-checked; on CUDA they are
trusted (checking would cost a sync per layer).

Decode splits each request's ``K`` selected slots over ``num_splits`` programs per
block of heads (flash-decoding): at batch 1 a DeepSeek-V3.2 layer has only two head
blocks, so without splits two SMs of 132 would do the work. Each split writes its
float32 partial output and log2-sum-exp, and ``kernels.mla.merge.merge_mla_partials``
combines them. The split count depends only on shapes (``sparse_decode_grid``), so a
captured step keeps its grid. A split takes at least ``min_split_rows`` slots (32: one
loop step; at batch 1, 64 splits of 2048 slots for each of two 64-head blocks: 128
programs on 132 SMs; the H200 sweep chose it, ``SparseDecodeConfig``), because each
split costs a float32
partial of ``H x R`` (256 KiB at V3.2's 128 x 512) written and merged, against 72 KiB of
bf16 rows it reads. The next block's slots and page ids load one step ahead, so a
step's rows wait on one memory trip, not three. ``bench/sparse_mla_sweep.py`` times the
launch knobs (``SparseDecodeConfig``) on V3.2 shapes.

``sparse_mla_decode`` also reads FP8 latent rows (a uint8 ``latent_cache``, the
latent part of each row the FP8 MLA row of ``kernels/fp8/kv_rows.py``): the
kernel dequantizes the rows it loads as ``paged_mla_decode_attention`` does
(``load_latent_rows``: a row's scales load once per group of 128 values, not once per
value), and the reference dequantizes the selected rows (``dequantized_latent``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.mla.latent_rows import (
    check_latent_cache,
    dequantized_latent,
    latent_out,
    latent_views,
    load_latent_rows,
    row_stride_args,
)
from lanekv.kernels.mla.merge import merge_mla_partials

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
MAX_KV_LORA_RANK = 1024
MAX_ROPE_DIM = 256


class SparseDecodeConfig(NamedTuple):
    """Launch knobs of the sparse decode kernel (bench/sparse_mla_sweep.py sweeps them)."""

    # Query heads per program (at most the head count's power of two), selected rows per
    # loop step, warps (0: 8 for a latent wider than 256, else 4), pipeline stages. The
    # H200 sweep of 2026-12-03 (bench/results/session8_h200/sparse_mla_sweep_h200.json,
    # V3.2 shapes): 64-head blocks on 8 warps with splits of at least 32 rows were the
    # fastest or within 10% of it in every case (batch 1 and 16, bf16 and FP8 rows,
    # 8k-128k): 19.3 / 20.1 us at batch 1 (bf16 / FP8), 138 / 156 us at batch 16, where
    # 32-head blocks took 17.6 / 27.7 and 206 / 371.
    block_h: int = 64
    block_n: int = 32
    num_warps: int = 8
    num_stages: int = 2
    # Auto split count: about this many programs per SM, never fewer than
    # min_split_rows selected slots per split (each split writes a partial).
    programs_per_sm: int = 1
    min_split_rows: int = 32


class SparseDecodeGrid(NamedTuple):
    """The launch grid a batch gets: ``(head_blocks, batch, num_splits)`` programs."""

    block_h: int
    head_blocks: int
    num_splits: int


def choose_sparse_splits(programs: int, topk: int, num_sms: int,
                         config: SparseDecodeConfig) -> int:
    """Splits of each request's selected slots so that the grid fills the SMs."""
    if programs == 0 or topk <= 0:
        return 1
    wanted = triton.cdiv(num_sms * config.programs_per_sm, programs)
    return max(1, min(wanted, triton.cdiv(topk, max(1, config.min_split_rows))))


def sparse_decode_grid(batch: int, heads: int, topk: int, num_sms: int,
                       config: SparseDecodeConfig, num_splits: int | None = None
                       ) -> SparseDecodeGrid:
    """Head block, head blocks and splits of a launch (``num_splits`` None: chosen from the
    shapes alone, so a captured step keeps its grid)."""
    block_h = max(16, min(triton.next_power_of_2(config.block_h), triton.next_power_of_2(heads)))
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits is None:
        num_splits = choose_sparse_splits(batch * head_blocks, topk, num_sms, config)
    return SparseDecodeGrid(block_h, head_blocks, num_splits)


@triton.jit(do_not_specialize=["stride_tb"])
def _sparse_mla_kernel(
    q_ptr, latent_ptr, scale_ptr, rope_ptr, idx_ptr, table_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    scale_log2, num_heads, topk,
    stride_qb, stride_qh, stride_lr, stride_sr, stride_pr, stride_ib, stride_tb, stride_ob,
    stride_oh,
    RANK: tl.constexpr, ROPE: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP: tl.constexpr,
    KV_FP8: tl.constexpr, ALIGN_LR: tl.constexpr, ALIGN_SR: tl.constexpr,
    ALIGN_PR: tl.constexpr,
):
    # The row strides come divided by their known factors (stride_align), so that the
    # compiler sees them: a DSA plane's 648-value bf16 rows load in 16-byte vectors.
    stride_lr = stride_lr * ALIGN_LR
    stride_sr = stride_sr * ALIGN_SR
    stride_pr = stride_pr * ALIGN_PR
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    # The slots are cut into num_splits runs of whole BLOCK_N blocks.
    split_len = tl.cdiv(tl.cdiv(topk, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, topk)
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = RANK + tl.arange(0, BLOCK_P)
    h_ok = h < num_heads
    r_ok = r < RANK
    p_ok = p < RANK + ROPE
    q_row = q_ptr + b * stride_qb + h[:, None] * stride_qh
    q_nope = tl.load(q_row + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    if ROPE > 0:
        q_pe = tl.load(q_row + p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    # The next block's slots and page ids load one iteration ahead, so a block's latent
    # loads wait on one memory trip, not on the slots', then the page table's, then theirs.
    n_next = start + tl.arange(0, BLOCK_N)
    idx_next = tl.load(idx_ptr + b * stride_ib + n_next, mask=n_next < end, other=-1)
    if PAGED:
        page_next = tl.load(table_ptr + b * stride_tb + idx_next // PAGE_SIZE,
                            mask=idx_next >= 0, other=0)
    for n0 in range(start, end, BLOCK_N):
        idx = idx_next
        sel = idx >= 0
        n_next = n0 + BLOCK_N + tl.arange(0, BLOCK_N)
        idx_next = tl.load(idx_ptr + b * stride_ib + n_next, mask=n_next < end, other=-1)
        if PAGED:
            page = page_next
            page_next = tl.load(table_ptr + b * stride_tb + idx_next // PAGE_SIZE,
                                mask=idx_next >= 0, other=0)
            row = page.to(tl.int64) * PAGE_SIZE + idx % PAGE_SIZE
        else:
            row = idx.to(tl.int64)
        # Unselected slots read 0, never a row they do not name.
        if KV_FP8:  # dequantized as they load (ROPE > 0: the launcher checks)
            kv, k_pe = load_latent_rows(latent_ptr, scale_ptr, rope_ptr, row, sel, r, p,
                                        stride_lr, stride_sr, stride_pr, RANK, ROPE, GROUP,
                                        KV_FP8, q_ptr.dtype.element_ty)
            s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
        else:
            base = latent_ptr + row[:, None] * stride_lr
            kv = tl.load(base + r[None, :], mask=sel[:, None] & r_ok[None, :], other=0.0)
            s = tl.dot(q_nope, tl.trans(kv), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
            if ROPE > 0:
                k_pe = tl.load(base + p[None, :], mask=sel[:, None] & p_ok[None, :], other=0.0)
                s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
        s = tl.where(sel[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # A block with no selected slot leaves m at -inf: shift by 0 there, not by -inf.
        shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - shift)
        prob = tl.exp2(s - shift[:, None])
        l = l * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m = m_new
    has_rows = l > 0.0  # false for a split (or a query) without a selected slot
    o = acc / tl.where(has_rows, l, 1.0)[:, None]
    o_mask = h_ok[:, None] & r_ok[None, :]
    if WRITE_PARTIAL:
        # Partials as kernels/mla/paged_decode.py lays them out: lse [B, H, S], o [B, H, S, RANK];
        # a split without rows writes only its lse (-inf), its o is never read.
        slot = (b * num_heads + h) * num_splits + split
        tl.store(part_o_ptr + slot[:, None] * RANK + r[None, :], o,
                 mask=o_mask & has_rows[:, None])
        lse = tl.where(has_rows, m + tl.log2(tl.where(has_rows, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + slot, lse, mask=h_ok)
    else:
        dst = out_ptr + b * stride_ob + h[:, None] * stride_oh + r[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_common(q, latent, indices, softmax_scale, kv_lora_rank, out, latent_name):
    fp8_ok = latent_name == "latent_cache"  # the decode reads FP8 rows; the prefill does not
    for name, t, want, dims in (("q", q, 3, "[rows, H, R+P]"), (latent_name, latent, 2,
                                                                "[rows, R+P]")):
        if not isinstance(t, torch.Tensor) or t.dim() != want:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {want}-D tensor {dims}, got {shape}")
        fp8_rows = fp8_ok and name == latent_name and t.dtype == torch.uint8
        if t.dtype not in _DTYPES and not fp8_rows:
            raise ValueError(f"{name}.dtype must be one of {_DTYPES}, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a dense last dim, got strides {t.stride()}")
    rows, heads, width = q.shape
    if latent.dtype == torch.uint8:
        check_latent_cache(latent, q, kv_lora_rank)
    elif latent.dtype != q.dtype:
        raise ValueError(f"{latent_name}.dtype is {latent.dtype} but q.dtype is {q.dtype}")
    elif latent.shape[1] != width:
        raise ValueError(f"{latent_name} rows have {latent.shape[1]} values but q has {width}")
    if not _is_int(kv_lora_rank) or not 1 <= kv_lora_rank <= min(width, MAX_KV_LORA_RANK):
        raise ValueError(f"kv_lora_rank must be an int in [1, min(q.shape[2] = {width}, "
                         f"{MAX_KV_LORA_RANK})], got {kv_lora_rank!r}")
    if width - kv_lora_rank > MAX_ROPE_DIM:
        raise ValueError(f"q.shape[2] - kv_lora_rank = {width - kv_lora_rank} RoPE dims, more "
                         f"than {MAX_ROPE_DIM}")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2 or (
        indices.dtype != torch.int32
    ) or indices.shape[0] != rows:
        raise ValueError(f"indices must be a 2-D int32 tensor with {rows} rows, "
                         f"got {indices!r:.80}")
    if indices.shape[1] > 1 and indices.stride(1) != 1:
        raise ValueError(f"indices must have a dense last dim, got strides {indices.stride()}")
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    return latent_out(q, out, (rows, heads, kv_lora_rank))


def _check_range(name: str, values: torch.Tensor, limit: int, what: str) -> None:
    if values.numel() and (int(values.min()) < -1 or int(values.max()) >= limit):
        bad = int(values.min()) if int(values.min()) < -1 else int(values.max())
        raise ValueError(f"{name} holds {bad}, outside [-1, {limit}) ({what})")


def _check_prefill(q, latent, indices, softmax_scale, kv_lora_rank, out):
    out = _check_common(q, latent, indices, softmax_scale, kv_lora_rank, out, "latent")
    check_same_device(q=q, latent=latent, indices=indices, out=out)
    if not indices.is_cuda:
        _check_range("indices", indices, latent.shape[0], "the latent rows")
    return out


def _check_decode(q, latent_cache, page_table, indices, page_size, softmax_scale, kv_lora_rank,
                  out):
    out = _check_common(q, latent_cache, indices, softmax_scale, kv_lora_rank, out,
                        "latent_cache")
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or (
        page_table.dtype != torch.int32
    ) or page_table.shape[0] != q.shape[0]:
        raise ValueError(f"page_table must be a 2-D int32 tensor with {q.shape[0]} rows, "
                         f"got {page_table!r:.80}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must have a dense last dim, got strides {page_table.stride()}")
    if not _is_int(page_size) or page_size <= 0 or latent_cache.shape[0] % page_size:
        raise ValueError(f"page_size must be a positive int dividing latent_cache's "
                         f"{latent_cache.shape[0]} rows, got {page_size!r}")
    check_same_device(q=q, latent_cache=latent_cache, page_table=page_table, indices=indices,
                      out=out)
    if not indices.is_cuda:
        width = page_table.shape[1] * page_size
        _check_range("indices", indices, width, "the page table's positions")
        used = indices.clamp_min(0).long() // page_size
        pages = torch.gather(page_table.long(), 1, used)[indices >= 0] if indices.numel() else used
        _check_range("page_table", pages, latent_cache.shape[0] // page_size,
                     "latent_cache pages, at a selected position")
    return out


def _launch(q, latent, indices, page_table, page_size, softmax_scale, kv_lora_rank, out, paged,
            num_splits=1, config=None):
    rows, heads, width = q.shape
    if out.numel() == 0:
        return out
    cfg = config or SparseDecodeConfig()
    rope = width - kv_lora_rank
    num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 1)  # the interpreter runs programs one by one
    block_h, head_blocks, num_splits = sparse_decode_grid(rows, heads, indices.shape[1], num_sms,
                                                          cfg, num_splits)
    write_partial = num_splits > 1
    if write_partial:
        part_o = torch.empty((rows, heads, num_splits, kv_lora_rank), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    table = page_table if paged else indices  # unused when not paged
    values, scales, rope_part, strides, group = latent_views(latent, kv_lora_rank, rope)
    row_strides, aligns = row_stride_args(strides)
    _sparse_mla_kernel[(head_blocks, rows, num_splits)](
        q, values, scales, rope_part, indices, table, out, part_o, part_lse,
        softmax_scale * _LOG2E, heads, indices.shape[1],
        q.stride(0), q.stride(1), *row_strides, indices.stride(0), table.stride(0),
        out.stride(0), out.stride(1), GROUP=group, KV_FP8=latent.dtype == torch.uint8,
        **aligns,
        RANK=kv_lora_rank, ROPE=rope, PAGED=paged, PAGE_SIZE=page_size,
        BLOCK_H=block_h, BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(max(rope, 1))), BLOCK_N=cfg.block_n,
        WRITE_PARTIAL=write_partial, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps or (8 if kv_lora_rank > 256 else 4), num_stages=cfg.num_stages,
    )
    if write_partial:
        merge_mla_partials(part_o, part_lse, out)
    return out


def _attend_ref(q, latent_rows, kv_lora_rank, softmax_scale):
    """One query's heads over its selected rows, float32: [H, R]."""
    if latent_rows.shape[0] == 0:
        return q.new_zeros((q.shape[0], kv_lora_rank), dtype=torch.float32)
    lat = latent_rows.float()
    probs = (q.float() @ lat.T * softmax_scale).softmax(dim=-1)
    return probs @ lat[:, :kv_lora_rank]


def sparse_mla_prefill_triton(q, latent, indices, softmax_scale: float, kv_lora_rank: int, *,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    out = _check_prefill(q, latent, indices, softmax_scale, kv_lora_rank, out)
    return _launch(q, latent, indices, None, 1, softmax_scale, kv_lora_rank, out, paged=False)


def sparse_mla_prefill_ref(q, latent, indices, softmax_scale: float, kv_lora_rank: int, *,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    out = _check_prefill(q, latent, indices, softmax_scale, kv_lora_rank, out)
    for i in range(q.shape[0]):
        rows = indices[i][indices[i] >= 0].long()
        out[i] = _attend_ref(q[i], latent[rows], kv_lora_rank, softmax_scale).to(out.dtype)
    return out


def sparse_mla_prefill(q, latent, indices, softmax_scale: float, kv_lora_rank: int, *,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """Each query over its selected rows of ``latent``."""
    impl = sparse_mla_prefill_triton if use_triton(q) else sparse_mla_prefill_ref
    return impl(q, latent, indices, softmax_scale, kv_lora_rank, out=out)


def _check_splits(num_splits) -> None:
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")


def sparse_mla_decode_triton(q, latent_cache, page_table, indices, page_size: int,
                             softmax_scale: float, kv_lora_rank: int, *,
                             out: torch.Tensor | None = None, num_splits: int | None = None,
                             config: SparseDecodeConfig | None = None) -> torch.Tensor:
    """Triton launcher; ``num_splits`` None picks it from the shapes, ``config``
    overrides the launch knobs (benchmarks sweep both)."""
    _check_splits(num_splits)
    out = _check_decode(q, latent_cache, page_table, indices, page_size, softmax_scale,
                        kv_lora_rank, out)
    return _launch(q, latent_cache, indices, page_table, page_size, softmax_scale, kv_lora_rank,
                   out, paged=True, num_splits=num_splits, config=config)


def sparse_mla_decode_ref(q, latent_cache, page_table, indices, page_size: int,
                          softmax_scale: float, kv_lora_rank: int, *,
                          out: torch.Tensor | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """Plain torch, one request at a time in float32; ``num_splits`` has no effect here."""
    _check_splits(num_splits)
    out = _check_decode(q, latent_cache, page_table, indices, page_size, softmax_scale,
                        kv_lora_rank, out)
    for b in range(q.shape[0]):
        t = indices[b][indices[b] >= 0].long()
        rows = page_table[b, t // page_size].long() * page_size + t % page_size
        latent = dequantized_latent(latent_cache, rows, kv_lora_rank, q.shape[2] - kv_lora_rank,
                                    q.dtype)
        out[b] = _attend_ref(q[b], latent, kv_lora_rank, softmax_scale).to(out.dtype)
    return out


def sparse_mla_decode(q, latent_cache, page_table, indices, page_size: int, softmax_scale: float,
                      kv_lora_rank: int, *, out: torch.Tensor | None = None,
                      num_splits: int | None = None) -> torch.Tensor:
    """Each request's new token over its selected positions of its latent pages."""
    impl = sparse_mla_decode_triton if use_triton(q) else sparse_mla_decode_ref
    return impl(q, latent_cache, page_table, indices, page_size, softmax_scale, kv_lora_rank,
                out=out, num_splits=num_splits)
