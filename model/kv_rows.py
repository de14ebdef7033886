"""What one token's pool row holds for a model, and the contract fields it implies.

GQA and MLA rows are the model's ``(num_kv_heads, head_dim)``. A DeepSeek-V3.2
(DSA) row is the MLA latent followed by the index-K row
(``kernels/dsa/pool_layout.py``), whose bytes depend on the daemons'
``index_cache_dtype`` (``fp8_e4m3``: e4m3 values plus a float32 scale per
quantization block; ``model``: the key in the model dtype). Both daemons
build their pools and their agreements through here, so the pool's
``head_dim`` and the agreement's index fields come from one place.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lanekv.kernels.dsa.index_cache import INDEX_CACHE_DTYPES, IndexCacheSpec
from lanekv.kernels.dsa.pool_layout import DSARowLayout
from lanekv.model.config import ModelConfig

DEFAULT_INDEX_CACHE_DTYPE = "fp8_e4m3"
MAX_QUANT_BLOCK = 128  # values per float32 scale, as DeepSeek and SGLang store index K


def check_index_cache_dtype(value: object) -> str:
    if value not in INDEX_CACHE_DTYPES:
        raise ValueError(f"index_cache_dtype must be one of {INDEX_CACHE_DTYPES}, "
                         f"got index_cache_dtype={value!r}")
    return value


def dsa_layout(config: ModelConfig, dtype: torch.dtype,
               index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE) -> DSARowLayout | None:
    """The row layout of a DSA model's pool in ``dtype``; None for other models."""
    check_index_cache_dtype(index_cache_dtype)
    if config.dsa is None:
        return None
    dim = config.dsa.index_head_dim
    spec = IndexCacheSpec(head_dim=dim, cache_dtype=index_cache_dtype, model_dtype=dtype,
                          block=math.gcd(dim, MAX_QUANT_BLOCK))
    return DSARowLayout(latent_dim=config.mla.latent_dim, index=spec)


def pool_head_dim(config: ModelConfig, dtype: torch.dtype,
                  index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE) -> int:
    """Elements per pool row (per KV head): the model's ``head_dim``, wider for DSA."""
    layout = dsa_layout(config, dtype, index_cache_dtype)
    return config.head_dim if layout is None else layout.head_dim


def pool_contract_fields(config: ModelConfig, dtype: torch.dtype,
                         index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE) -> dict[str, Any]:
    """``config.contract_fields()`` with the pool's row: for DSA the row's ``head_dim``
    and a ``dsa`` map (index dims, top-k, cache dtype, quantization block, row bytes)
    that ``Agreement.from_model`` turns into agreement fields of their own."""
    fields = config.contract_fields()
    layout = dsa_layout(config, dtype, index_cache_dtype)
    if layout is None:
        return fields
    fields["head_dim"] = layout.head_dim
    fields["dsa"] = {
        "index_n_heads": config.dsa.index_n_heads,
        "index_head_dim": config.dsa.index_head_dim,
        "index_topk": config.dsa.index_topk,
        "index_cache_dtype": index_cache_dtype,
        "index_block": layout.index.block,
        "index_row_bytes": layout.index.row_bytes,
    }
    return fields
