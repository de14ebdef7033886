"""What one token's row in one layer of a KV pool holds: the row layout of a kind.

A pool is ``[num_layers, kv, num_pages * page_size, kv_heads, head_dim]``
(``kernels/kv_layout.py``); a ``RowLayout`` says ``kv``, ``kv_heads``,
``head_dim`` and ``dtype`` and gives the views an attention reads of one
layer's plane ``pool[l, 0, :, 0]``. GQA rows are K and V heads (``kv = 2``);
MLA rows are one latent row (``kv = 1``, ``kv_heads = 1``); a DeepSeek-V3.2
(DSA) row is the latent then the index-K bytes (``DSARows`` over
``kernels/dsa/pool_layout.py``), whose bytes depend on the daemons'
``index_cache_dtype`` (``fp8_e4m3``: e4m3 values plus a float32 scale per
quantization block; ``model``: the key in the model dtype).

FP8 KV (the daemons' ``kv_cache_dtype``: ``auto``, the model dtype, or
``fp8_e4m3``) changes the rows, not the pool's shape rules: the pool is uint8
and ``head_dim`` counts bytes. ``FP8Rows`` (GQA): each head's D e4m3 values
then its float32 scale (``D + 4`` bytes); ``FP8MLARows``: FlashMLA's FP8 latent
row (656 bytes for 512 + 64); a DSA row with an FP8 latent is ``DSARows`` over a
``DSARowLayout`` with ``fp8_rank``. Every layout has ``encode`` (values in the
model dtype -> the rows the pool stores) and ``decode`` (stored rows -> the
values attention reads): identities for plain rows, quantize and dequantize for
FP8 ones. Each path (CP prefill, colocated, decode) attends on ``decode`` of
what it stored, so what the prefill attends is what the decode reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from lanekv.kernels.dsa.index_cache import INDEX_CACHE_DTYPES, IndexCacheSpec
from lanekv.kernels.dsa.pool_layout import DSARowLayout
from lanekv.kernels.fp8.kv_rows import (
    dequantize_kv_fp8_rows,
    kv_fp8_head_bytes,
    mla_fp8_group,
    mla_fp8_row_bytes,
    mla_fp8_row_stride,
    pack_kv_fp8_rows,
    pack_mla_fp8_rows,
    unpack_mla_fp8_rows,
)
from lanekv.kernels.kv_layout import KVCacheSpec

DEFAULT_INDEX_CACHE_DTYPE = "fp8_e4m3"
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
DEFAULT_KV_CACHE_DTYPE = "auto"
MAX_QUANT_BLOCK = 128  # values per float32 scale, as DeepSeek and SGLang store index K


def check_index_cache_dtype(value: object) -> str:
    if value not in INDEX_CACHE_DTYPES:
        raise ValueError(f"index_cache_dtype must be one of {INDEX_CACHE_DTYPES}, "
                         f"got index_cache_dtype={value!r}")
    return value


def check_kv_cache_dtype(value: object) -> str:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                         f"got kv_cache_dtype={value!r}")
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

    # ---- what the rows hold (the contract names these) ----

    @property
    def kv_cache_dtype(self) -> str:
        """``auto`` (the model dtype) or ``fp8_e4m3``."""
        return "auto"

    @property
    def row_format(self) -> str:
        """The row layout's name in the contract (``""``: plain values of ``dtype``)."""
        return ""

    @property
    def value_dtype(self) -> torch.dtype:
        """The dtype attention reads the rows in (the model dtype)."""
        return self.dtype

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Values ``[T, kv_heads, value dim]`` in the model dtype -> the rows stored."""
        return values

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows ``[..., kv_heads, head_dim]`` -> the values attention reads."""
        return rows


@dataclass(frozen=True)
class FP8Rows(RowLayout):
    """GQA rows in FP8: per head, ``value_dim`` e4m3 bytes then one float32 scale."""

    value_dim: int = 0  # the model's head_dim
    model_dtype: torch.dtype = torch.bfloat16

    @classmethod
    def build(cls, kv_heads: int, head_dim: int, model_dtype: torch.dtype) -> FP8Rows:
        if head_dim % 4:
            raise ValueError(f"kv_cache_dtype='fp8_e4m3' needs head_dim a multiple of 4, got "
                             f"head_dim={head_dim}")
        return cls(2, kv_heads, kv_fp8_head_bytes(head_dim), torch.uint8, head_dim, model_dtype)

    @property
    def kv_cache_dtype(self) -> str:
        return "fp8_e4m3"

    @property
    def row_format(self) -> str:
        return f"gqa_fp8_e4m3:{self.value_dim}xe4m3+f32_scale_per_head"

    @property
    def value_dtype(self) -> torch.dtype:
        return self.model_dtype

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        return pack_kv_fp8_rows(values)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_kv_fp8_rows(rows, self.value_dim, self.model_dtype)


@dataclass(frozen=True)
class FP8MLARows(RowLayout):
    """An MLA latent row in FP8: FlashMLA's layout (``kernels/fp8/kv_rows.py``)."""

    kv_lora_rank: int = 0
    rope_dim: int = 0
    model_dtype: torch.dtype = torch.bfloat16

    @classmethod
    def build(cls, kv_lora_rank: int, rope_dim: int, model_dtype: torch.dtype) -> FP8MLARows:
        """The row padded to 16 bytes (``mla_fp8_row_stride``)."""
        return cls(1, 1, mla_fp8_row_stride(kv_lora_rank, rope_dim), torch.uint8,
                   kv_lora_rank, rope_dim, model_dtype)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the row before its padding."""
        return mla_fp8_row_bytes(self.kv_lora_rank, self.rope_dim)

    @property
    def kv_cache_dtype(self) -> str:
        return "fp8_e4m3"

    @property
    def row_format(self) -> str:
        pad = self.head_dim - self.packed_bytes
        return mla_row_format(self.kv_lora_rank, self.rope_dim) + (f"+{pad}xpad" if pad else "")

    @property
    def value_dtype(self) -> torch.dtype:
        return self.model_dtype

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``[T, 1, R + P]`` -> ``[T, 1, row_bytes]`` (the padding zero)."""
        packed = pack_mla_fp8_rows(values[:, 0], self.kv_lora_rank)
        pad = self.head_dim - packed.shape[1]
        if pad:
            packed = torch.nn.functional.pad(packed, (0, pad))
        return packed[:, None]

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        lead = rows.shape[:-1]
        flat = rows.reshape(-1, rows.shape[-1])[:, : self.packed_bytes]
        return unpack_mla_fp8_rows(flat, self.kv_lora_rank, self.rope_dim,
                                   self.model_dtype).reshape(*lead, -1)


def mla_row_format(kv_lora_rank: int, rope_dim: int) -> str:
    """The contract's name of an FP8 MLA latent row."""
    return (f"mla_fp8_e4m3:{kv_lora_rank}xe4m3+{kv_lora_rank // mla_fp8_group(kv_lora_rank)}"
            f"xf32_scale+{rope_dim}xbf16")


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
              index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE, *, fp8_rank: int = 0) -> DSARows:
        """``fp8_rank``: the model's ``kv_lora_rank`` for an FP8 latent, 0 for the model dtype."""
        spec = IndexCacheSpec(head_dim=index_head_dim, cache_dtype=index_cache_dtype,
                              model_dtype=dtype, block=math.gcd(index_head_dim, MAX_QUANT_BLOCK))
        layout = DSARowLayout(latent_dim=latent_dim, index=spec, fp8_rank=fp8_rank)
        return cls(1, 1, layout.head_dim, layout.dtype, layout)

    @property
    def kv_cache_dtype(self) -> str:
        return "fp8_e4m3" if self.layout.fp8_rank else "auto"

    @property
    def row_format(self) -> str:
        rank = self.layout.fp8_rank
        return mla_row_format(rank, self.latent_dim - rank) if rank else ""

    @property
    def value_dtype(self) -> torch.dtype:
        return self.layout.index.model_dtype

    def encode_latent(self, latent: torch.Tensor) -> torch.Tensor:
        """``[T, R + P]`` model-dtype latents -> what the row's latent part holds."""
        rank = self.layout.fp8_rank
        return pack_mla_fp8_rows(latent, rank) if rank else latent

    def decode_latent(self, part: torch.Tensor) -> torch.Tensor:
        """The row's latent part ``[T, latent_width]`` -> ``[T, R + P]`` in the model dtype."""
        rank = self.layout.fp8_rank
        if not rank:
            return part
        return unpack_mla_fp8_rows(part, rank, self.latent_dim - rank, self.value_dtype)

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
