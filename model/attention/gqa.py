"""GQA: the Llama family (Llama, Qwen2/3, Mistral, Qwen3-MoE); K and V heads per token.

Rows are ``kv = 2`` planes of ``[num_kv_heads, head_dim]``. RoPE runs in the
callbacks: the CP prefill and decode callbacks fuse it with the K/V store
(``rope_store_kv``), so the model hands them q and k before RoPE and cos/sin.

- CP prefill: one launch rotates q and k, stores the rank's owned rows and
  fills the block's new rows; the gather brings every rank's K/V rows in
  request order; ``segment_attention`` attends the rank's query segments (the Triton
  kernel, or cuDNN's with ``LANEKV_PREFILL_ATTENTION=cudnn``).
- Paged decode: RoPE fused with the store of the new token's K/V, then
  ``paged_decode_attention`` through the page table.
- Colocated: RoPE, the K/V stored at the prompt's rows, plain causal attention.

FP8 KV (``FP8Rows``): one launch rotates q and k, quantizes K and V and stores the
rows (``rope_store_kv_fp8``, in every path: CP prefill, decode step, colocated), and
those bytes are stored, gathered and read; the CP prefill and the colocated run
attend on the dequantized rows (``rows.decode``), and the decode kernel dequantizes
the same way as it loads them.
"""

from __future__ import annotations

import torch
import triton
from lanekv.kernels.decode_attention import DecodeConfig, paged_decode_attention
from lanekv.kernels.fp8.rope_store import rope_store_kv_fp8
from lanekv.kernels.rope_store import apply_rotary, rope_store_kv
from lanekv.kernels.store_kv import store_kv
from lanekv.model.attention.base import (
    AnyCausalLM,
    AttentionFn,
    AttentionKind,
    CPBatch,
    DecodeStep,
    Pool,
    segment_attention,
    table_width,
)
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    FP8Rows,
    RowLayout,
    check_index_cache_dtype,
    check_kv_cache_dtype,
)
from lanekv.model.config import ModelConfig
from lanekv.model.llama import CausalLM, causal_attention
from lanekv.model.qwen3_moe import Qwen3MoeCausalLM


class GQA(AttentionKind):
    name = "gqa"
    rope_in_attention = True
    prefill_graphs = True

    def matches(self, config: ModelConfig) -> bool:
        return config.mla is None

    def model_class(self, config: ModelConfig) -> type[CausalLM]:
        return CausalLM if config.moe is None else Qwen3MoeCausalLM

    def rows(self, config: ModelConfig, dtype: torch.dtype, *,
             index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
             kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> RowLayout:
        check_index_cache_dtype(index_cache_dtype)  # a daemon option, checked for every model
        if check_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3":
            return FP8Rows.build(config.num_kv_heads, config.head_dim, dtype)
        return RowLayout(2, config.num_kv_heads, config.head_dim, dtype)

    def fits(self, config: ModelConfig, rows: RowLayout) -> bool:
        if isinstance(rows, FP8Rows):
            return self.matches(config) and (rows.kv_heads, rows.value_dim) == (
                config.num_kv_heads, config.head_dim)
        return self.matches(config) and type(rows) is RowLayout and (
            rows.kv, rows.kv_heads, rows.head_dim) == (2, config.num_kv_heads, config.head_dim)

    def cp_prefill(self, model: AnyCausalLM, batch: CPBatch) -> AttentionFn:
        pool, scale = batch.pool, model.config.softmax_scale
        if isinstance(batch.rows, FP8Rows):
            return _fp8_cp_prefill(batch, scale)

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            # [block_rows, 2, kv_heads, head_dim]: new K/V rows, then owned prefix rows.
            # Padding rows stay unwritten: the rerange index never points at them. One
            # launch rotates, stores and fills (it replaced a dozen per layer: 1k-token
            # prefills are bound by the host's launches).
            block = k.new_empty((batch.block_rows, 2, *k.shape[1:]))
            q = rope_store_kv(q, k, v, cos, sin, pool[layer, 0], pool[layer, 1], batch.store_rows,
                              kv_out=block[: k.shape[0]])
            kv = batch.gather(layer, block)  # [kv rows in request order, 2, Hkv, D]
            if batch.on_layer is not None:
                batch.on_layer(layer)
            return segment_attention(q, kv[:, 0], kv[:, 1], batch.segments, scale, batch.query_segments)

        return attention

    def paged_decode(self, model: AnyCausalLM, pool: Pool, step: DecodeStep) -> AttentionFn:
        page_size, scale, tensor = pool.page_size, model.config.softmax_scale, pool.tensor
        rows = pool.rows

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = tensor[layer, 0], tensor[layer, 1]
            # RoPE, then the new token's K/V first: it attends itself
            if isinstance(rows, FP8Rows):  # quantized on write; the kernel dequantizes on load
                q = rope_store_kv_fp8(q, k, v, cos, sin, k_cache, v_cache, step.locs)
            else:
                q = rope_store_kv(q, k, v, cos, sin, k_cache, v_cache, step.locs)
            return paged_decode_attention(q, k_cache, v_cache, step.page_table, step.seq_lens,
                                          page_size, scale)

        return attention

    def colocated(self, model: AnyCausalLM, pool: Pool, locs: torch.Tensor) -> AttentionFn:
        scale, tensor, rows = model.config.softmax_scale, pool.tensor, pool.rows

        def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            if isinstance(rows, FP8Rows):  # the op every FP8 path stores a new row with
                kv = k.new_empty((k.shape[0], 2, rows.kv_heads, rows.head_dim), dtype=torch.uint8)
                q = rope_store_kv_fp8(q, k, v, cos, sin, tensor[layer, 0], tensor[layer, 1], locs,
                                      kv_out=kv)
                # what the pool holds, read back
                return causal_attention(q, rows.decode(kv[:, 0]), rows.decode(kv[:, 1]), scale)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            store_kv(k, v, tensor[layer, 0], tensor[layer, 1], locs)
            return causal_attention(q, k, v, scale)

        return attention

    def warm_up_decode(self, config: ModelConfig, pool: Pool) -> None:
        """The split count decides two compile-time values (whether partials are written,
        and the merge's block), so each split count up to the most the pool allows runs
        once, reading nothing (``seq_lens`` 0) and writing only its own output."""
        rows, page_size, tensor = pool.rows, pool.page_size, pool.tensor
        width = table_width(pool, config.max_position_embeddings)
        # The most splits the launcher picks: enough programs for every SM, and no
        # more than one per key block.
        cfg = DecodeConfig()
        sms = torch.cuda.get_device_properties(tensor.device).multi_processor_count
        most = max(1, min(triton.cdiv(width * page_size, cfg.block_n),
                          triton.cdiv(sms * cfg.programs_per_sm, rows.kv_heads)))
        q = torch.zeros((1, config.num_heads, config.head_dim), dtype=rows.value_dtype,
                        device=tensor.device)
        table = torch.zeros((1, width), dtype=torch.int32, device=tensor.device)
        lens = torch.zeros(1, dtype=torch.int32, device=tensor.device)
        splits = 1
        while True:  # 1, 2, 3, 5, 9, ...: every merge block size, and no merge at all
            paged_decode_attention(q, tensor[0, 0], tensor[0, 1], table, lens, page_size, 1.0,
                                   num_splits=splits)
            if splits >= most:
                break
            splits = min(most, 2 * splits - 1 if splits > 1 else 2)


def _fp8_cp_prefill(batch: CPBatch, scale: float) -> AttentionFn:
    """The CP prefill callback over FP8 rows: quantize, store and gather the bytes, attend on
    the gathered rows dequantized (the values every later decode step reads)."""
    pool, rows = batch.pool, batch.rows

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # [block_rows, 2, Hkv, D + 4] uint8: the new rows (rotated, quantized, stored where
        # owned, in one launch), then owned prefix rows
        block = k.new_empty((batch.block_rows, 2, rows.kv_heads, rows.head_dim), dtype=torch.uint8)
        q = rope_store_kv_fp8(q, k, v, cos, sin, pool[layer, 0], pool[layer, 1], batch.store_rows,
                              kv_out=block[: k.shape[0]])
        kv = rows.decode(batch.gather(layer, block))  # [kv rows in request order, 2, Hkv, D]
        if batch.on_layer is not None:
            batch.on_layer(layer)
        return segment_attention(q, kv[:, 0], kv[:, 1], batch.segments, scale, batch.query_segments)

    return attention
