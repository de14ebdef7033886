"""The CP prefill callback of a DeepSeek-V3.2 (DSA) model on one rank.

Per layer, the rank writes each of its rows as a whole pool row (the latent,
then the index key, quantized to fp8 by the fused ``store_index_k`` for the
``fp8_e4m3`` cache), so one all-gather moves both (the rows are bytes of one
tensor: no second collective), beside the rows of the cached-prefix pages it
owns, read from its pool as they are. After the rerange it stores its own
rows (latent and index key together), scores each of its queries against its
request's index keys ``[0, position]`` (read back from the gathered rows, so
prefill scores what decode will read), keeps the top ``index_topk`` as
``torch.topk`` does (transformers' choice for exactly equal scores, the row as
long as the request) and attends only to those rows in the latent space
(``sparse_mla_prefill``: Triton on CUDA, the torch reference on CPU).
"""

from __future__ import annotations

import torch
from lanekv.kernels.dsa.index_cache import read_index_k, store_index_k
from lanekv.kernels.dsa.indexer import index_scores, index_topk
from lanekv.kernels.dsa.sparse_mla import sparse_mla_prefill
from lanekv.kernels.store_kv import store_kv
from lanekv.model.dsa import IndexInputs

# Queries scored at once: a [chunk, request length] float32 block of scores.
QUERY_CHUNK = 2048


class CPSparseAttention:
    """Mixed into the runner's ``_CPAttention``, which provides ``r`` (the runner),
    ``ix`` (the rank index), ``store_rows``, ``on_layer`` and ``_gather`` (all-gather
    and rerange); ``request_lens`` are each request's prefix + extend tokens."""

    request_lens: list[int]

    def __call__(self, layer: int, q: torch.Tensor, latent: torch.Tensor,
                 index: IndexInputs) -> torch.Tensor:
        r, ix = self.r, self.ix
        lay = r.dsa
        n = latent.shape[0]
        block = latent.new_empty((ix.block_rows, 1, 1, lay.head_dim))
        plane = block[:, 0, 0]
        lay.latent(plane)[:n] = latent
        local = torch.arange(n, device=latent.device)
        store_index_k(index.k.contiguous(), lay.index_rows(plane), local, lay.index)
        gathered = self._gather(layer, block)[:, 0, 0]  # [rows in request order, head_dim]
        cache, rows = r.pool[layer, 0], block[:n, 0]
        store_kv(rows, rows, cache, cache, self.store_rows)  # latent and index key at once
        if self.on_layer is not None:
            self.on_layer(layer)
        attn = r.model.mla_layer(layer)
        keys = read_index_k(lay.index_rows(gathered),
                            torch.arange(gathered.shape[0], device=gathered.device), lay.index)
        selected = self._select(attn.indexer.config.softmax_scale,
                                attn.indexer.config.index_topk, index, keys)
        cfg = r.model.config
        o_latent = sparse_mla_prefill(attn.absorb_query(q), lay.latent(gathered), selected,
                                      cfg.softmax_scale, cfg.mla.kv_lora_rank)
        return attn.expand_output(o_latent)

    def _select(self, scale: float, topk: int, index: IndexInputs,
                keys: torch.Tensor) -> torch.Tensor:
        """``[n_local, topk]`` int32 rows of the gathered buffer per query, ``-1`` padded
        (rows outside every segment, compute padding, select nothing)."""
        ix = self.ix
        out = torch.full((index.q.shape[0], topk), -1, dtype=torch.int32, device=keys.device)
        for start, length, pos, b in zip(ix.seg_q_start, ix.seg_q_len, ix.seg_q_pos,
                                         ix.seg_request):
            first = ix.kv_offsets[b]
            own = keys[first : first + self.request_lens[b]].to(index.q.dtype)
            for lo in range(start, start + length, QUERY_CHUNK):
                rows = slice(lo, min(lo + QUERY_CHUNK, start + length))
                positions = torch.arange(pos + lo - start, pos + rows.stop - start,
                                         device=keys.device)
                scores = index_scores(index.q[rows], own, index.weights[rows], positions, scale)
                chosen = index_topk(scores, topk)
                out[rows] = torch.where(chosen >= 0, chosen + first, chosen)
        return out
