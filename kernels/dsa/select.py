"""The decode step's DSA selection: each request's new token against its index-K pages.

``decode_select(q [B, H, D], weights [B, H], index_pool [rows, row_bytes], page_table
[B, W] int32, seq_lens [B] int32, page_size, softmax_scale, topk, spec) -> [B, topk]``
int32 token positions of each request, ``-1`` padded (``index_topk``'s form, what
``sparse_mla_decode`` takes). ``seq_lens`` count the new token, whose key is in
the pool already.

On CUDA it is one launch of the paged Triton kernel (fp8 rows read as they are
stored) over the page table's width, writing float32 scores (keys past ``seq_lens[b]``
score ``-inf`` and are never selected, so a request with fewer than ``topk`` keys gets
``-1`` padding, which ``sparse_mla_decode`` skips), then ``exact_topk``
(``kernels/dsa/digit_topk.py``: 8-bit digit passes over a row split across the SMs, or
``radix_topk``, by shape), ``first_topk``'s exact set (exactly tied scores go to the
lowest positions) listed in ascending position order. The order is a function of the set, so
a captured step, whose table is as wide as the pool allows, selects and attends in the
order an eager step over the batch's own width does. ``radix_topk`` replaced
``torch.topk`` over int64 keys here: on an H200 it took 26-81 us against 67-123 us at
8k-128k positions (BENCHMARKS.md, "DSA decode layer", seventh session), the same set
every time. No host read, no shape
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
from lanekv.kernels.dsa.digit_topk import exact_topk
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, read_index_k
from lanekv.kernels.dsa.indexer import (
    index_scores,
    index_topk,
    paged_index_scores,
    score_key,
    score_keys_ref,
)


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
    """``decode_select``'s CUDA path on any device: the float32 scores over the page
    table's whole width (``-inf`` past each ``seq_len``), then ``exact_topk``'s
    positions in ascending order: ``exact_topk(paged_index_scores(...), topk, seq_lens)``
    (the split top-k reads each row's own ``seq_lens`` keys, not the table's width)."""
    scores = paged_index_scores(q, weights, index_pool, page_table, seq_lens, page_size,
                                softmax_scale, spec)
    return exact_topk(scores, topk, seq_lens)


_NEG_INF_ORDER = -2139095041  # score_key's high word of -inf


# Widths and strides vary with an eager step's page table: never specialized on.
@triton.jit(do_not_specialize=["n_cols", "stride_s", "stride_k"])
def _topk_keys_kernel(scores_ptr, keys_ptr, n_cols, stride_s, stride_k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = t < n_cols
    x = tl.load(scores_ptr + row * stride_s + t, mask=ok, other=0.0)
    tl.store(keys_ptr + row * stride_k + t, score_key(x, t, BLOCK), mask=ok)


@triton.jit(do_not_specialize=["kept", "topk", "stride_v", "stride_i", "stride_o"])
def _topk_finish_kernel(values_ptr, best_ptr, out_ptr, kept, topk, stride_v, stride_i, stride_o,
                        NEG_INF_ORDER: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    chosen = j < kept
    key = tl.load(values_ptr + row * stride_v + j, mask=chosen, other=0)
    best = tl.load(best_ptr + row * stride_i + j, mask=chosen, other=0)
    pos = tl.where(chosen & ((key >> 32) != NEG_INF_ORDER), best, -1)
    tl.store(out_ptr + row * stride_o + j, pos.to(tl.int32), mask=j < topk)


def _check_topk(name, scores, dtype, topk) -> None:
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != dtype:
        raise ValueError(f"{name} must be a 2-D {dtype} tensor, got {scores!r:.80}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if scores.shape[1] >= 1 << 32:
        raise ValueError(f"{name} has {scores.shape[1]} columns, 2**32 or more")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError(f"{name} must be dense along its last dim, got strides {scores.stride()}")


def _check_first_topk(scores, topk) -> None:
    _check_topk("scores", scores, torch.float32, topk)


def topk_of_keys_triton(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """``[N, T]`` int64 ``score_key`` keys -> ``[N, topk]`` int32 positions of the
    largest, ``-1`` for ``-inf`` scores and the padding: ``torch.topk`` and one launch."""
    _check_topk("keys", keys, torch.int64, topk)
    rows, cols = keys.shape
    kept = min(topk, cols)
    out = torch.empty((rows, topk), dtype=torch.int32, device=keys.device)
    if rows == 0:
        return out
    if kept == 0:
        return out.fill_(-1)
    best = keys.topk(kept, dim=-1)
    block = 1024 if keys.is_cuda else 64
    _topk_finish_kernel[(rows, triton.cdiv(topk, block))](
        best.values, best.indices, out, kept, topk, best.values.stride(0),
        best.indices.stride(0), out.stride(0), NEG_INF_ORDER=_NEG_INF_ORDER, BLOCK=block)
    return out


def topk_of_keys_ref(keys: torch.Tensor, topk: int) -> torch.Tensor:
    _check_topk("keys", keys, torch.int64, topk)
    kept = min(topk, keys.shape[1])
    out = torch.full((keys.shape[0], topk), -1, dtype=torch.int32, device=keys.device)
    if kept == 0 or keys.shape[0] == 0:
        return out
    best = keys.topk(kept, dim=-1)
    hidden = (best.values >> 32) == _NEG_INF_ORDER
    out[:, :kept] = best.indices.to(torch.int32).masked_fill(hidden, -1)
    return out


def topk_of_keys(keys: torch.Tensor, topk: int) -> torch.Tensor:
    """The positions of the ``topk`` largest keys of each row, ``-1`` for ``-inf``."""
    return (topk_of_keys_triton if use_triton(keys) else topk_of_keys_ref)(keys, topk)


def first_topk_triton(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``first_topk`` in three launches: the keys (one elementwise kernel), ``torch.topk``,
    then the positions with ``-1`` for ``-inf`` scores and the padding (one kernel)."""
    _check_first_topk(scores, topk)
    rows, cols = scores.shape
    keys = torch.empty((rows, cols), dtype=torch.int64, device=scores.device)
    if rows and cols:
        block = 1024 if scores.is_cuda else 64
        _topk_keys_kernel[(rows, triton.cdiv(cols, block))](
            scores, keys, cols, scores.stride(0), keys.stride(0), BLOCK=block)
    return topk_of_keys_triton(keys, topk)


def first_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``first_topk_ref`` (see there); on CUDA the Triton version (three launches)."""
    return (first_topk_triton if use_triton(scores) else first_topk_ref)(scores, topk)


def first_topk_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``index_topk`` with exact ties broken towards the lowest position: ``[N, T]``
    float32 scores -> ``[N, topk]`` int32 positions, ``-1`` where no key is left.

    One ``torch.topk`` over int64 keys ``(order(score) << 32) + (2**32 - 1 - t)``,
    ``order`` the float's bits made monotonic (``-0.0`` counted as ``0.0``), so
    keys are distinct and the chosen set is a function of the scores alone
    (``score_keys_ref``; ``score_key`` in the kernels)."""
    _check_first_topk(scores, topk)
    return topk_of_keys_ref(score_keys_ref(scores), topk)
