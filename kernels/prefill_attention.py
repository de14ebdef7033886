"""Causal varlen attention for one context-parallel rank's query rows.

FlashAttention-2 style: one program per (query block of one segment, q head)
streams its request's K/V blocks up to the causal limit with an online
softmax in base 2. Key blocks every row of the query block may see run in an
unmasked loop; only the diagonal blocks pay for the causal mask. K/V are read
either contiguously or through a page table (any ``page_size >= 1``).

A launch config (``AttnLaunchConfig``) picks the tile and variant switches; MLA prefill
runs ``MLA_PREFILL_DEFAULT`` (the one place a measured winner is promoted to), the sweep
``bench/mla_prefill_sweep.py`` times ``MLA_PREFILL_SWEEP`` against SDPA, and
``bench/mla_prefill_compile.py`` compiles any config for sm_90 offline. The
``warp_specialize`` variant is FlashAttention-3's layout through Triton 3.6's Hopper
warp specialization (a TMA producer warpgroup, two 64-row consumer warpgroups).

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
from lanekv.kernels.backend import interpreter_enabled, on_device, use_triton
from lanekv.kernels.prefill_attention_ref import (
    AttnOutput,
    AttnSegments,
    check_attention_args,
    check_segment_bounds,
    cp_prefill_attention_ref,
    out_shape,
)
from triton.tools.tensor_descriptor import TensorDescriptor

__all__ = [
    "AttnOutput",
    "AttnSegments",
    "AttnLaunchConfig",
    "LAUNCH_SWITCHES",
    "MLA_PREFILL_DEFAULT",
    "MLA_PREFILL_FALLBACK",
    "MLA_PREFILL_SWEEP",
    "MLA_PREFILL_VARIANTS",
    "check_launch_config",
    "cp_prefill_attention",
    "cp_prefill_attention_ref",
    "cp_prefill_attention_triton",
    "head_dim_split",
    "runnable_config",
]

_LOG2E = 1.4426950408889634


# The boolean fields of AttnLaunchConfig, in label order.
LAUNCH_SWITCHES = ("tma", "overlap", "heads_fast", "warp_specialize", "exp_bf16")


class AttnLaunchConfig(NamedTuple):
    """A tile and the kernel's variant switches (all off: the plain FlashAttention-2 loop).

    - ``tma``: the unmasked key blocks read K and V through TMA tensor descriptors
      (Hopper and later; contiguous K/V whose qk dim splits exactly into the head and
      tail parts and whose v dim is a power of two, 16-byte aligned rows). The diagonal
      blocks keep the pointer loads, which clamp past-the-end keys to the last one.
    - ``overlap``: the unmasked loop is software-pipelined by hand, so the next block's
      QK^T is issued before this block's softmax runs (FlashAttention-3's intra-warpgroup
      overlap, left to the compiler to make asynchronous).
    - ``heads_fast``: heads on the grid's fast axis (every head's longest query block
      first) instead of one head's query blocks, longest first, then the next head's.
    - ``warp_specialize``: one loop over every visible key block, each masked, q and K/V
      through TMA, asking Triton for warp specialization (``tl.range(...,
      warp_specialize=True)``, ``_ws_key_loop``); needs ``tma`` and not ``overlap``, and
      q's rows aligned as K's. Triton 3.6's Hopper pass takes only this form (one loop, no
      branch in it, no scan before it); at ``num_warps=4`` and ``block_m=128`` it makes a
      TMA producer warpgroup and two consumer warpgroups of 64 rows (384 threads,
      ``num_warps`` per group), at 8 warps it leaves the loop as it is. q's descriptors
      are made in the kernel (Triton's scratch allocator; the launcher sets a torch one
      where none is set). The last block reads up to ``block_n - 1`` rows of k/v past the
      request's visible keys (TMA's zeros past the tensor's end): p weights them by exact
      zeros, so those rows must hold finite values.
    - ``exp_bf16``: the softmax's powers of two in bfloat16, two per special-function
      instruction (``ex2.approx.ftz.bf16x2``, sm_90 and later) instead of one float32 each;
      p feeds a bfloat16 product anyway, and the row sums add the same rounded p (float32
      sums). The exponent is rounded to bfloat16 first: an absolute error in p of at most
      about 7e-4 (largest near p = 0.37), below p's own bfloat16 rounding at p near 1.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    overlap: bool = False
    heads_fast: bool = False
    warp_specialize: bool = False
    exp_bf16: bool = False

    @property
    def label(self) -> str:
        flags = [name for name in LAUNCH_SWITCHES if getattr(self, name)]
        return ",".join(str(x) for x in self[:4]) + ("+" + "+".join(flags) if flags else "")


# MLA prefill (qk 192 = 128 + 64, v 128, bf16, 64+ heads) runs MLA_PREFILL_DEFAULT: the one
# place a sweep's winner is promoted to. Where these tensors cannot take the default's
# switches (tma or warp_specialize on paged or unaligned K/V), MLA_PREFILL_FALLBACK runs.
MLA_PREFILL_DEFAULT = AttnLaunchConfig(128, 128, 8, 2)
MLA_PREFILL_FALLBACK = AttnLaunchConfig(128, 128, 8, 2)

# What bench/mla_prefill_sweep.py times by default (about 150 s of device time at 8k and
# 32k): the default, Triton 3.6's Hopper warp specialization in FlashAttention-3's layout
# (num_warps=4 per group: one TMA producer warpgroup and two 64-row consumer warpgroups,
# 384 threads; consumers get 232 registers by setmaxnreg) at the tiles whose sm_90 compile
# does not spill (bench/mla_prefill_compile.py; 256x64 spills 908 bytes and is left out),
# and the 8-warp TMA loop, never timed before.
MLA_PREFILL_SWEEP = (
    AttnLaunchConfig(128, 128, 8, 2),
    AttnLaunchConfig(128, 128, 4, 2, tma=True, warp_specialize=True),  # 229,776 B shared
    AttnLaunchConfig(128, 128, 4, 2, tma=True, warp_specialize=True, exp_bf16=True),
    AttnLaunchConfig(128, 64, 4, 2, tma=True, warp_specialize=True),
    AttnLaunchConfig(128, 64, 4, 3, tma=True, warp_specialize=True),
    AttnLaunchConfig(128, 64, 4, 4, tma=True, warp_specialize=True),
    AttnLaunchConfig(128, 64, 4, 3, tma=True, warp_specialize=True, exp_bf16=True),
    AttnLaunchConfig(128, 128, 8, 2, tma=True),
)

# Every config the interpreter tests cover: the sweep's and the earlier ones (the last
# device run timed three of them, the default ahead; BENCHMARKS.md). Shared memory per
# pipeline stage is BLOCK_N * (192 + 128) * 2 bytes of K and V, plus BLOCK_M * 192 * 2 of
# q once; 227 KB per block: 128x128 takes 2 * 80 + 48 = 208 KB at 2 stages and would need
# 288 at 3; 128x64 takes 3 * 40 + 48 = 168 at 3 stages and 4 * 40 + 48 = 208 at 4; 64x64
# takes 2 * 40 + 24 = 104 at 2 (two blocks per SM). TMA adds about 1 KB of barriers, the
# warp-specialized loop its producer's buffers (bench/mla_prefill_compile.py).
MLA_PREFILL_VARIANTS = MLA_PREFILL_SWEEP + (
    AttnLaunchConfig(128, 128, 8, 2, tma=True, overlap=True),
    AttnLaunchConfig(128, 128, 8, 2, heads_fast=True),
    AttnLaunchConfig(128, 128, 8, 2, exp_bf16=True),
    AttnLaunchConfig(128, 128, 8, 2, tma=True, exp_bf16=True),
    AttnLaunchConfig(128, 128, 8, 2, tma=True, overlap=True, exp_bf16=True),
    AttnLaunchConfig(128, 64, 8, 3),
    AttnLaunchConfig(128, 64, 8, 4),
    AttnLaunchConfig(128, 64, 8, 4, tma=True),
    AttnLaunchConfig(128, 64, 8, 4, tma=True, overlap=True),
    AttnLaunchConfig(128, 64, 8, 4, exp_bf16=True),
    AttnLaunchConfig(128, 64, 8, 4, tma=True, exp_bf16=True),
    AttnLaunchConfig(128, 64, 8, 4, tma=True, overlap=True, exp_bf16=True),
    # One warpgroup per block at 104 KB: two blocks share an SM and keep out of each
    # other's barriers, so one's softmax can run beside the other's products.
    AttnLaunchConfig(64, 64, 4, 2, tma=True, exp_bf16=True),
    # Unbuffered loads (58 KB), two blocks per SM by registers: each block's loads wait
    # while the other computes.
    AttnLaunchConfig(64, 128, 4, 1, tma=True, exp_bf16=True),
)


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
            # (bench/deepseek_kernels.py, BENCHMARKS.md); bench/mla_prefill_sweep.py picks
            # among the variants since.
            return MLA_PREFILL_DEFAULT
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
def _scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt,
            QK_DIM: tl.constexpr, EVEN_HEAD: tl.constexpr, HAS_TAIL: tl.constexpr,
            EVEN_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores q @ k^T of one key block read through pointers: [BLOCK_M, BLOCK_N]."""
    k = _load_cols(K, rows, stride_kt, offs_d, QK_DIM, EVEN_HEAD)  # [BLOCK_N, QK_HEAD]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = _load_cols(K, rows, stride_kt, offs_t, QK_DIM, EVEN_TAIL)  # [BLOCK_N, QK_TAIL]
        qk = tl.dot(q_tail, tl.trans(k_tail), qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def _scores_tma(q, q_tail, k_desc, k_tail_desc, row, col,
                QK_HEAD: tl.constexpr, HAS_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The same through TMA: key rows [row, row + BLOCK_N), head columns from ``col``."""
    k = k_desc.load([row, col])  # [BLOCK_N, QK_HEAD]
    qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = k_tail_desc.load([row, col + QK_HEAD])  # [BLOCK_N, QK_TAIL]
        qk = tl.dot(q_tail, k_tail.T, qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def _round_bf16(x):
    """float32 rounded to the nearest bfloat16 (ties to even), kept in float32: the
    interpreter has no bfloat16. Infinities stay; NaN never reaches here."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2_bf16(x, INTERPRET: tl.constexpr):
    """2**x for x <= 0 (or -inf) in bfloat16, two per ex2 instruction on the GPU; the
    interpreter rounds the same way in float32."""
    if INTERPRET:
        return _round_bf16(tl.exp2(_round_bf16(x)))
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r",
                                         [x.to(tl.bfloat16)], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)


@triton.jit
def _softmax_step(acc, l_i, m_i, qk, v, pos_m, pos_n, qk_scale,
                  MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr, EXP_BF16: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Online softmax in base 2 over one block of raw scores, then acc += p @ v.

    log2(e) is folded into ``qk_scale`` (> 0, so the row max commutes with the
    scaling): off the diagonal the scores are scaled and shifted in one FMA;
    normalization waits until the end of the row. ``MASKED``: 0 (False) none, 1 (True)
    the causal mask on the scaled scores, 2 the mask on the raw scores and then the same
    FMA as unmasked blocks (one select more per score than none, where 1 takes a
    multiply and a subtract apart: the warp-specialized loop masks every block)."""
    if MASKED == 2:
        qk = tl.where(pos_n[None, :] <= pos_m[:, None], qk, float("-inf"))
    if MASKED == 1:
        qk = tl.where(pos_n[None, :] <= pos_m[:, None], qk * qk_scale, float("-inf"))
        # Every row saw at least key 0 by its first block, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        x = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        x = qk * qk_scale - m_new[:, None]
    if EXP_BF16:
        p = _exp2_bf16(x, INTERPRET)
        p_sum = tl.sum(p.to(tl.float32), 1)
    else:
        p = tl.exp2(x)
        p_sum = tl.sum(p, 1)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + p_sum
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _store_rows(O, LSE, acc, l_i, m_i, rows, ok, head, offs_v, stride_ot, stride_oh, stride_lt,
                stride_lh, V_DIM: tl.constexpr, STORE_LSE: tl.constexpr):
    """Normalize and store the output rows ``rows`` (where ``ok``) of one head, and their
    log-sum-exp (natural log) with STORE_LSE."""
    rows = rows.to(tl.int64)
    acc = acc / l_i[:, None]
    tl.store(O + rows[:, None] * stride_ot + head * stride_oh + offs_v[None, :],
             acc.to(O.dtype.element_ty), mask=ok[:, None] & (offs_v < V_DIM)[None, :])
    if STORE_LSE:
        lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # base 2 -> natural log
        tl.store(LSE + rows * stride_lt + head * stride_lh, lse, mask=ok)


@triton.jit
def _ws_key_loop(Q, q_rows, stride_qt, stride_qh, num_heads, head, q_row, k_desc, k_tail_desc,
                 v_desc, kv_start, k_col, v_col, kv_end, first_pos, qk_scale,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_DIM: tl.constexpr,
                 QK_HEAD: tl.constexpr, QK_TAIL: tl.constexpr, HAS_TAIL: tl.constexpr,
                 V_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr, EXP_BF16: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """The warp-specialized form: the query block's rows from ``q_row`` (positions from
    ``first_pos``) against every visible key block in one loop, each block masked.

    Triton 3.6's Hopper pass takes this shape only: one loop, no branch in it, no scan
    before it, its loads through TMA. At num_warps=4 and BLOCK_M=128 it gives the loads to
    a producer warpgroup and splits every product along the rows between two consumer
    warpgroups of 64 (FlashAttention-3's layout), which meet only at the load barriers.
    q comes through descriptors made here, which the split halves along with the loads
    (a host descriptor keeps its 128-row box against 64-row buffers: Triton 3.9 rejects
    that IR and 3.6 builds it; 64-row halves written out by hand are not split but run
    whole in both consumer warpgroups). They need ``triton.set_allocator`` (the
    launcher's ``_ensure_tma_scratch``). Rows past the segment read other rows of q
    (zeros past its end) and are never stored; the last key block reads up to
    BLOCK_N - 1 rows of k/v past the visible keys, weighted by exact zeros, so those
    rows must be finite."""
    width = (num_heads - 1) * stride_qh + QK_DIM  # q as [rows, heads' columns]
    q_desc = tl.make_tensor_descriptor(Q, shape=[q_rows, width], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, QK_HEAD])
    q = q_desc.load([q_row, head * stride_qh])  # [BLOCK_M, QK_HEAD]
    q_tail = q  # unread without a tail
    if HAS_TAIL:
        q_tail_desc = tl.make_tensor_descriptor(Q, shape=[q_rows, width], strides=[stride_qt, 1],
                                                block_shape=[BLOCK_M, QK_TAIL])
        q_tail = q_tail_desc.load([q_row, head * stride_qh + QK_HEAD])  # [BLOCK_M, QK_TAIL]
    pos_m = first_pos + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_BLOCK], dtype=tl.float32)
    for start_n in tl.range(0, kv_end, BLOCK_N, warp_specialize=True):
        qk = _scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start + start_n, k_col, QK_HEAD,
                         HAS_TAIL, DOT_PRECISION)
        v = v_desc.load([kv_start + start_n, v_col])
        # (pos_m - start_n against offs_n: the causal mask, one subtract per row)
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, pos_m - start_n, offs_n, qk_scale, 2,
                                      DOT_PRECISION, EXP_BF16, INTERPRET)
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_segments", "q_rows", "stride_pt"])  # vary per batch
def _cp_prefill_attention_kernel(
    Q, K, V, O, LSE, k_desc, k_tail_desc, v_desc,
    seg_q_start, seg_q_len, seg_q_pos, seg_kv_start, num_segments, q_rows, page_table,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lt, stride_lh, stride_pt,
    qk_scale,
    GROUP: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, STORE_LSE: tl.constexpr,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr,
    QK_HEAD: tl.constexpr, QK_TAIL: tl.constexpr, V_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG_BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, OVERLAP: tl.constexpr, HEADS_FAST: tl.constexpr, WARP_SPEC: tl.constexpr,
    EXP_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):
    # Slots are numbered in segment order; the last block of a segment has
    # the most keys, so launch from the end: long programs first, short ones fill.
    if HEADS_FAST:
        head = tl.program_id(0)
        slot = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        slot = tl.num_programs(0) - 1 - tl.program_id(0)
        head = tl.program_id(1)
    offs_s = tl.arange(0, SEG_BLOCK)
    lens = tl.load(seg_q_len + offs_s, mask=offs_s < num_segments, other=0)
    n_blocks = (tl.maximum(lens, 0) + BLOCK_M - 1) // BLOCK_M
    if WARP_SPEC:
        # The same prefix sum as a masked [S, S] sum: a scan op stops Triton 3.6's Hopper
        # warp specialization pass (it fails the compile), a reduction does not.
        ends = tl.sum(tl.where(offs_s[None, :] <= offs_s[:, None], n_blocks[None, :], 0), 1)
    else:
        ends = tl.cumsum(n_blocks, 0)  # slot of the block after each segment's last
    seg = tl.sum((ends <= slot).to(tl.int32), 0)  # empty segments are skipped over
    live = seg < num_segments
    if WARP_SPEC:
        # Triton's warp specialization takes structured control flow only: a slot past
        # the last block runs its key loop zero times and stores nothing.
        seg = tl.minimum(seg, num_segments - 1)
    else:
        if not live:
            return
    this = offs_s == seg
    m_block = slot - tl.sum(tl.where(this, ends - n_blocks, 0), 0)
    q_start = tl.load(seg_q_start + seg)
    q_len = tl.where(live, tl.load(seg_q_len + seg), 0)
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
    out_rows = (q_start + offs_m).to(tl.int64)
    if not WARP_SPEC:  # (the warp-specialized loop loads q through TMA)
        q_ptrs = Q + out_rows[:, None] * stride_qt + head * stride_qh
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
    kv_end = tl.where(live, q_pos + tl.minimum(q_len, (m_block + 1) * BLOCK_M), 0)
    full_end = tl.where(live, ((first_pos + 1) // BLOCK_N) * BLOCK_N, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_BLOCK], dtype=tl.float32)
    # TMA coordinates: rows of the request's keys, columns of this kv head in the
    # [rows, heads * stride] view the descriptors were made over.
    k_col = kv_head * stride_kh
    v_col = kv_head * stride_vh
    if WARP_SPEC:
        num_heads = tl.num_programs(0) if HEADS_FAST else tl.num_programs(1)
        acc, l_i, m_i = _ws_key_loop(
            Q, q_rows, stride_qt, stride_qh, num_heads, head, q_start + m_block * BLOCK_M, k_desc,
            k_tail_desc, v_desc, kv_start, k_col, v_col, kv_end, first_pos, qk_scale, BLOCK_M,
            BLOCK_N, QK_DIM, QK_HEAD, QK_TAIL, HAS_TAIL, V_BLOCK, DOT_PRECISION, EXP_BF16, INTERPRET)
    elif OVERLAP:
        # Block j's softmax runs while block j + 1's scores are being computed.
        if full_end > 0:
            if TMA:
                qk = _scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start, k_col,
                                 QK_HEAD, HAS_TAIL, DOT_PRECISION)
            else:
                first = _key_rows(offs_n, kv_start, page_table, stride_pt, PAGED, PAGE_SIZE)
                qk = _scores(q, q_tail, K, first, offs_d, offs_t, stride_kt, QK_DIM, EVEN_HEAD,
                             HAS_TAIL, EVEN_TAIL, DOT_PRECISION)
            for start_n in range(BLOCK_N, full_end, BLOCK_N):
                if TMA:
                    qk_next = _scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start + start_n, k_col,
                                          QK_HEAD, HAS_TAIL, DOT_PRECISION)
                    v = v_desc.load([kv_start + start_n - BLOCK_N, v_col])
                else:
                    rows = _key_rows(start_n + offs_n, kv_start, page_table, stride_pt, PAGED,
                                     PAGE_SIZE)
                    qk_next = _scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt, QK_DIM,
                                      EVEN_HEAD, HAS_TAIL, EVEN_TAIL, DOT_PRECISION)
                    prev = _key_rows(start_n - BLOCK_N + offs_n, kv_start, page_table, stride_pt,
                                     PAGED, PAGE_SIZE)
                    v = _load_cols(V, prev, stride_vt, offs_v, V_DIM, EVEN_V)
                acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, pos_m, offs_n, qk_scale,
                                              False, DOT_PRECISION, EXP_BF16, INTERPRET)
                qk = qk_next
            if TMA:
                v = v_desc.load([kv_start + full_end - BLOCK_N, v_col])
            else:
                last = _key_rows(full_end - BLOCK_N + offs_n, kv_start, page_table, stride_pt,
                                 PAGED, PAGE_SIZE)
                v = _load_cols(V, last, stride_vt, offs_v, V_DIM, EVEN_V)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, pos_m, offs_n, qk_scale,
                                          False, DOT_PRECISION, EXP_BF16, INTERPRET)
    else:
        for start_n in range(0, full_end, BLOCK_N):
            pos_n = start_n + offs_n
            if TMA:
                qk = _scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start + start_n, k_col,
                                 QK_HEAD, HAS_TAIL, DOT_PRECISION)
                v = v_desc.load([kv_start + start_n, v_col])
            else:
                rows = _key_rows(pos_n, kv_start, page_table, stride_pt, PAGED, PAGE_SIZE)
                qk = _scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt, QK_DIM, EVEN_HEAD,
                             HAS_TAIL, EVEN_TAIL, DOT_PRECISION)
                v = _load_cols(V, rows, stride_vt, offs_v, V_DIM, EVEN_V)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, pos_m, pos_n, qk_scale,
                                          False, DOT_PRECISION, EXP_BF16, INTERPRET)
    if not WARP_SPEC:  # the diagonal blocks (the warp-specialized loop took them)
        for start_n in range(full_end, kv_end, BLOCK_N):
            # Clamp past-the-end positions to the last key: an in-bounds load
            # whose score the causal mask drops for every stored row.
            pos_n = start_n + offs_n
            rows = _key_rows(tl.minimum(pos_n, kv_end - 1), kv_start, page_table, stride_pt,
                             PAGED, PAGE_SIZE)
            qk = _scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt, QK_DIM, EVEN_HEAD, HAS_TAIL,
                         EVEN_TAIL, DOT_PRECISION)
            v = _load_cols(V, rows, stride_vt, offs_v, V_DIM, EVEN_V)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, qk, v, pos_m, pos_n, qk_scale,
                                          True, DOT_PRECISION, EXP_BF16, INTERPRET)

    if WARP_SPEC:
        l_i = tl.where(live, l_i, 1.0)  # a slot past the last block saw no key: no 0 / 0
    _store_rows(O, LSE, acc, l_i, m_i, out_rows, row_ok, head, offs_v, stride_ot, stride_oh,
                stride_lt, stride_lh, V_DIM, STORE_LSE)


_MAX_GRID_Y = 65535


def _row_view_ok(t: torch.Tensor) -> bool:
    """TMA over the [rows, heads * stride] view: unit last stride, 16-byte aligned base and rows."""
    item = t.element_size()
    return (t.stride(2) == 1 and t.stride(1) >= t.shape[2] and t.data_ptr() % 16 == 0
            and (t.stride(0) * item) % 16 == 0 and (t.stride(1) * item) % 16 == 0)


def check_launch_config(config: AttnLaunchConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        page_table: torch.Tensor | None) -> None:
    """Refuse a config the kernel cannot run on these tensors (one line naming the field)."""
    for name in ("block_m", "block_n"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
            raise ValueError(f"config.{name} must be a power of two >= 16, got {value!r}")
    for name in ("num_warps", "num_stages"):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config.{name} must be an int >= 1, got {value!r}")
    for name in LAUNCH_SWITCHES:
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"config.{name} must be a bool, got {getattr(config, name)!r}")
    if config.warp_specialize and (config.overlap or not config.tma):
        raise ValueError("config.warp_specialize=True needs tma=True and overlap=False, got "
                         f"tma={config.tma}, overlap={config.overlap}")
    if config.tma:
        split = head_dim_split(q.shape[2], v.shape[2])
        if page_table is not None:
            raise ValueError("config.tma=True reads contiguous K/V only, got a page_table")
        if split.qk_head + split.qk_tail != q.shape[2] or split.v_block != v.shape[2]:
            raise ValueError(f"config.tma=True needs the qk dim to split exactly into powers of two "
                             f"and a power-of-two v dim, got qk {q.shape[2]} "
                             f"({split.qk_head} + {split.qk_tail}) and v {v.shape[2]}")
        for name, t in (("k", k), ("v", v)) + ((("q", q),) if config.warp_specialize else ()):
            if not _row_view_ok(t):
                raise ValueError(f"config.tma=True needs {name} with a unit last stride and 16-byte "
                                 f"aligned base and rows, got strides {tuple(t.stride())}")


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # 128-byte aligned blocks


def _ensure_tma_scratch() -> None:
    """Descriptors made inside a kernel (the warp-specialized q) live in global scratch
    that Triton takes from ``triton.set_allocator``: a torch allocation unless the
    caller set one (Triton's default refuses to launch)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_tma_scratch)


def runnable_config(config: AttnLaunchConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    page_table: torch.Tensor | None) -> AttnLaunchConfig:
    """``config``, or MLA_PREFILL_FALLBACK where these tensors cannot take its switches
    (TMA on paged K/V, a qk dim that does not split exactly, unaligned rows)."""
    if not (config.tma or config.warp_specialize):
        return config
    try:
        check_launch_config(config, q, k, v, page_table)
    except ValueError:
        return MLA_PREFILL_FALLBACK
    return config


def kernel_constexprs(config: AttnLaunchConfig, *, heads: int, kv_heads: int, qk_dim: int, v_dim: int,
                      paged: bool, page_size: int, store_lse: bool, num_segments: int, float32: bool,
                      interpret: bool) -> dict:
    """The kernel's compile-time arguments for one launch (the launcher and the offline
    sm_90 compile, ``bench/mla_prefill_compile.py``, take them from here)."""
    split = head_dim_split(qk_dim, v_dim)
    return dict(
        GROUP=heads // kv_heads, PAGED=paged, PAGE_SIZE=page_size if paged else 1,
        STORE_LSE=store_lse, QK_DIM=qk_dim, V_DIM=v_dim, QK_HEAD=split.qk_head,
        QK_TAIL=split.qk_tail, V_BLOCK=split.v_block, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, SEG_BLOCK=max(2, triton.next_power_of_2(num_segments)),
        DOT_PRECISION="ieee" if float32 else "tf32", TMA=config.tma, OVERLAP=config.overlap,
        HEADS_FAST=config.heads_fast, WARP_SPEC=config.warp_specialize, EXP_BF16=config.exp_bf16,
        INTERPRET=interpret)


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
) -> object | None:
    """Launch on checked arguments with an explicit tile config (tests, sweeps).

    Returns Triton's compiled kernel (registers, spills and shared memory for a sweep's
    record); None when nothing was launched or under the interpreter."""
    check_launch_config(config, q, k, v, page_table)
    num_segments = segments.q_len.shape[0]
    if num_segments == 0 or q.shape[0] == 0:
        return None
    num_slots = triton.cdiv(q.shape[0], config.block_m) + num_segments
    if config.heads_fast and num_slots > _MAX_GRID_Y:
        raise ValueError(f"config.heads_fast=True puts the {num_slots} query blocks on the grid's "
                         f"y axis, which holds at most {_MAX_GRID_Y}; use block_m > {config.block_m}")
    seg = [t.contiguous() for t in segments]
    table = page_table if page_table is not None else seg[3]  # unread when not paged
    lse_arg = lse if lse is not None else out  # unread without STORE_LSE
    split = head_dim_split(q.shape[2], v.shape[2])
    k_desc = k_tail_desc = v_desc = k  # unread without TMA
    if config.warp_specialize and not interpreter_enabled():
        _ensure_tma_scratch()
    if config.tma:
        k_width = (k.shape[1] - 1) * k.stride(1) + k.shape[2]
        v_width = (v.shape[1] - 1) * v.stride(1) + v.shape[2]
        k_desc = TensorDescriptor(k, [k.shape[0], k_width], [k.stride(0), 1],
                                  [config.block_n, split.qk_head])
        if split.qk_tail:
            k_tail_desc = TensorDescriptor(k, [k.shape[0], k_width], [k.stride(0), 1],
                                           [config.block_n, split.qk_tail])
        v_desc = TensorDescriptor(v, [v.shape[0], v_width], [v.stride(0), 1],
                                  [config.block_n, split.v_block])
    grid = (q.shape[1], num_slots) if config.heads_fast else (num_slots, q.shape[1])
    with on_device(q.device):
        return _cp_prefill_attention_kernel[grid](
            q, k, v, out, lse_arg, k_desc, k_tail_desc, v_desc, *seg, num_segments, q.shape[0], table,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
            table.stride(0) if page_table is not None else 0,
            softmax_scale * _LOG2E,
            **kernel_constexprs(config, heads=q.shape[1], kv_heads=k.shape[1], qk_dim=q.shape[2],
                                v_dim=v.shape[2], paged=page_table is not None, page_size=page_size,
                                store_lse=lse is not None, num_segments=num_segments,
                                float32=q.dtype == torch.float32, interpret=interpreter_enabled()),
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
    config = runnable_config(default_config(q), q, k, v, page_table)
    launch_cp_prefill_attention(q, k, v, segments, float(softmax_scale), page_table, page_size,
                                out, lse, config)
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
