"""What one token's row in one layer of a KV pool holds: the row layout of a kind.

A pool is ``[num_layers, kv, num_pages * page_size, kv_heads, head_dim]``
(``kernels/kv_layout.py``); a ``RowLayout`` says ``kv``, ``kv_heads``,
``head_dim`` and ``dtype`` and gives the views an attention reads of one
layer's plane ``pool[l, 0, :, 0]``. GQA rows are K and V heads (``kv = 2``);
MLA rows are one latent row (``kv = 1``, ``kv_heads = 1``); a DeepSeek-V3.2
(DSA) row is the latent then the index-K bytes (``DSARows`` over
``kernels/dsa/pool_layout.py``), whose bytes depend on the daemons'
``index_cache_dtype`` (``fp8_e4m3``: e4m3 values plus a float32 scale per
quantization block; ``model``: the key in the model dtype). A new row format
(FP8 latent rows, say) is a new ``RowLayout`` subclass that its kind returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from lanekv.kernels.dsa.index_cache import INDEX_CACHE_DTYPES, IndexCacheSpec
from lanekv.kernels.dsa.pool_layout import DSARowLayout
from lanekv.kernels.kv_layout import KVCacheSpec

DEFAULT_INDEX_CACHE_DTYPE = "fp8_e4m3"
MAX_QUANT_BLOCK = 128  # values per float32 scale, as DeepSeek and SGLang store index K


def check_index_cache_dtype(value: object) -> str:
    if value not in INDEX_CACHE_DTYPES:
        raise ValueError(f"index_cache_dtype must be one of {INDEX_CACHE_DTYPES}, "
                         f"got index_cache_dtype={value!r}")
    return value


@dataclass(frozen=True)
class RowLayout:
    """``kv`` planes of ``[kv_heads, head_dim]`` values of ``dtype`` per token and layer."""

    kv: int  # planes per layer: 2 (K, V) or 1 (one row holds everything)
    kv_heads: int
    head_dim: int  # pool elements per head (a DSA row counts its index bytes here too)
    dtype: torch.dtype

    @classmethod
    def of_spec(cls, spec: KVCacheSpec) -> RowLayout:
        """The plain rows of a pool spec (K/V heads, or one latent row when kv is 1)."""
        return cls(spec.kv, spec.kv_heads, spec.head_dim, spec.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's rows in one layer, all planes."""
        return self.kv * self.kv_heads * self.head_dim * self.dtype.itemsize

    def spec(self, num_layers: int, page_size: int) -> KVCacheSpec:
        return KVCacheSpec(num_layers=num_layers, kv_heads=self.kv_heads, head_dim=self.head_dim,
                           dtype=self.dtype, page_size=page_size, kv=self.kv)

    def pool_shape(self, num_layers: int, rows: int) -> tuple[int, int, int, int, int]:
        return (num_layers, self.kv, rows, self.kv_heads, self.head_dim)

    def latent(self, plane: torch.Tensor) -> torch.Tensor:
        """``[rows, latent_dim]`` view of one layer's plane ``pool[l, 0, :, 0]``."""
        if self.kv != 1 or self.kv_heads != 1:
            raise ValueError(f"a latent view needs an MLA pool (kv=1, kv_heads=1), these rows have "
                             f"kv={self.kv} kv_heads={self.kv_heads}")
        return plane

    def index_rows(self, plane: torch.Tensor) -> torch.Tensor:
        """``[rows, row_bytes]`` uint8 index-K view of a plane (DSA rows only)."""
        raise ValueError("an index-K view needs a DSA pool (DeepSeek-V3.2), these rows hold no "
                         "index keys")


@dataclass(frozen=True)
class DSARows(RowLayout):
    """A DeepSeek-V3.2 row: the MLA latent, then from ``index_offset`` the index-K row."""

    layout: DSARowLayout

    def __post_init__(self) -> None:
        want = (1, 1, self.layout.head_dim, self.layout.dtype)
        if (self.kv, self.kv_heads, self.head_dim, self.dtype) != want:
            raise ValueError(f"a DSA pool has kv=1, kv_heads=1, head_dim={self.layout.head_dim} and "
                             f"dtype {self.layout.dtype}, got kv={self.kv} kv_heads={self.kv_heads} "
                             f"head_dim={self.head_dim} dtype={self.dtype}")

    @classmethod
    def build(cls, latent_dim: int, index_head_dim: int, dtype: torch.dtype,
              index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE) -> DSARows:
        spec = IndexCacheSpec(head_dim=index_head_dim, cache_dtype=index_cache_dtype,
                              model_dtype=dtype, block=math.gcd(index_head_dim, MAX_QUANT_BLOCK))
        layout = DSARowLayout(latent_dim=latent_dim, index=spec)
        return cls(1, 1, layout.head_dim, layout.dtype, layout)

    @property
    def latent_dim(self) -> int:
        return self.layout.latent_dim

    @property
    def index(self) -> IndexCacheSpec:
        return self.layout.index

    @property
    def index_offset(self) -> int:
        return self.layout.index_offset

    def latent(self, plane: torch.Tensor) -> torch.Tensor:
        return self.layout.latent(plane)

    def index_rows(self, plane: torch.Tensor) -> torch.Tensor:
        return self.layout.index_rows(plane)
