"""Causal varlen attention for one context-parallel rank's query rows.

FlashAttention-2 style: one program per (query block of one segment, q head)
streams its request's K/V blocks up to the causal limit with an online
softmax in base 2. Key blocks every row of the query block may see run in an
unmasked loop; only the diagonal blocks pay for the causal mask. K/V are read
either contiguously or through a page table (any ``page_size >= 1``).

Launch without a host sync and without helper kernels: the grid is an upper
bound (``cdiv(Tq, BLOCK_M) + S`` slots cover any set of disjoint segments) and
each program finds its (segment, query block) itself from a cumulative sum of
the segments' block counts (O(S) loads per program, from L2); slots past the
last block exit at once.

Head dims need not be powers of two and v's may differ from q/k's: the qk dim
is scored as a power-of-two head part plus a masked tail part (192 = 128 + 64
runs two exact dots), and v's dim is padded to a power of two with masks.

Bounds of the segments (rows inside q and k, page ids inside the pool, rows
disjoint) need the segment data: they are checked when the segment tensors
live on the CPU, and on CUDA only with ``validate=True``, so the per-layer hot
path launches without waiting on the device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.prefill_attention_ref import (
    AttnOutput,
    AttnSegments,
    check_attention_args,
    check_segment_bounds,
    cp_prefill_attention_ref,
    out_shape,
)

__all__ = [
    "AttnOutput",
    "AttnSegments",
    "AttnLaunchConfig",
    "cp_prefill_attention",
    "cp_prefill_attention_ref",
    "cp_prefill_attention_triton",
    "head_dim_split",
]

_LOG2E = 1.4426950408889634


class AttnLaunchConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Below this many (128-row query block, head) programs per SM the chip is
# short of parallel work and 64-row blocks finish sooner (bench notes).
_MIN_BIG_TILE_PROGRAMS_PER_SM = 4


def big_tile_min_rows(num_heads: int, qk_dim: int, dtype: torch.dtype, device: torch.device) -> int | None:
    """The fewest query rows for which ``default_config`` picks the 128-row tile; None
    where the tile does not depend on the rows. Each tile is its own compiled kernel,
    so the prefill warm-up (``prefill.warmup``) runs both sides of this."""
    if device.type != "cuda" or qk_dim > 128 or dtype == torch.float32:
        return None
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    # cdiv(rows, 128) * num_heads >= programs, for the fewest rows
    return (triton.cdiv(_MIN_BIG_TILE_PROGRAMS_PER_SM * num_sms, num_heads) - 1) * 128 + 1


def default_config(q: torch.Tensor) -> AttnLaunchConfig:
    if not q.is_cuda:
        # The interpreter: small tiles so short test sequences still span
        # several query and key blocks and both loops run.
        return AttnLaunchConfig(block_m=32, block_n=16, num_warps=4, num_stages=1)
    if q.shape[2] > 192 or q.dtype == torch.float32:
        return AttnLaunchConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if q.shape[2] > 128:
        if q.shape[1] >= 64:
            # H200, DeepSeek-V3 qk 192 / v 128 with 128 heads at 8k and 32k: 128x128 (8 warps,
            # 2 stages) led eight tile configs, 468/478 TFLOP/s against 64x64's 397 at 32k
            # (bench/deepseek_kernels.py, BENCHMARKS.md).
            return AttnLaunchConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)
        # H200, DeepSeek-V2-Lite's 16 heads, 16k causal: 64x64 led 128x64 and 64x32 (BENCHMARKS.md).
        return AttnLaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    if q.shape[0] < big_tile_min_rows(q.shape[1], q.shape[2], q.dtype, q.device):
        return AttnLaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)
    # H200, Llama-3-8B heads, 16k causal: best of a 19-config sweep (466 TFLOP/s,
    # 128x64 447); later runs put the two within run-to-run spread.
    return AttnLaunchConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _key_rows(pos, kv_start, page_table, stride_pt, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Rows of k/v that hold key positions ``pos`` of one request (int64)."""
    if PAGED:
        page = tl.load(page_table + kv_start.to(tl.int64) * stride_pt + pos // PAGE_SIZE)
        return page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    else:
        return kv_start.to(tl.int64) + pos


class HeadDimSplit(NamedTuple):
    """How the kernel tiles the head dims (all powers of two, each >= 16 for tl.dot)."""

    qk_head: int  # columns [0, qk_head) of q/k: the largest power of two <= Dqk
    qk_tail: int  # columns [qk_head, qk_head + qk_tail), masked to Dqk; 0 when none
    v_block: int  # columns of v and out, masked to Dv


def head_dim_split(qk_dim: int, v_dim: int) -> HeadDimSplit:
    head = max(16, 1 << (qk_dim.bit_length() - 1))
    rest = qk_dim - head
    tail = max(16, triton.next_power_of_2(rest)) if rest > 0 else 0
    return HeadDimSplit(head, tail, max(16, triton.next_power_of_2(v_dim)))


@triton.jit
def _load_cols(base, rows, stride, cols, DIM: tl.constexpr, EVEN: tl.constexpr):
    """``base[rows, cols]``; columns at or past DIM read 0 unless EVEN says none are."""
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(cols < DIM)[None, :], other=0.0)


@triton.jit
def _attend_block(
    acc, l_i, m_i, q, q_tail, K, V, rows, pos_m, pos_n, offs_d, offs_t, offs_v,
    stride_kt, stride_vt, qk_scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, EVEN_HEAD: tl.constexpr,
    HAS_TAIL: tl.constexpr, EVEN_TAIL: tl.constexpr, EVEN_V: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    k = _load_cols(K, rows, stride_kt, offs_d, QK_DIM, EVEN_HEAD)  # [BLOCK_N, QK_HEAD]
    v = _load_cols(V, rows, stride_vt, offs_v, V_DIM, EVEN_V)  # [BLOCK_N, V_BLOCK]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = _load_cols(K, rows, stride_kt, offs_t, QK_DIM, EVEN_TAIL)  # [BLOCK_N, QK_TAIL]
        qk = tl.dot(q_tail, tl.trans(k_tail), qk, input_precision=DOT_PRECISION)
    qk = qk * qk_scale
    if MASKED:
        qk = tl.where(pos_n[None, :] <= pos_m[:, None], qk, float("-inf"))
    # Every row saw at least key 0 by its first block, so m_new is finite.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_segments", "stride_pt"])  # vary per batch
def _cp_prefill_attention_kernel(
    Q, K, V, O, LSE,
    seg_q_start, seg_q_len, seg_q_pos, seg_kv_start, num_segments, page_table,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_pt,
    qk_scale,
    GROUP: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, STORE_LSE: tl.constexpr,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr,
    QK_HEAD: tl.constexpr, QK_TAIL: tl.constexpr, V_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Slots are numbered in segment order; the last block of a segment has
    # the most keys, so launch from the end: long programs first, short ones fill.
    slot = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SEG_BLOCK)
    lens = tl.load(seg_q_len + offs_s, mask=offs_s < num_segments, other=0)
    n_blocks = (tl.maximum(lens, 0) + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(n_blocks, 0)  # slot of the block after each segment's last
    seg = tl.sum((ends <= slot).to(tl.int32), 0)  # empty segments are skipped over
    if seg >= num_segments:
        return
    this = offs_s == seg
    m_block = slot - tl.sum(tl.where(this, ends - n_blocks, 0), 0)
    q_start = tl.load(seg_q_start + seg)
    q_len = tl.load(seg_q_len + seg)
    q_pos = tl.load(seg_q_pos + seg)
    kv_start = tl.load(seg_kv_start + seg)
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, QK_HEAD)
    offs_t = QK_HEAD + tl.arange(0, QK_TAIL if QK_TAIL > 0 else 16)  # unread without a tail
    offs_v = tl.arange(0, V_BLOCK)
    EVEN_HEAD: tl.constexpr = QK_HEAD <= QK_DIM
    HAS_TAIL: tl.constexpr = QK_TAIL > 0
    EVEN_TAIL: tl.constexpr = QK_HEAD + QK_TAIL == QK_DIM
    EVEN_V: tl.constexpr = V_BLOCK == V_DIM
    row_ok = offs_m < q_len
    pos_m = q_pos + offs_m
    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = Q + q_rows[:, None] * stride_qt + head * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & (offs_d < QK_DIM)[None, :],
                other=0.0)  # [BLOCK_M, QK_HEAD]
    q_tail = tl.load(q_ptrs + offs_t[None, :],
                     mask=row_ok[:, None] & (offs_t < QK_DIM)[None, :] & HAS_TAIL,
                     other=0.0)  # [BLOCK_M, QK_TAIL]
    K += kv_head * stride_kh
    V += kv_head * stride_vh

    # Keys [0, full_end) are visible to every row of the block; keys
    # [full_end, kv_end) need the mask. Padding rows only see keys < kv_end
    # that exist, and their results are never stored.
    first_pos = q_pos + m_block * BLOCK_M
    kv_end = q_pos + tl.minimum(q_len, (m_block + 1) * BLOCK_M)
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_BLOCK], dtype=tl.float32)
    for start_n in range(0, full_end, BLOCK_N):
        pos_n = start_n + offs_n
        rows = _key_rows(pos_n, kv_start, page_table, stride_pt, PAGED, PAGE_SIZE)
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, q_tail, K, V, rows, pos_m, pos_n,
                                      offs_d, offs_t, offs_v, stride_kt, stride_vt, qk_scale,
                                      QK_DIM, V_DIM, EVEN_HEAD, HAS_TAIL, EVEN_TAIL, EVEN_V,
                                      False, DOT_PRECISION)
    for start_n in range(full_end, kv_end, BLOCK_N):
        # Clamp past-the-end positions to the last key: an in-bounds load
        # whose score the causal mask drops for every stored row.
        pos_n = start_n + offs_n
        rows = _key_rows(tl.minimum(pos_n, kv_end - 1), kv_start, page_table, stride_pt,
                         PAGED, PAGE_SIZE)
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, q_tail, K, V, rows, pos_m, pos_n,
                                      offs_d, offs_t, offs_v, stride_kt, stride_vt, qk_scale,
                                      QK_DIM, V_DIM, EVEN_HEAD, HAS_TAIL, EVEN_TAIL, EVEN_V,
                                      True, DOT_PRECISION)

    acc = acc / l_i[:, None]
    tl.store(O + q_rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
             acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_v < V_DIM)[None, :])
    if STORE_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # base 2 -> natural log
        tl.store(LSE + q_rows * stride_lt + head * stride_lh, lse, mask=row_ok)


def launch_cp_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    page_table: torch.Tensor | None,
    page_size: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: AttnLaunchConfig,
) -> None:
    """Launch on checked arguments with an explicit tile config (tests, sweeps)."""
    num_segments = segments.q_len.shape[0]
    if num_segments == 0 or q.shape[0] == 0:
        return
    num_slots = triton.cdiv(q.shape[0], config.block_m) + num_segments
    seg = [t.contiguous() for t in segments]
    table = page_table if page_table is not None else seg[3]  # unread when not paged
    lse_arg = lse if lse is not None else out  # unread without STORE_LSE
    split = head_dim_split(q.shape[2], v.shape[2])
    _cp_prefill_attention_kernel[(num_slots, q.shape[1])](
        q, k, v, out, lse_arg, *seg, num_segments, table,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
        table.stride(0) if page_table is not None else 0,
        softmax_scale * _LOG2E,
        GROUP=q.shape[1] // k.shape[1],
        PAGED=page_table is not None,
        PAGE_SIZE=page_size if page_table is not None else 1,
        STORE_LSE=lse is not None,
        QK_DIM=q.shape[2],
        V_DIM=v.shape[2],
        QK_HEAD=split.qk_head,
        QK_TAIL=split.qk_tail,
        V_BLOCK=split.v_block,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        SEG_BLOCK=max(2, triton.next_power_of_2(num_segments)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def cp_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    *,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor | AttnOutput:
    """Triton launcher; see the module docstring for when bounds are checked."""
    check_attention_args(q, k, v, segments, softmax_scale, page_table, page_size, out, return_lse, lse_out)
    if validate or not segments.q_len.is_cuda:
        check_segment_bounds(q, k, segments, page_table, page_size)
    if out is None:
        out = q.new_empty(out_shape(q, v))
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else q.new_empty(q.shape[:2], dtype=torch.float32)
    launch_cp_prefill_attention(q, k, v, segments, float(softmax_scale), page_table, page_size,
                                out, lse, default_config(q))
    return AttnOutput(out, lse) if return_lse else out


def cp_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    *,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor | AttnOutput:
    """Dispatch: Triton for CUDA tensors (or the opted-in interpreter), else the reference."""
    op = cp_prefill_attention_triton if use_triton(q) else cp_prefill_attention_ref
    return op(q, k, v, segments, softmax_scale, page_table=page_table, page_size=page_size,
              out=out, return_lse=return_lse, lse_out=lse_out, validate=validate)
