"""The DSA pool row: a token's MLA latent row and its index-K row side by side.

A DeepSeek-V3.2 pool is the MLA pool of ``kernels/kv_layout.py`` (``[L, 1,
rows, 1, head_dim]``) whose rows are wider: the latent row
(``kv_lora_rank + qk_rope_head_dim`` values of the model dtype) first, then,
from byte ``index_offset`` (the latent's bytes rounded up to 4), the token's
index-K row (``IndexCacheSpec.row_bytes`` bytes), the whole row rounded up to
16 bytes so that rows stay aligned for vector loads (V3.2 in bf16 with fp8
index keys: 576 * 2 + 132 = 1284 bytes, 1296 with the padding).

So the index-K pool of a layer is a strided ``[rows, row_bytes]`` uint8 view
of the same tensor: the same page ids and owner lanes as the latent by
construction, and every page copy, digest, wire chunk and fast-path copy moves
(and checksums) both together. ``latent(plane)`` and ``index_rows(plane)``
give the two views of one layer's plane ``pool[l, 0, :, 0]``.

With FP8 KV (``fp8_rank``: the model's ``kv_lora_rank``) the latent part is the
FP8 MLA row of ``kernels/fp8/kv_rows.py`` (656 bytes for V3.2) and the pool is
uint8: 656 + 132 = 788 bytes, 800 with the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lanekv.kernels.dsa.index_cache import IndexCacheSpec
from lanekv.kernels.fp8.kv_rows import check_mla_fp8_rank, mla_fp8_row_bytes

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def dsa_row_elements(latent_dim: int, itemsize: int, index_row_bytes: int) -> int:
    """Pool elements per row holding ``latent_dim`` values then ``index_row_bytes`` bytes
    (``transfer.protocol.agreement`` checks an agreement's ``head_dim`` by the same rule)."""
    return _round_up(_round_up(latent_dim * itemsize, 4) + index_row_bytes, 16) // itemsize


@dataclass(frozen=True)
class DSARowLayout:
    """Where the latent and the index-K bytes sit in one pool row."""

    latent_dim: int  # kv_lora_rank + qk_rope_head_dim
    index: IndexCacheSpec
    fp8_rank: int = 0  # kv_lora_rank of an FP8 latent row; 0: the latent in the model dtype

    def __post_init__(self) -> None:
        if isinstance(self.latent_dim, bool) or not isinstance(self.latent_dim, int) or (
            self.latent_dim <= 0
        ):
            raise ValueError(f"latent_dim must be a positive int, got {self.latent_dim!r}")
        if not isinstance(self.index, IndexCacheSpec):
            raise ValueError(f"index must be an IndexCacheSpec, got {type(self.index).__name__}")
        if self.fp8_rank:
            check_mla_fp8_rank(self.fp8_rank)
            if self.fp8_rank >= self.latent_dim:
                raise ValueError(f"fp8_rank={self.fp8_rank} must be below latent_dim "
                                 f"{self.latent_dim}")

    @property
    def dtype(self) -> torch.dtype:
        """The pool's dtype: the model dtype, or uint8 with an FP8 latent."""
        return torch.uint8 if self.fp8_rank else self.index.model_dtype

    @property
    def latent_width(self) -> int:
        """Pool elements of the latent part: its values, or its FP8 row's bytes."""
        if self.fp8_rank:
            return mla_fp8_row_bytes(self.fp8_rank, self.latent_dim - self.fp8_rank)
        return self.latent_dim

    @property
    def index_offset(self) -> int:
        """Byte of the row where the index-K row starts (4-byte aligned)."""
        return _round_up(self.latent_width * self.dtype.itemsize, 4)

    @property
    def head_dim(self) -> int:
        """Pool elements per row (the pool's and the agreement's ``head_dim``)."""
        return dsa_row_elements(self.latent_width, self.dtype.itemsize, self.index.row_bytes)

    def _check(self, plane: torch.Tensor) -> None:
        if not isinstance(plane, torch.Tensor) or plane.dim() != 2 or (
            plane.shape[1] != self.head_dim
        ) or plane.dtype != self.dtype:
            desc = (tuple(plane.shape), plane.dtype) if isinstance(plane, torch.Tensor) else plane
            raise ValueError(f"plane must be [rows, {self.head_dim}] {self.dtype}, got {desc}")
        if plane.stride(1) != 1:
            raise ValueError(f"plane must have dense rows, got strides {plane.stride()}")

    def latent(self, plane: torch.Tensor) -> torch.Tensor:
        """``[rows, latent_width]`` view of a plane ``[rows, head_dim]`` (an FP8 latent:
        its uint8 row bytes)."""
        self._check(plane)
        return plane[:, : self.latent_width]

    def index_rows(self, plane: torch.Tensor) -> torch.Tensor:
        """``[rows, index.row_bytes]`` uint8 view of a plane ``[rows, head_dim]``."""
        self._check(plane)
        start = self.index_offset
        if plane.shape[0] == 0:
            return torch.empty((0, self.index.row_bytes), dtype=torch.uint8, device=plane.device)
        return plane.view(torch.uint8)[:, start : start + self.index.row_bytes]
