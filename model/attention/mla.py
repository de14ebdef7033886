"""MLA: DeepSeek-V2/V3; one latent row per token and layer.

Rows are one plane of one head: the latent (``kv_lora_rank`` normed compressed
KV, then the RoPE'd shared key, ``qk_rope_head_dim``). RoPE runs in the model.

- CP prefill: the block is the latent rows, gathered like K/V rows; the rank
  stores its own and decompresses the request's rows into per-head K and V
  (``MLAAttention.decompress``) for the prefill attention (qk 192 / v 128
  for V3, unpadded: ``mla_prefill_attention``).
- Paged decode (a ``RawLatentFn``: the projection before RoPE and kv_a_layernorm):
  one launch rotates q_pe, norms and rotates the latent row and stores it in the
  pool's one plane (``mla_rope_norm_store``), q_nope is absorbed through kv_b_proj's
  K part, ``paged_mla_decode_partials`` attends in the latent space and the
  expansion through the V part merges its split partials as it loads them
  (``MLAAttention.expand_partials``): no launch of its own for the merge.
- Colocated: the latent stored, then decompressed for plain causal attention.

FP8 KV (``FP8MLARows``, FlashMLA's 656-byte row): the model hands the callbacks the
latent before RoPE (``rope_in_attention``) and one launch rotates its key, quantizes
the row and stores it (``mla_rope_store_fp8``, in every path: CP prefill before the
gather, decode step, colocated); the CP prefill and the colocated run decompress the
rows dequantized (``rows.decode``), and the decode kernel dequantizes the rows it
loads the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lanekv.kernels.fp8.rope_store import mla_rope_store_fp8
from lanekv.kernels.mla.expand_merge import mla_expand_partials
from lanekv.kernels.mla.latent_store import mla_rope_norm_store
from lanekv.kernels.mla.paged_decode import paged_mla_decode_attention, paged_mla_decode_partials
from lanekv.kernels.prefill.reference import AttnSegments
from lanekv.kernels.store_kv import store_kv
from lanekv.model.attention.base import (
    AnyCausalLM,
    AttentionFn,
    AttentionKind,
    CPBatch,
    DecodeStep,
    Pool,
    QuerySegment,
    kv_fields,
    segment_attention,
    table_width,
)
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    FP8MLARows,
    RowLayout,
    check_index_cache_dtype,
    check_kv_cache_dtype,
)
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek import DeepseekCausalLM, RawLatentFn
from lanekv.model.llama import causal_attention


class MLA(AttentionKind):
    name = "mla"
    heads_share_rows = True

    def matches(self, config: ModelConfig) -> bool:
        return config.mla is not None and config.dsa is None

    def model_class(self, config: ModelConfig) -> type[DeepseekCausalLM]:
        return DeepseekCausalLM

    def rows(self, config: ModelConfig, dtype: torch.dtype, *,
             index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
             kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> RowLayout:
        check_index_cache_dtype(index_cache_dtype)
        if check_kv_cache_dtype(kv_cache_dtype) == "fp8_e4m3":
            return FP8MLARows.build(config.mla.kv_lora_rank, config.mla.qk_rope_head_dim, dtype)
        return RowLayout(1, 1, config.mla.latent_dim, dtype)

    def fits(self, config: ModelConfig, rows: RowLayout) -> bool:
        if isinstance(rows, FP8MLARows):
            return self.matches(config) and (rows.kv_lora_rank, rows.rope_dim) == (
                config.mla.kv_lora_rank, config.mla.qk_rope_head_dim)
        return self.matches(config) and type(rows) is RowLayout and (
            rows.kv, rows.kv_heads, rows.head_dim) == (1, 1, config.mla.latent_dim)

    def contract_fields(self, config: ModelConfig, rows: RowLayout) -> dict[str, Any]:
        return config.contract_fields({"attention": "mla", "mla": config.mla.contract_fields(),
                                       **kv_fields(rows)})

    def takes_rope(self, attention: AttentionFn) -> bool:
        """FP8 rows' callbacks (``LatentRopeFn``) get the latent before RoPE and cos/sin."""
        return isinstance(attention, LatentRopeFn)

    def cp_prefill(self, model: AnyCausalLM, batch: CPBatch) -> AttentionFn:
        pool, scale, layout = batch.pool, model.config.softmax_scale, batch.rows
        if isinstance(layout, FP8MLARows):
            return _fp8_cp_prefill(model, batch)

        def attention(layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
            rows = layout.encode(latent[:, None, :])  # [T, 1 head, R + P] (FP8: row bytes)
            block = rows.new_empty((batch.block_rows, 1, *rows.shape[1:]))
            block[: rows.shape[0], 0] = rows
            # [rows in request order, R + P]: the values every decode step will read
            gathered = layout.decode(batch.gather(layer, block)[:, 0])[:, 0]
            cache = pool[layer, 0]
            # One plane: the row goes to the same place as "K" and "V" (the same bytes).
            store_kv(rows, rows, cache, cache, batch.store_rows)
            if batch.on_layer is not None:
                batch.on_layer(layer)
            k, v = model.mla_layer(layer).decompress(gathered)
            return mla_prefill_attention(q, k, v, batch.segments, scale, batch.query_segments)

        return attention

    def paged_decode(self, model: AnyCausalLM, pool: Pool, step: DecodeStep) -> AttentionFn:
        page_size, scale, tensor = pool.page_size, model.config.softmax_scale, pool.tensor
        mla_config, rows = model.config.mla, pool.rows
        rank, nope = mla_config.kv_lora_rank, mla_config.qk_nope_head_dim

        def attention(layer: int, q: torch.Tensor, kv_a: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
            mla, plane = model.mla_layer(layer), tensor[layer, 0, :, 0]  # [rows, R + P or bytes]
            norm = mla.kv_a_layernorm
            # q_pe's RoPE, the latent's norm and RoPE, its store (FP8 rows: quantized), one launch
            mla_rope_norm_store(q[..., nope:], kv_a, norm.weight, norm.eps, cos, sin,
                                mla_config.rope_interleave, plane, step.locs, rank)
            parts = paged_mla_decode_partials(  # FP8 rows: the kernel dequantizes on load
                mla.absorb_query(q), rows.latent(plane), step.page_table, step.seq_lens,
                page_size, scale, rank)
            return mla.expand_partials(parts)  # the splits merged in the expansion's prologue

        return RawLatentFn(attention)

    def colocated(self, model: AnyCausalLM, pool: Pool, locs: torch.Tensor) -> AttentionFn:
        scale, tensor, layout = model.config.softmax_scale, pool.tensor, pool.rows
        mla_config = model.config.mla

        def fp8_attention(layer: int, q: torch.Tensor, latent: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> torch.Tensor:
            rows = latent.new_empty((latent.shape[0], layout.head_dim), dtype=torch.uint8)
            mla_rope_store_fp8(latent, cos, sin, mla_config.rope_interleave, tensor[layer, 0, :, 0],
                               locs, mla_config.kv_lora_rank, rows_out=rows)
            stored = layout.decode(rows[:, None])[:, 0]  # what the pool holds, read back
            return causal_attention(q, *model.mla_layer(layer).decompress(stored), scale)

        if isinstance(layout, FP8MLARows):
            return LatentRopeFn(fp8_attention)

        def attention(layer: int, q: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
            plane, rows = tensor[layer, 0], layout.encode(latent[:, None, :])
            store_kv(rows, rows, plane, plane, locs)  # an MLA pool: one latent plane
            stored = layout.decode(rows)[:, 0]  # what the pool holds, read back
            return causal_attention(q, *model.mla_layer(layer).decompress(stored), scale)

        return attention

    def prefill_qk_dim(self, config: ModelConfig) -> int:
        return config.mla.qk_head_dim

    def warm_up_decode(self, config: ModelConfig, pool: Pool) -> None:
        """The latent-space kernel's split count decides only whether partials are
        written: one split and two, each merged alone (batches over
        ``MAX_PROJECTION_TOKENS``) and in the expansion. A latent store to no row."""
        mla = config.mla
        latent = pool.rows.latent(pool.tensor[0, 0, :, 0])  # a DSA row is wider than its latent
        width = table_width(pool, config.max_position_embeddings)
        dtype, like = pool.rows.value_dtype, {"device": latent.device}
        q = torch.zeros((1, config.num_heads, mla.latent_dim), dtype=dtype, **like)
        table = torch.zeros((1, width), dtype=torch.int32, **like)
        lens = torch.zeros(1, dtype=torch.int32, **like)
        w_v = torch.zeros((config.num_heads, mla.v_head_dim, mla.kv_lora_rank), dtype=dtype,
                          **like)
        for splits in (1, 2):  # without and with partials and their merge
            paged_mla_decode_attention(q, latent, table, lens, pool.page_size, 1.0,
                                       mla.kv_lora_rank, num_splits=splits)
            mla_expand_partials(paged_mla_decode_partials(
                q, latent, table, lens, pool.page_size, 1.0, mla.kv_lora_rank, num_splits=splits),
                w_v)
        if self.name != "mla":  # only MLA's own decode stores through it (DSA: store_kv)
            return
        q_full = torch.zeros((1, config.num_heads, mla.qk_head_dim), dtype=dtype, **like)
        half = torch.zeros((1, mla.qk_rope_head_dim // 2), dtype=torch.float32, **like)
        mla_rope_norm_store(q_full[..., mla.qk_nope_head_dim:], q[:, 0], w_v[0, 0], 1e-6, half,
                            half, mla.rope_interleave, pool.tensor[0, 0, :, 0],
                            torch.full((1,), -1, dtype=torch.int64, **like), mla.kv_lora_rank)


def mla_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          segments: AttnSegments, softmax_scale: float,
                          host: Sequence[QuerySegment] | None = None) -> torch.Tensor:
    """``segment_attention`` on MLA's decompressed heads (q/k 192 and v 128 for V3) as
    they are: the Triton kernel scores a qk dim that is no power of two as a power-of-two
    part plus a masked tail and masks v's dim, so nothing is padded; cuDNN's kernel takes
    both dims as they are too."""
    return segment_attention(q, k, v, segments, softmax_scale, host)


@dataclass(frozen=True)
class LatentRopeFn:
    """An MLA callback that takes the latent before RoPE, then cos/sin: ``fn(layer, q,
    latent, cos, sin)`` (FP8 rows, whose store rotates the key)."""

    fn: Callable[..., torch.Tensor]

    def __call__(self, layer: int, q: torch.Tensor, latent: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
        return self.fn(layer, q, latent, cos, sin)


def _fp8_cp_prefill(model: AnyCausalLM, batch: CPBatch) -> LatentRopeFn:
    """The CP prefill callback over FP8 rows: rotate, quantize and store the rank's rows and
    fill the block in one launch, gather the bytes, decompress the gathered rows dequantized
    (the values every decode step reads)."""
    pool, scale, layout, mla = batch.pool, model.config.softmax_scale, batch.rows, model.config.mla

    def attention(layer: int, q: torch.Tensor, latent: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
        # [block_rows, 1, 1, row bytes]: the new rows, then owned prefix rows
        block = latent.new_empty((batch.block_rows, 1, 1, layout.head_dim), dtype=torch.uint8)
        mla_rope_store_fp8(latent, cos, sin, mla.rope_interleave, pool[layer, 0, :, 0],
                           batch.store_rows, mla.kv_lora_rank, rows_out=block[: latent.shape[0], 0, 0])
        gathered = layout.decode(batch.gather(layer, block)[:, 0])[:, 0]  # [rows, R + P]
        if batch.on_layer is not None:
            batch.on_layer(layer)
        k, v = model.mla_layer(layer).decompress(gathered)
        return mla_prefill_attention(q, k, v, batch.segments, scale, batch.query_segments)

    return LatentRopeFn(attention)
