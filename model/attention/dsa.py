"""DSA: DeepSeek-V3.2; MLA whose queries attend only the keys the indexer selects.

Rows are MLA's latent followed by the token's index-K row (``DSARows``:
``fp8_e4m3`` e4m3 bytes and a float32 scale per block, or the key in the
model dtype), so one page copy, digest or all-gather moves both. RoPE runs in
the model. Every path writes whole rows (the index key quantized by the fused
``store_index_k``) and scores what the pool holds, read back, so prefill
selects what decode will read:

- CP prefill: the rank writes its rows into the block, the gather brings every
  rank's rows (no second collective), the rank stores its own; each query is
  scored against its request's index keys ``[0, position]`` and the top
  ``index_topk`` kept as ``torch.topk`` does (transformers' choice for equal
  scores); ``sparse_mla_prefill`` attends those rows in the latent space.
- Paged decode: the new row stored, ``decode_select`` over the index-K pages
  (on CUDA the page table's whole width, so a captured step selects what an
  eager one does), ``sparse_mla_decode`` over the selected latent rows.
- Colocated: the rows stored, the keys read back, ``dsa_causal_attention``.

FP8 KV: the latent part of each row is the FP8 MLA row (``DSARows.encode_latent``);
the CP prefill and the colocated run attend on it dequantized
(``decode_latent``), the decode kernel dequantizes the rows it selects.
"""

from __future__ import annotations

from typing import Any

import torch
from lanekv.kernels.dsa.index_cache import read_index_k, store_index_k
from lanekv.kernels.dsa.indexer import index_scores, index_topk
from lanekv.kernels.dsa.select import decode_select
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode, sparse_mla_prefill
from lanekv.kernels.store_kv import store_kv
from lanekv.model.attention.base import (
    AnyCausalLM,
    AttentionFn,
    CPBatch,
    DecodeStep,
    Pool,
    table_width,
)
from lanekv.model.attention.mla import MLA
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    DSARows,
    RowLayout,
    check_index_cache_dtype,
    check_kv_cache_dtype,
)
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek_v32 import DeepseekV32CausalLM, dsa_causal_attention
from lanekv.model.dsa import IndexInputs

# Queries scored at once in CP prefill: a [chunk, request length] float32 block of scores.
QUERY_CHUNK = 2048


class DSA(MLA):
    name = "dsa"

    def matches(self, config: ModelConfig) -> bool:
        return config.dsa is not None

    def model_class(self, config: ModelConfig) -> type[DeepseekV32CausalLM]:
        return DeepseekV32CausalLM

    def rows(self, config: ModelConfig, dtype: torch.dtype, *,
             index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
             kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> DSARows:
        check_index_cache_dtype(index_cache_dtype)
        fp8 = check_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3"
        return DSARows.build(config.mla.latent_dim, config.dsa.index_head_dim, dtype,
                             index_cache_dtype, fp8_rank=config.mla.kv_lora_rank if fp8 else 0)

    def fits(self, config: ModelConfig, rows: RowLayout) -> bool:
        return self.matches(config) and isinstance(rows, DSARows) and (
            rows.layout.latent_dim, rows.index.head_dim) == (config.mla.latent_dim,
                                                             config.dsa.index_head_dim)

    def contract_fields(self, config: ModelConfig, rows: RowLayout) -> dict[str, Any]:
        """MLA's with the row's ``head_dim`` and a ``dsa`` map (index dims, top-k, cache
        dtype, quantization block, row bytes) that ``Agreement.from_model`` turns into
        agreement fields of their own."""
        fields = super().contract_fields(config, rows)
        fields["head_dim"] = rows.head_dim
        fields["dsa"] = {
            "index_n_heads": config.dsa.index_n_heads,
            "index_head_dim": config.dsa.index_head_dim,
            "index_topk": config.dsa.index_topk,
            "index_cache_dtype": rows.index.cache_dtype,
            "index_block": rows.index.block,
            "index_row_bytes": rows.index.row_bytes,
        }
        return fields

    def cp_prefill(self, model: AnyCausalLM, batch: CPBatch) -> AttentionFn:
        lay, pool, cfg = batch.rows, batch.pool, model.config

        def attention(layer: int, q: torch.Tensor, latent: torch.Tensor,
                      index: IndexInputs) -> torch.Tensor:
            n = latent.shape[0]
            block = torch.empty((batch.block_rows, 1, 1, lay.head_dim), dtype=lay.dtype,
                                device=latent.device)
            plane = block[:, 0, 0]
            lay.latent(plane)[:n] = lay.encode_latent(latent)
            local = torch.arange(n, device=latent.device)
            store_index_k(index.k.contiguous(), lay.index_rows(plane), local, lay.index)
            gathered = batch.gather(layer, block)[:, 0, 0]  # [rows in request order, head_dim]
            cache, rows = pool[layer, 0], block[:n, 0]
            store_kv(rows, rows, cache, cache, batch.store_rows)  # latent and index key at once
            if batch.on_layer is not None:
                batch.on_layer(layer)
            attn = model.mla_layer(layer)
            keys = read_index_k(lay.index_rows(gathered),
                                torch.arange(gathered.shape[0], device=gathered.device), lay.index)
            selected = _select(batch, attn.indexer.config.softmax_scale,
                               attn.indexer.config.index_topk, index, keys)
            # the latents every decode step will read (FP8 rows dequantized)
            values = lay.decode_latent(lay.latent(gathered))
            o_latent = sparse_mla_prefill(attn.absorb_query(q), values, selected,
                                          cfg.softmax_scale, cfg.mla.kv_lora_rank)
            return attn.expand_output(o_latent)

        return attention

    def paged_decode(self, model: AnyCausalLM, pool: Pool, step: DecodeStep) -> AttentionFn:
        lay, tensor, page_size, dsa = pool.rows, pool.tensor, pool.page_size, model.config.dsa
        scale, rank = model.config.softmax_scale, model.config.mla.kv_lora_rank
        local = torch.arange(step.locs.shape[0], device=step.locs.device)

        def attention(layer: int, q: torch.Tensor, latent: torch.Tensor,
                      index: IndexInputs) -> torch.Tensor:
            mla, plane = model.mla_layer(layer), tensor[layer, 0]  # [rows, 1, row]
            rows = torch.empty((latent.shape[0], lay.head_dim), dtype=lay.dtype, device=latent.device)
            lay.latent(rows)[:] = lay.encode_latent(latent)
            store_index_k(index.k.contiguous(), lay.index_rows(rows), local, lay.index)
            store_kv(rows[:, None], rows[:, None], plane, plane, step.locs)
            selected = decode_select(index.q, index.weights, lay.index_rows(plane[:, 0]),
                                     step.page_table, step.seq_lens, page_size, dsa.softmax_scale,
                                     dsa.index_topk, lay.index)
            o_latent = sparse_mla_decode(mla.absorb_query(q), lay.latent(plane[:, 0]),
                                         step.page_table, selected, page_size, scale, rank)
            return mla.expand_output(o_latent)

        return attention

    def warm_up_decode(self, config: ModelConfig, pool: Pool) -> None:
        """MLA's dense kernel, then the sparse one without and with split partials (the
        split count of a step depends on its batch size); nothing selected, nothing read.
        The query is absorbed, ``[1, H, R + P]`` in the model dtype, whatever the rows
        hold (an FP8 latent is uint8 bytes of another width)."""
        super().warm_up_decode(config, pool)
        latent = pool.rows.latent(pool.tensor[0, 0, :, 0])
        like = {"device": latent.device}
        q = torch.zeros((1, config.num_heads, config.mla.latent_dim), dtype=pool.rows.value_dtype,
                        **like)
        table = torch.zeros((1, table_width(pool, config.max_position_embeddings)),
                            dtype=torch.int32, **like)
        selected = torch.full((1, config.dsa.index_topk), -1, dtype=torch.int32, **like)
        for splits in (1, 2):
            sparse_mla_decode(q, latent, table, selected, pool.page_size, 1.0,
                              config.mla.kv_lora_rank, num_splits=splits)

    def colocated(self, model: AnyCausalLM, pool: Pool, locs: torch.Tensor) -> AttentionFn:
        lay, tensor, reference = pool.rows, pool.tensor, dsa_causal_attention(model)

        def attention(layer: int, q: torch.Tensor, latent: torch.Tensor,
                      index: IndexInputs) -> torch.Tensor:
            # The rows as the pool holds them; the indexer scores the keys read back
            # (dequantized for an fp8 cache), as decode will.
            n = latent.shape[0]
            rows = torch.empty((n, lay.head_dim), dtype=lay.dtype, device=latent.device)
            lay.latent(rows)[:] = lay.encode_latent(latent)
            every = torch.arange(n, device=rows.device)
            store_index_k(index.k.contiguous(), lay.index_rows(rows), every, lay.index)
            store_kv(rows[:, None], rows[:, None], tensor[layer, 0], tensor[layer, 0], locs)
            keys = read_index_k(lay.index_rows(rows), every, lay.index).to(index.k.dtype)
            stored = lay.decode_latent(lay.latent(rows))  # FP8 rows: dequantized
            return reference(layer, q, stored, index._replace(k=keys))

        return attention


def _select(batch: CPBatch, scale: float, topk: int, index: IndexInputs,
            keys: torch.Tensor) -> torch.Tensor:
    """``[n_local, topk]`` int32 rows of the gathered buffer per query, ``-1`` padded
    (rows outside every segment, compute padding, select nothing)."""
    out = torch.full((index.q.shape[0], topk), -1, dtype=torch.int32, device=keys.device)
    for seg in batch.query_segments:
        first = seg.kv_first
        own = keys[first : first + seg.kv_len].to(index.q.dtype)
        end = seg.q_start + seg.q_len
        for lo in range(seg.q_start, end, QUERY_CHUNK):
            rows = slice(lo, min(lo + QUERY_CHUNK, end))
            positions = torch.arange(seg.q_pos + lo - seg.q_start, seg.q_pos + rows.stop - seg.q_start,
                                     device=keys.device)
            scores = index_scores(index.q[rows], own, index.weights[rows], positions, scale)
            chosen = index_topk(scores, topk)
            out[rows] = torch.where(chosen >= 0, chosen + first, chosen)
    return out
