"""The decode step's DSA selection: each request's new token against its index-K pages.

``decode_select(q [B, H, D], weights [B, H], index_pool [rows, row_bytes], page_table
[B, W] int32, seq_lens [B] int32, page_size, softmax_scale, topk, spec) -> [B, topk]``
int32 token positions of each request, ``-1`` padded (``index_topk``'s form, what
``sparse_mla_decode`` takes). ``seq_lens`` count the new token, whose key is in
the pool already.

On CUDA it is one launch of the paged Triton kernel (fp8 dequantized inside)
over the page table's width (keys past ``seq_lens[b]`` score ``-inf`` and are
selected only when fewer than ``topk`` keys exist, then returned as ``-1``, which
``sparse_mla_decode`` skips) and one ``torch.topk`` (``first_topk``: exactly tied
scores go to the lowest positions, so the set does not depend on the table's
width, and a captured step, whose table is as wide as the pool allows, selects
what an eager step over the batch's own width does). No host read, no shape
that depends on a value: the step can be captured as a CUDA graph. On CPU each request's keys
are read back and scored as transformers scores a decode step (one query over
exactly ``seq_len`` keys, ``index_scores``' reference), so a row of exactly
tied scores is cut where transformers cuts it (see ``kernels/dsa/indexer.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, read_index_k
from lanekv.kernels.dsa.indexer import index_scores, index_topk, paged_index_scores


def decode_select(q: torch.Tensor, weights: torch.Tensor, index_pool: torch.Tensor,
                  page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                  softmax_scale: float, topk: int, spec: IndexCacheSpec) -> torch.Tensor:
    """The top ``topk`` key positions of each request's new token, ``-1`` padded."""
    if use_triton(q):
        return select_fixed_width(q, weights, index_pool, page_table, seq_lens, page_size,
                                  softmax_scale, topk, spec)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len <= 0:
            continue
        t = torch.arange(seq_len, device=q.device)
        rows = page_table[b, t // page_size].long() * page_size + t % page_size
        keys = read_index_k(index_pool, rows, spec).to(q.dtype)
        scores = index_scores(q[b : b + 1], keys, weights[b : b + 1],
                              torch.tensor([seq_len - 1], device=q.device), softmax_scale)
        out[b] = index_topk(scores, topk)[0]
    return out


def select_fixed_width(q: torch.Tensor, weights: torch.Tensor, index_pool: torch.Tensor,
                       page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                       softmax_scale: float, topk: int, spec: IndexCacheSpec) -> torch.Tensor:
    """``decode_select``'s CUDA path on any device: scores over the page table's whole
    width (``-inf`` past each ``seq_len``), then ``first_topk``."""
    scores = paged_index_scores(q, weights, index_pool, page_table, seq_lens, page_size,
                                softmax_scale, spec)
    return first_topk(scores, topk)


# Widths and strides vary with an eager step's page table: never specialized on.
@triton.jit(do_not_specialize=["n_cols", "stride_s", "stride_k"])
def _topk_keys_kernel(scores_ptr, keys_ptr, n_cols, stride_s, stride_k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < n_cols
    x = tl.load(scores_ptr + row * stride_s + t, mask=ok, other=0.0) + 0.0  # -0.0 -> 0.0
    bits = x.to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    low = tl.full([BLOCK], 4294967295, tl.int64) - t.to(tl.int64)  # 2**32 - 1 - t
    key = (order << 32) + low
    tl.store(keys_ptr + row * stride_k + t, key, mask=ok)


@triton.jit(do_not_specialize=["kept", "topk", "stride_b", "stride_s", "stride_o"])
def _topk_finish_kernel(best_ptr, scores_ptr, out_ptr, kept, topk, stride_b, stride_s, stride_o,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    chosen = j < kept
    best = tl.load(best_ptr + row * stride_b + j, mask=chosen, other=0)
    score = tl.load(scores_ptr + row * stride_s + best, mask=chosen, other=float("-inf"))
    pos = tl.where(score == float("-inf"), -1, best)
    tl.store(out_ptr + row * stride_o + j, pos.to(tl.int32), mask=j < topk)


def _check_first_topk(scores, topk) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D float32 tensor, got {scores!r:.80}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if scores.shape[1] >= 1 << 32:
        raise ValueError(f"scores has {scores.shape[1]} columns, 2**32 or more")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError(f"scores must be dense along its last dim, got strides {scores.stride()}")


def first_topk_triton(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``first_topk`` in three launches: the keys (one elementwise kernel), ``torch.topk``,
    then the positions with ``-1`` for ``-inf`` scores and the padding (one kernel)."""
    _check_first_topk(scores, topk)
    rows, cols = scores.shape
    kept = min(topk, cols)
    out = torch.empty((rows, topk), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    if kept == 0:
        return out.fill_(-1)
    keys = torch.empty((rows, cols), dtype=torch.int64, device=scores.device)
    block = 1024 if scores.is_cuda else 64
    _topk_keys_kernel[(rows, triton.cdiv(cols, block))](
        scores, keys, cols, scores.stride(0), keys.stride(0), BLOCK=block)
    best = keys.topk(kept, dim=-1).indices
    _topk_finish_kernel[(rows, triton.cdiv(topk, block))](
        best, scores, out, kept, topk, best.stride(0), scores.stride(0), out.stride(0),
        BLOCK=block)
    return out


def first_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``first_topk_ref`` (see there); on CUDA the Triton version (three launches)."""
    return (first_topk_triton if use_triton(scores) else first_topk_ref)(scores, topk)


def first_topk_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``index_topk`` with exact ties broken towards the lowest position: ``[N, T]``
    float32 scores -> ``[N, topk]`` int32 positions, ``-1`` where no key is left.

    One ``torch.topk`` over int64 keys ``(order(score) << 32) + (2**32 - 1 - t)``,
    ``order`` the float's bits made monotonic (``-0.0`` counted as ``0.0``), so
    keys are distinct and the chosen set is a function of the scores alone."""
    _check_first_topk(scores, topk)
    kept = min(topk, scores.shape[1])
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    if kept == 0 or scores.shape[0] == 0:
        return out
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # monotonic in the float
    pos = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    keys = order * (1 << 32) + ((1 << 32) - 1 - pos)
    best = keys.topk(kept, dim=-1).indices
    hidden = torch.gather(scores, 1, best) == float("-inf")
    out[:, :kept] = best.to(torch.int32).masked_fill(hidden, -1)
    return out
