"""Exact top-k of index scores in a few Triton launches, for the DSA decode selection.

``radix_topk(scores [N, T] float32, topk) -> [N, topk] int32``: the positions of the
``topk`` largest finite scores of each row, exactly ``first_topk``'s set (ties at
the cut go to the lowest positions, ``-0.0`` counts as ``0.0``, ``-inf`` is never
selected), listed in ascending position order and ``-1`` padded. The order is a
function of the set, so the result does not depend on the row's width past its
last finite score (a captured step's wide table selects what an eager one does).

How: a row is cut into chunks of ``chunk`` scores; one program per chunk finds the
chunk's ``topk``-th largest score by a search over the float's monotonic 32-bit
order, two bits a pass (16 counting passes over the values it holds in registers,
no histogram), then keeps the scores above it and the lowest-position ties, compacted
in position order by a prefix sum. A chunk's survivors (at most ``topk``, with
their orders) are the next level's input: ``chunk // topk`` lists per program,
again in position order, so the tie rule holds across levels. One launch at 8k
scores, two at 32k, three at 128k (chunk 8192, top 2048), each independent of
the values, so the selection can be captured in a CUDA graph.

The reference sorts ``first_topk_ref``'s positions. ``kernels/dsa/digit_topk.py``
gives the same output with the row split over many programs (the small batches' top-k);
its ``exact_topk`` chooses between the two by shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.dsa.indexer import score_keys_ref

DEFAULT_CHUNK = 8192
MAX_CHUNK = 32768  # a chunk's counts are packed in 16-bit fields
INT32_MIN = tl.constexpr(-(1 << 31))


@triton.jit(do_not_specialize=["n_cols", "topk", "n_lists", "stride_s", "stride_in",
                               "stride_cnt_in", "stride_out", "stride_cnt_out"])
def _radix_topk_kernel(
    src_ptr, in_order_ptr, in_pos_ptr, in_cnt_ptr, out_order_ptr, out_pos_ptr, out_cnt_ptr,
    n_cols, topk, n_lists,
    stride_s, stride_in, stride_cnt_in, stride_out, stride_cnt_out,
    FROM_SCORES: tl.constexpr, FINAL: tl.constexpr, CHUNK: tl.constexpr, KPAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    i = tl.arange(0, CHUNK)
    if FROM_SCORES:
        t = part * CHUNK + i
        x = tl.load(src_ptr + row * stride_s + t, mask=t < n_cols, other=float("-inf"))
        valid = x != float("-inf")
        bits = (x + 0.0).to(tl.int32, bitcast=True)  # + 0.0 turns -0.0 into 0.0
        order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotonic in the float
        pos = t
    else:
        lists_per = CHUNK // KPAD
        lst = part * lists_per + i // KPAD
        slot = i % KPAD
        cnt = tl.load(in_cnt_ptr + row * stride_cnt_in + lst, mask=lst < n_lists, other=0)
        valid = slot < cnt
        off = row * stride_in + lst.to(tl.int64) * KPAD + slot
        order = tl.load(in_order_ptr + off, mask=valid, other=0)
        pos = tl.load(in_pos_ptr + off, mask=valid, other=0)
    n_valid = tl.sum(valid.to(tl.int32), 0)
    # The topk-th largest order: the largest t with count(order >= t) >= topk, found two
    # bits at a time from the top over the sign-flipped (unsigned-monotonic) pattern:
    # the counts of the three candidates (< 2**16 each: CHUNK <= 32768) add up packed
    # in one int64, one block reduction per two bits.
    prefix = tl.zeros([], tl.int32)
    if n_valid > topk:  # else every valid score is kept: no search (a chunk past seq_len)
        for step in range(16):
            shift = 30 - 2 * step
            c1 = prefix | (tl.full([], 1, tl.int32) << shift)  # shift 30: wraps, as bit patterns
            c2 = prefix | (tl.full([], 2, tl.int32) << shift)
            c3 = prefix | (tl.full([], 3, tl.int32) << shift)
            packed = ((order >= (c1 ^ INT32_MIN)).to(tl.int64)
                      + ((order >= (c2 ^ INT32_MIN)).to(tl.int64) << 16)
                      + ((order >= (c3 ^ INT32_MIN)).to(tl.int64) << 32))
            counts = tl.sum(tl.where(valid, packed, 0), 0)
            n1 = (counts & 0xFFFF).to(tl.int32)
            n2 = ((counts >> 16) & 0xFFFF).to(tl.int32)
            n3 = ((counts >> 32) & 0xFFFF).to(tl.int32)
            prefix = tl.where(n3 >= topk, c3, tl.where(n2 >= topk, c2, tl.where(n1 >= topk, c1,
                                                                                  prefix)))
    thr = prefix ^ INT32_MIN
    gt = valid & (order > thr)
    eq = (valid & (order == thr)).to(tl.int32)
    ties = topk - tl.sum(gt.to(tl.int32), 0)  # lowest-position ties to keep
    tie_rank = tl.cumsum(eq, 0) - eq
    take_all = (n_valid <= topk).to(tl.int32)
    sel_i = valid.to(tl.int32) * tl.maximum(tl.maximum(gt.to(tl.int32), take_all),
                                            eq * (tie_rank < ties).to(tl.int32))
    sel = sel_i != 0
    dst = tl.cumsum(sel_i, 0) - sel_i
    count = tl.sum(sel_i, 0)
    out = row * stride_out + part.to(tl.int64) * KPAD
    tl.store(out_pos_ptr + out + dst, pos, mask=sel)
    if FINAL:
        j = tl.arange(0, KPAD)
        tl.store(out_pos_ptr + out + j, tl.full([KPAD], -1, tl.int32),
                 mask=(j >= count) & (j < topk))
    else:
        tl.store(out_order_ptr + out + dst, order, mask=sel)
        tl.store(out_cnt_ptr + row * stride_cnt_out + part, count)


def _check(scores, topk, chunk) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D float32 tensor, got {scores!r:.80}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if scores.shape[1] >= 1 << 31:
        raise ValueError(f"scores has {scores.shape[1]} columns, 2**31 or more")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError(f"scores must be dense along its last dim, got strides {scores.stride()}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 2
                              or chunk & (chunk - 1) or chunk > MAX_CHUNK):
        raise ValueError(f"chunk must be None or a power of two in [2, {MAX_CHUNK}], got {chunk!r}")
    if 2 * triton.next_power_of_2(topk) > MAX_CHUNK:
        raise ValueError(f"topk must be at most {MAX_CHUNK // 2}, got {topk}")


def radix_topk_levels(cols: int, topk: int, chunk: int | None = None) -> list[int]:
    """Programs per row of each launch (a function of the shapes only)."""
    kpad = triton.next_power_of_2(topk)
    chunk = max(chunk or DEFAULT_CHUNK, 2 * kpad)
    levels = [max(1, triton.cdiv(cols, chunk))]
    while levels[-1] > 1:
        levels.append(triton.cdiv(levels[-1], chunk // kpad))
    return levels


def radix_topk_triton(scores: torch.Tensor, topk: int, *, chunk: int | None = None,
                      num_warps: int = 16) -> torch.Tensor:
    """Triton launcher; ``chunk`` (a power of two, at least twice ``topk`` rounded up
    to one) sets the scores a program holds: tests take small ones to run several levels."""
    _check(scores, topk, chunk)
    rows, cols = scores.shape
    out = torch.empty((rows, topk), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    if cols == 0:
        return out.fill_(-1)
    kpad = triton.next_power_of_2(topk)
    size = max(chunk or DEFAULT_CHUNK, 2 * kpad)
    levels = radix_topk_levels(cols, topk, chunk)
    dev = scores.device
    prev = None  # (order, pos, cnt, lists) of the level before
    for depth, progs in enumerate(levels):
        final = depth == len(levels) - 1
        if final:
            order = cnt = out  # unused by a final launch
            pos, stride_out, stride_cnt = out, out.stride(0), 0
        else:
            order = torch.empty((rows, progs * kpad), dtype=torch.int32, device=dev)
            pos = torch.empty_like(order)
            cnt = torch.empty((rows, progs), dtype=torch.int32, device=dev)
            stride_out, stride_cnt = order.stride(0), cnt.stride(0)
        if prev is None:
            src, ins = scores, (scores, scores, scores, 0, 0, 0)
        else:
            src = scores
            ins = (prev[0], prev[1], prev[2], prev[3], prev[0].stride(0), prev[2].stride(0))
        _radix_topk_kernel[(rows, progs)](
            src, ins[0], ins[1], ins[2], order, pos, cnt, cols, topk, ins[3],
            scores.stride(0), ins[4], ins[5], stride_out, stride_cnt,
            FROM_SCORES=prev is None, FINAL=final, CHUNK=size, KPAD=kpad, num_warps=num_warps)
        prev = (order, pos, cnt, progs)
    return out


def radix_topk_ref(scores: torch.Tensor, topk: int, *, chunk: int | None = None,
                   num_warps: int = 16) -> torch.Tensor:
    """``first_topk``'s positions in ascending order, ``-1`` padded (``chunk`` and
    ``num_warps`` have no effect here)."""
    _check(scores, topk, chunk)
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    kept = min(topk, scores.shape[1])
    if kept == 0 or scores.shape[0] == 0:
        return out
    best = score_keys_ref(scores).topk(kept, dim=-1).indices
    finite = torch.gather(scores, 1, best) != float("-inf")
    big = torch.iinfo(torch.int64).max
    ordered = best.masked_fill(~finite, big).sort(dim=-1).values
    out[:, :kept] = ordered.masked_fill(ordered == big, -1).to(torch.int32)
    return out


def radix_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The positions of each row's ``topk`` largest finite scores, ascending, ``-1`` padded."""
    return (radix_topk_triton if use_triton(scores) else radix_topk_ref)(scores, topk)
