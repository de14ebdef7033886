"""The prefill attention's Triton kernel: one program per (query block, q head).

FlashAttention-2 style: one program per (query block of one segment, q head)
streams its request's K/V blocks up to the causal limit with an online
softmax in base 2. Key blocks every row of the query block may see run in an
unmasked loop; only the diagonal blocks pay for the causal mask. K/V are read
either contiguously or through a page table (any ``page_size >= 1``). The variants
(TMA, the overlapped loop, heads on the fast grid axis, the warp-specialized loop,
bfloat16 powers of two) are the constexpr switches of ``config.AttnLaunchConfig``.

No host sync and no helper kernels: the grid is an upper bound (``cdiv(Tq, BLOCK_M) + S``
slots cover any set of disjoint segments) and each program finds its (segment, query
block) itself from a cumulative sum of the segments' block counts (O(S) loads per
program, from L2); slots past the last block exit at once. The block steps live in
``steps.py``; the launcher in ``attention.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl
from lanekv.kernels.prefill.steps import (
    key_rows,
    load_cols,
    scores,
    scores_tma,
    softmax_step,
    store_rows,
)


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
        qk = scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start + start_n, k_col, QK_HEAD,
                         HAS_TAIL, DOT_PRECISION)
        v = v_desc.load([kv_start + start_n, v_col])
        # (pos_m - start_n against offs_n: the causal mask, one subtract per row)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, pos_m - start_n, offs_n, qk_scale, 2,
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
                qk = scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start, k_col,
                                 QK_HEAD, HAS_TAIL, DOT_PRECISION)
            else:
                first = key_rows(offs_n, kv_start, page_table, stride_pt, PAGED, PAGE_SIZE)
                qk = scores(q, q_tail, K, first, offs_d, offs_t, stride_kt, QK_DIM, EVEN_HEAD,
                             HAS_TAIL, EVEN_TAIL, DOT_PRECISION)
            for start_n in range(BLOCK_N, full_end, BLOCK_N):
                if TMA:
                    qk_next = scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start + start_n, k_col,
                                          QK_HEAD, HAS_TAIL, DOT_PRECISION)
                    v = v_desc.load([kv_start + start_n - BLOCK_N, v_col])
                else:
                    rows = key_rows(start_n + offs_n, kv_start, page_table, stride_pt, PAGED,
                                     PAGE_SIZE)
                    qk_next = scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt, QK_DIM,
                                      EVEN_HEAD, HAS_TAIL, EVEN_TAIL, DOT_PRECISION)
                    prev = key_rows(start_n - BLOCK_N + offs_n, kv_start, page_table, stride_pt,
                                     PAGED, PAGE_SIZE)
                    v = load_cols(V, prev, stride_vt, offs_v, V_DIM, EVEN_V)
                acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, pos_m, offs_n, qk_scale,
                                              False, DOT_PRECISION, EXP_BF16, INTERPRET)
                qk = qk_next
            if TMA:
                v = v_desc.load([kv_start + full_end - BLOCK_N, v_col])
            else:
                last = key_rows(full_end - BLOCK_N + offs_n, kv_start, page_table, stride_pt,
                                 PAGED, PAGE_SIZE)
                v = load_cols(V, last, stride_vt, offs_v, V_DIM, EVEN_V)
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, pos_m, offs_n, qk_scale,
                                          False, DOT_PRECISION, EXP_BF16, INTERPRET)
    else:
        for start_n in range(0, full_end, BLOCK_N):
            pos_n = start_n + offs_n
            if TMA:
                qk = scores_tma(q, q_tail, k_desc, k_tail_desc, kv_start + start_n, k_col,
                                 QK_HEAD, HAS_TAIL, DOT_PRECISION)
                v = v_desc.load([kv_start + start_n, v_col])
            else:
                rows = key_rows(pos_n, kv_start, page_table, stride_pt, PAGED, PAGE_SIZE)
                qk = scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt, QK_DIM, EVEN_HEAD,
                             HAS_TAIL, EVEN_TAIL, DOT_PRECISION)
                v = load_cols(V, rows, stride_vt, offs_v, V_DIM, EVEN_V)
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, pos_m, pos_n, qk_scale,
                                          False, DOT_PRECISION, EXP_BF16, INTERPRET)
    if not WARP_SPEC:  # the diagonal blocks (the warp-specialized loop took them)
        for start_n in range(full_end, kv_end, BLOCK_N):
            # Clamp past-the-end positions to the last key: an in-bounds load
            # whose score the causal mask drops for every stored row.
            pos_n = start_n + offs_n
            rows = key_rows(tl.minimum(pos_n, kv_end - 1), kv_start, page_table, stride_pt,
                             PAGED, PAGE_SIZE)
            qk = scores(q, q_tail, K, rows, offs_d, offs_t, stride_kt, QK_DIM, EVEN_HEAD, HAS_TAIL,
                         EVEN_TAIL, DOT_PRECISION)
            v = load_cols(V, rows, stride_vt, offs_v, V_DIM, EVEN_V)
            acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, pos_m, pos_n, qk_scale,
                                          True, DOT_PRECISION, EXP_BF16, INTERPRET)

    if WARP_SPEC:
        l_i = tl.where(live, l_i, 1.0)  # a slot past the last block saw no key: no 0 / 0
    store_rows(O, LSE, acc, l_i, m_i, out_rows, row_ok, head, offs_v, stride_ot, stride_oh,
                stride_lt, stride_lh, V_DIM, STORE_LSE)
