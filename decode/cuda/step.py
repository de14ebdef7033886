"""The model run of one decode step, shared by the eager engine and the captured steps.

``step_hidden`` feeds one token per request at its position and returns the
final hidden rows. Attention stores the new token's KV at ``locs`` first (a
negative loc stores nothing: padding rows) and then reads each request's
``seq_lens[b]`` cached tokens through ``page_table``:

- a Llama-family model: RoPE fused with the K/V store (``rope_store_kv``), then
  paged GQA decode attention;
- an MLA model (DeepSeek): the latent row stored in the pool's one plane, q_nope
  absorbed through kv_b_proj's K part (one batched GEMM over the heads), paged
  MLA decode attention in the latent space, the output mapped back through the
  V part;
- a DSA model (DeepSeek-V3.2): the latent and index-K row stored together, the
  top ``index_topk`` positions selected with the index-K pages, sparse MLA
  decode over those latent rows.

Every op is a device op whose shapes depend only on the batch size, so the
same function runs eagerly or inside a CUDA-graph capture (``decode.cuda.graphs``).
"""

from __future__ import annotations

import torch
from lanekv.decode.pool import PagePool
from lanekv.kernels.decode_attention import paged_decode_attention
from lanekv.kernels.dsa.index_cache import store_index_k
from lanekv.kernels.dsa.select import decode_select
from lanekv.kernels.dsa.sparse_mla import sparse_mla_decode
from lanekv.kernels.mla_decode import paged_mla_decode_attention
from lanekv.kernels.rope_store import rope_store_kv
from lanekv.kernels.store_kv import store_kv
from lanekv.model.deepseek import DeepseekCausalLM
from lanekv.model.llama import CausalLM


def step_hidden(model: CausalLM | DeepseekCausalLM, pool: PagePool, input_ids: torch.Tensor,
                positions: torch.Tensor, locs: torch.Tensor, page_table: torch.Tensor,
                seq_lens: torch.Tensor) -> torch.Tensor:
    """``[B]`` ids, positions, locs (int64), ``[B, pages]`` page table and ``[B]``
    seq lens (int32, the new token included) -> hidden ``[B, hidden]``."""
    page_size, scale = pool.page_size, model.config.softmax_scale
    if pool.dsa is not None:
        return model(input_ids, positions,
                     _sparse_attention(model, pool, locs, page_table, seq_lens))
    if model.config.mla is not None:
        rank = model.config.mla.kv_lora_rank

        def latent_attention(layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
            mla, plane = model.mla_layer(layer), pool.tensor[layer, 0]  # [rows, 1, R + P]
            rows = latent[:, None, :]
            store_kv(rows, rows, plane, plane, locs)  # one plane: "K" and "V" are the row
            o_latent = paged_mla_decode_attention(
                mla.absorb_query(q), pool.latent_cache(layer), page_table, seq_lens, page_size,
                scale, rank)
            return mla.expand_output(o_latent)

        return model(input_ids, positions, latent_attention)

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = pool.k_cache(layer), pool.v_cache(layer)
        # RoPE, then the new token's K/V first: it attends itself
        q = rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, locs)
        return paged_decode_attention(q, k_cache, v_cache, page_table, seq_lens, page_size, scale)

    return model(input_ids, positions, attention, rope_in_attention=True)


def _sparse_attention(model: DeepseekCausalLM, pool: PagePool, locs: torch.Tensor,
                      page_table: torch.Tensor, seq_lens: torch.Tensor):
    """The DSA callback: store the new row (latent, then the index key, fp8-quantized
    by the fused store for an fp8 cache), select each request's top ``index_topk``
    positions with its index-K pages (``decode_select``), attend to those latent rows
    only (``sparse_mla_decode``), map back through kv_b_proj's V part."""
    lay, dsa = pool.dsa, model.config.dsa
    scale, rank = model.config.softmax_scale, model.config.mla.kv_lora_rank
    local = torch.arange(locs.shape[0], device=locs.device)

    def attention(layer: int, q: torch.Tensor, latent: torch.Tensor, index) -> torch.Tensor:
        mla, plane = model.mla_layer(layer), pool.tensor[layer, 0]  # [rows, 1, row]
        rows = latent.new_empty((latent.shape[0], lay.head_dim))
        lay.latent(rows)[:] = latent
        store_index_k(index.k.contiguous(), lay.index_rows(rows), local, lay.index)
        store_kv(rows[:, None], rows[:, None], plane, plane, locs)
        selected = decode_select(index.q, index.weights, pool.index_cache(layer), page_table,
                                 seq_lens, pool.page_size, dsa.softmax_scale, dsa.index_topk,
                                 lay.index)
        o_latent = sparse_mla_decode(mla.absorb_query(q), pool.latent_cache(layer), page_table,
                                     selected, pool.page_size, scale, rank)
        return mla.expand_output(o_latent)

    return attention
