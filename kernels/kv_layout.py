"""The KV pool tensor and the raw-row views the copy kernels move.

One tensor per pool: ``[num_layers, kv, num_pages * page_size, kv_heads,
head_dim]``. A GQA pool has ``kv = 2``: index 0 of dim 1 is K, 1 is V, and
``pool[l, 0]`` and ``pool[l, 1]`` are the per-layer caches. An MLA pool has
``kv = 1`` and ``kv_heads = 1``: ``pool[l, 0, :, 0]`` is the layer's latent
rows ``[num_pages * page_size, kv_lora_rank + qk_rope_head_dim]``. Rows are
token-major ("NHD"), so page ``p`` is rows ``[p * page_size, (p + 1) * page_size)``
of each plane; every copy, digest and transfer moves planes alike.

The copy kernels (store_kv, gather/scatter_pages, rerange) never look at
values: they move rows as machine words, so every dtype, fp8 carried as
uint8 included, is copied bit for bit and NaN payloads survive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

# fp8 travels either as a torch float8 dtype or as raw uint8 bytes.
POOL_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)

# The widest word a copy kernel moves. 4-byte words let Triton emit 16-byte
# vector loads (4 words per thread) whenever rows are 16-byte aligned.
_MAX_WORD_BYTES = 4
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class KVCacheSpec:
    """What decides the bytes of a KV pool: both sides of a transfer agree on it."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_size: int
    kv: int = 2  # planes per layer: 2 (K, V) or 1 (an MLA latent row)

    def __post_init__(self) -> None:
        if self.kv not in (1, 2):
            raise ValueError(f"KVCacheSpec.kv must be 1 or 2, got {self.kv!r}")
        for field in ("num_layers", "kv_heads", "head_dim", "page_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVCacheSpec.{field} must be a positive int, got {value!r}")
        if self.dtype not in POOL_DTYPES:
            raise ValueError(f"KVCacheSpec.dtype must be one of {POOL_DTYPES}, got {self.dtype!r}")

    @property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one token row of one layer's K (or V): ``(kv_heads, head_dim)``."""
        return (self.kv_heads, self.head_dim)

    @property
    def row_bytes(self) -> int:
        return self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers and planes."""
        return self.num_layers * self.kv * self.page_size * self.row_bytes

    def pool_shape(self, num_pages: int) -> tuple[int, ...]:
        return (self.num_layers, self.kv, num_pages * self.page_size, *self.row_shape)

    def alloc_pool(self, num_pages: int, device: torch.device | str) -> torch.Tensor:
        """A zeroed pool: unwritten rows never carry stale bytes onto the wire."""
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 0:
            raise ValueError(f"num_pages must be a non-negative int, got {num_pages!r}")
        return torch.zeros(self.pool_shape(num_pages), dtype=self.dtype, device=device)

    def check_pool(self, pool: torch.Tensor, name: str = "pool") -> int:
        """Raise ValueError unless ``pool`` has this layout; return its number of pages."""
        if not isinstance(pool, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(pool).__name__}")
        if pool.dtype != self.dtype:
            raise ValueError(f"{name}.dtype is {pool.dtype}, the spec says {self.dtype}")
        shape = tuple(pool.shape)
        if (
            len(shape) != 5
            or shape[0] != self.num_layers
            or shape[1] != self.kv
            or shape[3:] != self.row_shape
        ):
            expected = (self.num_layers, self.kv, "num_pages * page_size", *self.row_shape)
            raise ValueError(f"{name} has shape {shape}, expected {expected}")
        if shape[2] % self.page_size != 0:
            raise ValueError(
                f"{name} has {shape[2]} rows, not a multiple of page_size {self.page_size}"
            )
        if not pool.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {pool.stride()}")
        return shape[2] // self.page_size


def check_pool_tensor(pool: torch.Tensor, page_size: int, name: str = "pool") -> int:
    """Check a pool against its own shape (no spec at hand); return its number of pages."""
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 5 or pool.shape[1] not in (1, 2):
        shape = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
        raise ValueError(
            f"{name} must be [num_layers, kv (2, or 1 for MLA), rows, kv_heads, head_dim], "
            f"got {shape}"
        )
    spec = KVCacheSpec(
        num_layers=pool.shape[0],
        kv_heads=pool.shape[3],
        head_dim=pool.shape[4],
        dtype=pool.dtype,
        page_size=page_size,
        kv=pool.shape[1],
    )
    return spec.check_pool(pool, name)


class CopyConfig(NamedTuple):
    """Tile of a copy kernel: ``block_rows x block_words`` words per program.

    Row-gather kernels (store_kv, rerange) move ``block_rows`` rows of
    ``block_words`` words; page_copy moves one flat run of
    ``block_rows * block_words`` words of a page.
    """

    block_rows: int
    block_words: int
    num_warps: int

    @staticmethod
    def for_rows(row_words: int, tile_words: int = 8192, num_warps: int = 8) -> CopyConfig:
        # 32 KiB per program, 32 words per thread: on an H200 (2026-11-30 sweep,
        # bench/notes_copy_kernels.md) this was at or near the best of the tiles
        # tried for every op; 16 KiB / 4 warps lost up to 40% on 1 KiB rows.
        block_words = min(_next_power_of_2(row_words), tile_words)
        return CopyConfig(max(1, tile_words // block_words), block_words, num_warps)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class WordRows(NamedTuple):
    """A tensor seen as rows of machine words: ``[*lead, row_words]``, words contiguous."""

    words: torch.Tensor
    word_bytes: int


def _check_rows_contiguous(t: torch.Tensor, lead_dims: int, name: str) -> None:
    expected = 1
    for dim in range(t.dim() - 1, lead_dims - 1, -1):
        if t.shape[dim] != 1 and t.stride(dim) != expected:
            raise ValueError(
                f"{name} must have contiguous rows (dims {lead_dims}.. dense), "
                f"got shape {tuple(t.shape)} strides {t.stride()}"
            )
        expected *= t.shape[dim]


def word_bytes_for(row_bytes: int, tensors: dict[str, torch.Tensor], lead_dims: int) -> int:
    """The widest word that divides the row, every lead stride and every base address."""
    width = math.gcd(row_bytes, _MAX_WORD_BYTES) if row_bytes else _MAX_WORD_BYTES
    for t in tensors.values():
        item = t.element_size()
        width = math.gcd(width, t.data_ptr() % _MAX_WORD_BYTES or _MAX_WORD_BYTES)
        for dim in range(lead_dims):
            if t.shape[dim] > 1:
                width = math.gcd(width, (t.stride(dim) * item) % _MAX_WORD_BYTES or _MAX_WORD_BYTES)
    return width


def as_word_rows(t: torch.Tensor, lead_dims: int, word_bytes: int, name: str) -> WordRows:
    """View ``t`` as ``[*t.shape[:lead_dims], row_words]`` of ``word_bytes``-wide ints.

    The trailing dims must be dense (a row is one run of bytes); the lead dims
    may have any stride. This is a view: writes through it land in ``t``.
    """
    _check_rows_contiguous(t, lead_dims, name)
    lead = tuple(t.shape[:lead_dims])
    row_elems = math.prod(t.shape[lead_dims:])
    rows = t.as_strided((*lead, row_elems), (*t.stride()[:lead_dims], 1))
    if row_elems == 0 or math.prod(lead) == 0:
        row_bytes = row_elems * t.element_size()
        return WordRows(
            torch.empty((*lead, row_bytes // word_bytes), dtype=_WORD_DTYPES[word_bytes],
                        device=t.device),
            word_bytes,
        )
    return WordRows(rows.view(torch.uint8).view(_WORD_DTYPES[word_bytes]), word_bytes)


def check_page_table(page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                     num_pages: int, cache: str) -> None:
    """ValueError unless every length is in [0, width * page_size] and every page a
    request uses (the first ceil(len / page_size) of its row) is one of ``cache``'s
    ``num_pages``. Reads the tensors on the host: for CPU inputs (a CUDA launch leaves
    the check to the caller, as a device read per launch would sync)."""
    max_len = page_table.shape[1] * page_size
    low, high = int(seq_lens.min()), int(seq_lens.max())
    if low < 0 or high > max_len:
        bad = low if low < 0 else high
        raise ValueError(f"seq_lens holds {bad}, outside [0, {max_len}] (page_table width "
                         f"{page_table.shape[1]} x page_size {page_size})")
    pages_used = (seq_lens.to(torch.int64) + page_size - 1) // page_size
    used = torch.arange(page_table.shape[1])[None, :] < pages_used[:, None]
    ids = page_table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise ValueError(f"page_table holds page {bad}, outside the {cache}'s {num_pages} pages")
