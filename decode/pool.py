"""The decode side's physical page pool and the per-request page tables.

``PagePool`` owns one pool tensor ``[num_layers, kv, num_pages * page_size,
kv_heads, head_dim]`` (kv = 2 for K/V, 1 for an MLA latent pool; see
``kernels.kv_layout``) and the free list of its
physical pages. A daemon serves many requests at once (transfer threads
allocate while the decode loop frees), so every change of the free list
happens under one lock and is all-or-nothing: a failed call changes nothing.
Pages are reference-counted (``share`` adds a holder, ``free`` drops one): a
prefix cache (``decode.prefix.cache``, the pool's ``keeper``) keeps a cached
page whose last holder left, and gives it back when an allocation is short.

``PageTable`` is one request's view of the pool: its logical pages, in
request order, each mapped to a physical page. This is the decode "remap" of
DESIGN.md: for each logical page the prefill side reports (its own page ids,
in any order and any numbering), one physical page is allocated here and
recorded at the same index, so the transfer client knows where to scatter
each received page and decode attention reads through the table.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from lanekv.kernels.kv_layout import KVCacheSpec
from lanekv.model.attention import pool_rows
from lanekv.model.attention.rows import DEFAULT_INDEX_CACHE_DTYPE, RowLayout

if TYPE_CHECKING:
    from lanekv.model.config import ModelConfig


class PoolExhausted(RuntimeError):
    """Raised by ``PagePool.allocate`` when fewer pages are free than asked for."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"page pool exhausted: needed {needed} pages, {free} free")
        self.needed = needed
        self.free = free


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class PageKeeper(Protocol):
    """What keeps pages nobody holds (a prefix cache); called under the pool's lock."""

    def keep(self, page: int) -> bool:
        """Whether ``page``, whose last holder just left, stays out of the free list."""
        ...

    def evict(self, n: int) -> list[int]:
        """Up to ``n`` kept pages to free now (least recently used first)."""
        ...

    def kept(self) -> int:
        """How many pages it keeps that nobody holds."""
        ...


class PagePool:
    """A physical KV pool and the free list of its pages."""

    def __init__(self, spec: KVCacheSpec, num_pages: int,
                 device: torch.device | str = "cpu", *, rows: RowLayout | None = None) -> None:
        if not isinstance(spec, KVCacheSpec):
            raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
        _check_count("num_pages", num_pages)
        rows = RowLayout.of_spec(spec) if rows is None else rows
        if (spec.kv, spec.kv_heads, spec.head_dim, spec.dtype) != (
                rows.kv, rows.kv_heads, rows.head_dim, rows.dtype):
            raise ValueError(f"rows {rows} need kv={rows.kv} kv_heads={rows.kv_heads} "
                             f"head_dim={rows.head_dim} dtype={rows.dtype}, the spec says "
                             f"kv={spec.kv} kv_heads={spec.kv_heads} head_dim={spec.head_dim} "
                             f"dtype={spec.dtype}")
        self.spec = spec
        self.rows = rows  # what a token's row holds (model.attention.rows; its kind's layout)
        self.tensor = spec.alloc_pool(num_pages, device)  # [L, 2, num_pages * ps, Hkv, D]
        self._num_pages = num_pages
        # Reentrant: the keeper takes it for its own state too (one lock, no order to keep).
        self._lock = threading.RLock()
        self.keeper: PageKeeper | None = None
        self._refs = [0] * num_pages
        # Low page ids first: a fresh pool hands out 0, 1, 2, ... (easy to read in logs).
        self._free_list: deque[int] = deque(range(num_pages))
        self._is_free = [True] * num_pages

    @classmethod
    def for_model(cls, config: ModelConfig, num_pages: int, page_size: int,
                  dtype: torch.dtype, device: torch.device | str = "cpu", *,
                  index_cache_dtype: str = DEFAULT_INDEX_CACHE_DTYPE,
                  kv_cache_dtype: str = "auto") -> PagePool:
        """A pool of ``config``'s rows (its attention kind's; ``dtype`` = the model's);
        a DSA model's rows carry the index-K row of ``index_cache_dtype`` too; with
        ``kv_cache_dtype="fp8_e4m3"`` the rows are FP8 (a uint8 pool)."""
        rows = pool_rows(config, dtype, index_cache_dtype, kv_cache_dtype)
        return cls(rows.spec(config.num_layers, page_size), num_pages, device, rows=rows)

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @property
    def free_count(self) -> int:
        """Pages an allocation can take now: the free list and the pages the keeper
        keeps for nobody (evicted when an allocation needs them)."""
        with self._lock:
            return len(self._free_list) + (0 if self.keeper is None else self.keeper.kept())

    @property
    def used_count(self) -> int:
        return self._num_pages - self.free_count

    @property
    def free_list_count(self) -> int:
        """Pages on the free list (neither held nor kept)."""
        with self._lock:
            return len(self._free_list)

    def refs(self, page: int) -> int:
        with self._lock:
            return self._refs[page]

    def k_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K rows ``[num_pages * ps, Hkv, D]`` (a view)."""
        return self.tensor[layer, 0]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self.tensor[layer, 1]

    def latent_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s MLA latent rows ``[num_pages * ps, kv_lora_rank + qk_rope]`` (a view)."""
        return self.rows.latent(self.tensor[layer, 0, :, 0])

    def index_cache(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s DSA index-K rows ``[num_pages * ps, row_bytes]`` uint8 (a view)."""
        return self.rows.index_rows(self.tensor[layer, 0, :, 0])

    def allocate(self, n: int) -> list[int]:
        """``n`` free physical pages, or ``PoolExhausted`` with nothing taken."""
        _check_count("n", n)
        with self._lock:
            free = len(self._free_list)
            if n > free and self.keeper is not None:
                self._to_free_list(self.keeper.evict(n - free))
                free = len(self._free_list)
            if n > free:
                raise PoolExhausted(needed=n, free=free)
            pages = [self._free_list.popleft() for _ in range(n)]
            for page in pages:
                self._is_free[page] = False
                self._refs[page] = 1
            return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more holder of each page (held, or kept by the keeper)."""
        pages = list(pages)
        with self._lock:
            for page in pages:
                if self._is_free[page]:
                    raise ValueError(f"page {page} is free: it cannot be shared")
            for page in pages:
                self._refs[page] += 1

    def _to_free_list(self, pages: Iterable[int]) -> None:
        for page in pages:
            self._is_free[page] = True
            self._free_list.append(page)

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder of each page; a page nobody holds goes back to the free list
        unless the keeper keeps it. Refuses (changing nothing) a page id out of range,
        a page nobody holds, or one listed twice."""
        pages = list(pages)
        with self._lock:
            seen: set[int] = set()
            for page in pages:
                if isinstance(page, bool) or not isinstance(page, int) or not (
                    0 <= page < self._num_pages
                ):
                    raise ValueError(f"page {page!r} is not a page of this pool "
                                     f"(0..{self._num_pages - 1})")
                if self._is_free[page] or self._refs[page] <= 0 or page in seen:
                    raise ValueError(f"double free of page {page}")
                seen.add(page)
            for page in pages:
                self._refs[page] -= 1
                if self._refs[page] == 0 and (self.keeper is None or not self.keeper.keep(page)):
                    self._to_free_list((page,))


class BatchTables(NamedTuple):
    """What paged decode attention reads for a batch of requests."""

    page_table: torch.Tensor  # [B, max_pages] int32 physical pages, 0 past a request's pages
    seq_lens: torch.Tensor  # [B] int32 tokens in cache per request


class PageTable:
    """One request's logical pages, in order, mapped to physical pages of a pool.

    Logical page ``i`` holds positions ``[i * ps, (i + 1) * ps)``; the table
    owns its physical pages until ``release``. Not locked: a table belongs to
    one request, and its owner (the transfer client, then the decode engine
    under its own lock) is the only one changing it.
    """

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self._pages: list[int] = []
        self._source_pages: list[int] | None = None
        self._seq_len = 0

    @classmethod
    def allocate(cls, pool: PagePool, seq_len: int) -> PageTable:
        """A table holding ``seq_len`` tokens on ``ceil(seq_len / ps)`` fresh pages."""
        _check_count("seq_len", seq_len)
        table = cls(pool)
        table._pages = pool.allocate(-(-seq_len // pool.page_size))
        table._seq_len = seq_len
        return table

    @classmethod
    def remap(cls, pool: PagePool, source_pages: Sequence[int], seq_len: int,
              cached: Sequence[int] = ()) -> PageTable:
        """The decode remap: one fresh physical page per logical page of the
        prefill side (``source_pages``, the request's pages in request order,
        numbered however that side numbers them). The last page may be partial.
        ``cached``: physical pages (held for this table already) holding the first
        logical pages; the table owns those holds from here on."""
        _check_count("seq_len", seq_len)
        source = [_check_count("source_pages[i]", page) for page in source_pages]
        if len(set(source)) != len(source):
            raise ValueError(f"source_pages repeats a page: {source}")
        needed = -(-seq_len // pool.page_size)
        if len(source) != needed:
            raise ValueError(
                f"source_pages has {len(source)} pages but seq_len={seq_len} with "
                f"page_size={pool.page_size} needs {needed}"
            )
        if len(cached) >= needed:
            raise ValueError(f"cached has {len(cached)} pages, the request has {needed}: its last page comes fresh")
        table = cls(pool)
        table._pages = list(cached) + pool.allocate(needed - len(cached))
        table._seq_len = seq_len
        table._source_pages = source
        return table

    @classmethod
    def adopt(cls, pool: PagePool, pages: Sequence[int], seq_len: int) -> PageTable:
        """A table of ``pages`` (held for it already), holding ``seq_len`` tokens."""
        if -(-seq_len // pool.page_size) > len(pages):
            raise ValueError(f"{len(pages)} pages cannot hold seq_len={seq_len}")
        table = cls(pool)
        table._pages = list(pages)
        table._seq_len = seq_len
        return table

    @property
    def pages(self) -> tuple[int, ...]:
        """Physical page of each logical page, in request order."""
        return tuple(self._pages)

    @property
    def source_pages(self) -> tuple[int, ...] | None:
        """The prefill side's page ids this table was remapped from (None otherwise)."""
        return None if self._source_pages is None else tuple(self._source_pages)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    @property
    def capacity(self) -> int:
        """Tokens the held pages can store."""
        return len(self._pages) * self.pool.page_size

    def physical_pages_for(self, source_pages: Iterable[int]) -> list[int]:
        """Where the given prefill-side pages live here (for scattering received pages)."""
        if self._source_pages is None:
            raise ValueError("this table was not built by remap; it has no source pages")
        index = {page: i for i, page in enumerate(self._source_pages)}
        out = []
        for page in source_pages:
            if page not in index:
                raise ValueError(f"source page {page!r} is not a page of this request")
            out.append(self._pages[index[page]])
        return out

    def pages_needed(self, num_tokens: int) -> int:
        """Extra pages needed to hold ``num_tokens`` tokens in all."""
        _check_count("num_tokens", num_tokens)
        return max(0, -(-num_tokens // self.pool.page_size) - len(self._pages))

    def reserve(self, num_tokens: int) -> None:
        """Grow (all-or-nothing) until ``num_tokens`` tokens fit; raises PoolExhausted."""
        extra = self.pages_needed(num_tokens)
        if extra:
            self._pages.extend(self.pool.allocate(extra))

    def append_slot(self) -> int:
        """Make room for one more token (a new page when the last is full) and
        return its physical row. On PoolExhausted nothing changes."""
        self.reserve(self._seq_len + 1)
        loc = self.loc(self._seq_len)
        self._seq_len += 1
        return loc

    def loc(self, position: int) -> int:
        """Physical row of token ``position`` (must be within the held pages)."""
        if isinstance(position, bool) or not isinstance(position, int) or not (
            0 <= position < self.capacity
        ):
            raise ValueError(f"position {position!r} is outside the table's "
                             f"{self.capacity} rows")
        page_size = self.pool.page_size
        return self._pages[position // page_size] * page_size + position % page_size

    def locs_for(self, positions: torch.Tensor | Sequence[int]) -> torch.Tensor:
        """Physical rows ``[n]`` int64 (on the pool's device) of token positions."""
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
        if positions.numel() and (int(positions.min()) < 0
                                  or int(positions.max()) >= self.capacity):
            raise ValueError(f"positions span [{int(positions.min())}, {int(positions.max())}], "
                             f"outside the table's {self.capacity} rows")
        page_size = self.pool.page_size
        pages = torch.tensor(self._pages, dtype=torch.int64)
        locs = pages[positions // page_size] * page_size + positions % page_size
        return locs.to(self.pool.device)

    def release(self) -> int:
        """Give every page back to the pool; returns how many. A second call frees nothing."""
        pages, self._pages = self._pages, []
        self._seq_len = 0
        self.pool.free(pages)
        return len(pages)


def batch_tables(tables: Sequence[PageTable], device: torch.device | str | None = None,
                 min_pages: int = 1) -> BatchTables:
    """The int32 page-table tensor ``[B, max_pages]`` and ``seq_lens [B]`` of a batch.

    Unused entries are 0 (a valid page, never read since ``seq_lens`` bounds
    every row); at least ``min_pages`` columns so the tensor is never empty.
    """
    if not tables:
        raise ValueError("tables must name at least one request")
    device = tables[0].pool.device if device is None else device
    width = max(min_pages, *(t.num_pages for t in tables))
    page_table = torch.zeros((len(tables), width), dtype=torch.int32)
    for row, table in enumerate(tables):
        page_table[row, : table.num_pages] = torch.tensor(table.pages, dtype=torch.int32)
    seq_lens = torch.tensor([t.seq_len for t in tables], dtype=torch.int32)
    return BatchTables(page_table.to(device), seq_lens.to(device))
