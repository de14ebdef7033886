"""The decode step's DSA selection: each request's new token against its index-K pages.

``decode_select(q [B, H, D], weights [B, H], index_pool [rows, row_bytes], page_table
[B, W] int32, seq_lens [B] int32, page_size, softmax_scale, topk, spec) -> [B, topk]``
int32 token positions of each request, ``-1`` padded (``index_topk``'s form, what
``sparse_mla_decode`` takes). ``seq_lens`` count the new token, whose key is in
the pool already.

On CUDA it is one launch of the paged Triton kernel (fp8 dequantized inside)
over the page table's width and one ``torch.topk``. On CPU each request's keys
are read back and scored as transformers scores a decode step (one query over
exactly ``seq_len`` keys, ``index_scores``' reference), so a row of exactly
tied scores is cut where transformers cuts it (see ``kernels/dsa/indexer.py``).
"""

from __future__ import annotations

import torch

from kernels.backend import use_triton
from kernels.dsa.index_cache import IndexCacheSpec, read_index_k
from kernels.dsa.indexer import index_scores, index_topk, paged_index_scores


def decode_select(q: torch.Tensor, weights: torch.Tensor, index_pool: torch.Tensor,
                  page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                  softmax_scale: float, topk: int, spec: IndexCacheSpec) -> torch.Tensor:
    """The top ``topk`` key positions of each request's new token, ``-1`` padded."""
    if use_triton(q):
        scores = paged_index_scores(q, weights, index_pool, page_table, seq_lens, page_size,
                                    softmax_scale, spec)
        return index_topk(scores, topk)
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
