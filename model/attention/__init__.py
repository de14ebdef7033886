"""The attention kinds, one file each, and the one place that tells them apart.

``kind_of(config)`` is the kind of a model config; everything that differs by
kind (pool rows, contract fields, RoPE placement, the CP prefill, paged decode
and colocated callbacks, warm-up) is a method of it (``base.AttentionKind``).
Adding a kind is its file (and its kernels) plus one line in ``KINDS``, which
is asked in order: the first kind that ``matches`` a config is its kind.
"""

from __future__ import annotations

from typing import Any

import torch
from lanekv.model.attention.base import (
    AnyCausalLM,
    AttentionKind,
    CPBatch,
    DecodeStep,
    QuerySegment,
)
from lanekv.model.attention.dsa import DSA
from lanekv.model.attention.gqa import GQA
from lanekv.model.attention.mla import MLA
from lanekv.model.attention.rows import (
    DEFAULT_INDEX_CACHE_DTYPE,
    DEFAULT_KV_CACHE_DTYPE,
    DSARows,
    RowLayout,
)
from lanekv.model.config import ModelConfig

KINDS: tuple[AttentionKind, ...] = (
    DSA(),  # DeepSeek-V3.2: MLA plus the indexer's index-K rows
    MLA(),  # DeepSeek-V2/V3: one latent row
    GQA(),  # the Llama family: K and V heads
)

__all__ = ["KINDS", "AnyCausalLM", "AttentionKind", "CPBatch", "DSARows", "DecodeStep",
           "QuerySegment", "RowLayout", "kind_of", "pool_contract_fields", "pool_rows"]


def kind_of(config: ModelConfig) -> AttentionKind:
    """The attention kind of ``config``'s model."""
    for kind in KINDS:
        if kind.matches(config):
            return kind
    raise ValueError(f"no attention kind runs architecture={config.architecture!r}")


def pool_rows(config: ModelConfig, dtype: torch.dtype,
              index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
              kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> RowLayout:
    """The row layout of ``config``'s pool in ``dtype`` (both daemons build theirs here);
    its ``dtype`` is the pool tensor's (uint8 for FP8 rows)."""
    return kind_of(config).rows(config, dtype, index_cache_dtype=index_cache_dtype,
                                kv_cache_dtype=kv_cache_dtype)


def pool_contract_fields(config: ModelConfig, dtype: torch.dtype,
                         index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
                         kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE) -> dict[str, Any]:
    """The contract fields of ``config`` served from a pool of ``pool_rows``."""
    kind = kind_of(config)
    return kind.contract_fields(config, pool_rows(config, dtype, index_cache_dtype, kv_cache_dtype))
