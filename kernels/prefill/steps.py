"""The per-key-block steps of the prefill attention kernel (``kernel.py``).

Each is a ``triton.jit`` function the kernel inlines: the k/v rows of key positions
(contiguous or paged), a block's raw scores through pointers or TMA, one step of the
online softmax in base 2 (optionally with bfloat16 powers of two), and the normalized
store of a query block's rows.

Head dims need not be powers of two and v's may differ from q/k's: the qk dim
is scored as a power-of-two head part plus a masked tail part (192 = 128 + 64
runs two exact dots, ``config.head_dim_split``), and v's dim is padded to a power of
two with masks.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def key_rows(pos, kv_start, page_table, stride_pt, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Rows of k/v that hold key positions ``pos`` of one request (int64)."""
    if PAGED:
        page = tl.load(page_table + kv_start.to(tl.int64) * stride_pt + pos // PAGE_SIZE)
        return page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
    else:
        return kv_start.to(tl.int64) + pos


@triton.jit
def load_cols(base, rows, stride, cols, DIM: tl.constexpr, EVEN: tl.constexpr):
    """``base[rows, cols]``; columns at or past DIM read 0 unless EVEN says none are."""
    ptrs = base + rows[:, None] * stride + cols[None, :]
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(cols < DIM)[None, :], other=0.0)


@triton.jit
def scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt,
            QK_DIM: tl.constexpr, EVEN_HEAD: tl.constexpr, HAS_TAIL: tl.constexpr,
            EVEN_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Raw scores q @ k^T of one key block read through pointers: [BLOCK_M, BLOCK_N]."""
    k = load_cols(K, rows, stride_kt, offs_d, QK_DIM, EVEN_HEAD)  # [BLOCK_N, QK_HEAD]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = load_cols(K, rows, stride_kt, offs_t, QK_DIM, EVEN_TAIL)  # [BLOCK_N, QK_TAIL]
        qk = tl.dot(q_tail, tl.trans(k_tail), qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def scores_tma(q, q_tail, k_desc, k_tail_desc, row, col,
                QK_HEAD: tl.constexpr, HAS_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The same through TMA: key rows [row, row + BLOCK_N), head columns from ``col``."""
    k = k_desc.load([row, col])  # [BLOCK_N, QK_HEAD]
    qk = tl.dot(q, k.T, input_precision=DOT_PRECISION)
    if HAS_TAIL:
        k_tail = k_tail_desc.load([row, col + QK_HEAD])  # [BLOCK_N, QK_TAIL]
        qk = tl.dot(q_tail, k_tail.T, qk, input_precision=DOT_PRECISION)
    return qk


@triton.jit
def round_bf16(x):
    """float32 rounded to the nearest bfloat16 (ties to even), kept in float32: the
    interpreter has no bfloat16. Infinities stay; NaN never reaches here."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def exp2_bf16(x, INTERPRET: tl.constexpr):
    """2**x for x <= 0 (or -inf) in bfloat16, two per ex2 instruction on the GPU; the
    interpreter rounds the same way in float32."""
    if INTERPRET:
        return round_bf16(tl.exp2(round_bf16(x)))
    else:
        return tl.inline_asm_elementwise("ex2.approx.ftz.bf16x2 $0, $1;", "=r,r",
                                         [x.to(tl.bfloat16)], dtype=tl.bfloat16, is_pure=True,
                                         pack=2)


@triton.jit
def softmax_step(acc, l_i, m_i, qk, v, pos_m, pos_n, qk_scale,
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
        p = exp2_bf16(x, INTERPRET)
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
def store_rows(O, LSE, acc, l_i, m_i, rows, ok, head, offs_v, stride_ot, stride_oh, stride_lt,
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
