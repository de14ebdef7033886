"""kv_digest of a buffer, and page_digest: the same digest of pages read in place from a pool.

The digest of the buffer ``gather_pages(pool, pages, page_size, layer_start,
layer_end)`` would hold, without building that buffer: each program reads one
chunk of one page of one layer's K (or V) as 4-byte words, weights each word
by its position in the gathered buffer and writes one int64 partial sum;
the partials are summed on the device. Integer sums wrap and commute, so the
result equals ``kv_digest`` of the gathered buffer bit for bit, on any device.

One pass over the pages at memory speed (the torch reference gathers, then
makes three int64 temporaries): the fast path takes a digest of every layer
on both sides, so this is what keeps its integrity check cheap.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, on_device, use_triton
from lanekv.kernels.kv_layout import check_pool_tensor
from lanekv.kernels.page_copy import gather_pages, gather_pages_ref

# The position weight of kv_digest, odd, as a signed int64.
DIGEST_WEIGHT = 0x9E3779B97F4A7C15 - (1 << 64)
_U64 = (1 << 64) - 1
_BLOCK = 1024
# Words per step of kv_digest: bounds its int64 temporaries.
_DIGEST_BLOCK = 1 << 24


def kv_digest(t: torch.Tensor, position: int = 0) -> int:
    """A 64-bit digest of a contiguous tensor's bytes: sum of word[i] * w(position + i) mod 2^64.

    ``w(i)`` is odd and depends on the position, so any one changed word, and
    words that swapped places, change the digest. Integer sums wrap and
    commute, so the value does not depend on the device or the summation
    order: the prefill rank and the decode daemon get the same number, and
    the digests of the parts of a buffer (each from its ``position``, in
    words) add up to the digest of the whole.
    """
    if not t.is_contiguous():
        raise ValueError("kv_digest needs a contiguous tensor")
    flat = t.reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    words = flat.view(torch.int32) if nbytes % 4 == 0 else flat.view(torch.int16) if nbytes % 2 == 0 else flat
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _DIGEST_BLOCK):
        part = words[start:start + _DIGEST_BLOCK].to(torch.int64)
        weights = torch.arange(position + start, position + start + part.numel(), dtype=torch.int64,
                               device=t.device)
        weights.mul_(DIGEST_WEIGHT).bitwise_or_(1)
        total += (part * weights).sum()
    return int(total.item()) & _U64


@triton.jit(do_not_specialize=["layer_start", "lkv_base", "num_slots"])  # vary per call
def _page_digest_kernel(
    pool_ptr, pages_ptr, out_ptr,
    num_pool_pages, page_words, chunks_per_page, layer_start, lkv_base, num_slots,
    stride_pool_layer, stride_pool_kv, weight,
    BLOCK: tl.constexpr, KV: tl.constexpr,
):
    pid = tl.program_id(0)  # (index in pages) * chunks_per_page + chunk
    lkv = tl.program_id(1)  # (layer - layer_start) * KV + plane (0 for K, 1 for V)
    slot = pid // chunks_per_page
    chunk = pid % chunks_per_page
    layer = (lkv // KV).to(tl.int64)
    kv = (lkv % KV).to(tl.int64)
    page = tl.load(pages_ptr + slot).to(tl.int64)
    word = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bound = tl.where((page >= 0) & (page < num_pool_pages), page_words, 0)
    mask = word < bound
    src = (layer + layer_start) * stride_pool_layer + kv * stride_pool_kv + page * page_words + word
    values = tl.load(pool_ptr + src, mask=mask, other=0).to(tl.int64)
    # Where the word sits in the gathered buffer [layers, KV, pages, page_words].
    position = ((lkv + lkv_base).to(tl.int64) * num_slots + slot) * page_words + word
    weights = (position * weight) | 1
    partial = tl.sum(tl.where(mask, values * weights, 0), axis=0)
    tl.store(out_ptr + lkv.to(tl.int64) * num_slots * chunks_per_page + pid, partial)


def _check(pool, pages, page_size, layer_start, layer_end) -> int:
    num_pages = check_pool_tensor(pool, page_size, "pool")
    if not isinstance(pages, torch.Tensor) or pages.dim() != 1 or pages.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pages must be a 1-D int32/int64 tensor, got {pages!r:.80}")
    if not 0 <= layer_start < layer_end <= pool.shape[0]:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside the pool's {pool.shape[0]} layers")
    check_same_device(pool=pool, pages=pages)
    return num_pages


def _first(layer_start: int, first_layer: int | None) -> int:
    """The layer the digested buffer starts at (``first_layer``, by default ``layer_start``)."""
    if first_layer is None:
        return layer_start
    if not (isinstance(first_layer, int) and 0 <= first_layer <= layer_start):
        raise ValueError(f"first_layer must be an integer in [0, layer_start={layer_start}], got {first_layer!r}")
    return first_layer


def page_digest_triton(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                       layer_end: int, first_layer: int | None = None) -> torch.Tensor:
    """0-dim int64 on the pool's device: the digest as a signed 64-bit integer.

    ``first_layer`` (default ``layer_start``): the digest is of these layers'
    part of the buffer that would start at that layer, so the digests of
    consecutive layer ranges with one ``first_layer`` add up to the digest of
    all of them.
    """
    digest = PageDigest(pool, pages, page_size, layer_start, layer_end, first_layer=first_layer, kernel=True)
    digest.add(layer_start, layer_end)
    return digest.total()


def page_digest_ref(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                    layer_end: int, first_layer: int | None = None) -> torch.Tensor:
    _check(pool, pages, page_size, layer_start, layer_end)
    first = _first(layer_start, first_layer)
    position = 0
    if first != layer_start:
        row_bytes = pool.shape[3] * pool.shape[4] * pool.element_size()
        if row_bytes % 4:
            raise ValueError(f"first_layer needs rows of whole 4-byte words, got rows of {row_bytes} bytes")
        position = pool.shape[1] * (layer_start - first) * pages.shape[0] * page_size * row_bytes // 4
    value = kv_digest(gather_pages_ref(pool, pages, page_size, layer_start, layer_end), position)
    return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64, device=pool.device)


def page_digest(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                layer_end: int, first_layer: int | None = None) -> torch.Tensor:
    digest = PageDigest(pool, pages, page_size, layer_start, layer_end, first_layer=first_layer)
    digest.add(layer_start, layer_end)
    return digest.total()


class PageDigest:
    """``page_digest`` of one range of layers, added up a group of layers at a time.

    Each ``add(first, last)`` queues the digest of those layers (on the
    current stream), as parts of the buffer that starts at ``first_layer``
    (default ``layer_start``); ``total()`` is the sum of what was added
    (0-dim int64 on the pool's device), ``total(first, last)`` that of the
    groups added within ``[first, last)``. With ``first_layer=0`` every layer
    is digested at its place in the whole pool's layers, so any range's
    digest is the sum of its layers' digests. The Triton path checks the
    arguments once and writes every group's partial sums into one buffer, so
    a group costs one launch. ``kernel``: None picks it where the kernel
    applies (``use_triton``, a contiguous pool with rows of whole 4-byte
    words), else the torch reference; True requires it.
    """

    def __init__(self, pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                 layer_end: int, *, first_layer: int | None = None, kernel: bool | None = None) -> None:
        self._num_pages = _check(pool, pages, page_size, layer_start, layer_end)
        self._first_layer = _first(layer_start, first_layer)
        self._pool, self._pages, self._page_size = pool, pages, page_size
        self._start, self._end = layer_start, layer_end
        row_bytes = pool.shape[3] * pool.shape[4] * pool.element_size()
        fits = row_bytes % 4 == 0 and pool.is_contiguous()
        if kernel and not fits:
            raise ValueError(f"page_digest_triton needs a contiguous pool with rows of whole 4-byte words, "
                             f"got rows of {row_bytes} bytes")
        self._triton = fits and (use_triton(pool) if kernel is None else kernel)
        self._parts: list[tuple[int, int, torch.Tensor]] = []
        if self._triton:
            self._words = pool.view(torch.uint8).view(torch.int32).view(*pool.shape[:3], -1)
            self._page_words = page_size * self._words.shape[3]
            self._chunks = triton.cdiv(self._page_words, _BLOCK)
            self._per_layer = pool.shape[1] * pages.shape[0] * self._chunks
            self._partials = torch.zeros((layer_end - layer_start) * self._per_layer, dtype=torch.int64,
                                         device=pool.device)

    def add(self, first: int, last: int) -> None:
        if not self._start <= first < last <= self._end:
            raise ValueError(f"layers [{first}, {last}) are not within [{self._start}, {self._end})")
        if not self._triton:
            self._parts.append((first, last, page_digest_ref(self._pool, self._pages, self._page_size, first, last,
                                                             first_layer=self._first_layer)))
            return
        if self._pages.shape[0] == 0:
            return
        out = self._partials[(first - self._start) * self._per_layer:]
        # The launch, and the sum in total(), on the current stream of the pool's device.
        with on_device(self._pool.device):
            kv = self._pool.shape[1]
            _page_digest_kernel[(self._pages.shape[0] * self._chunks, (last - first) * kv)](
                self._words, self._pages, out,
                self._num_pages, self._page_words, self._chunks, first, kv * (first - self._first_layer),
                self._pages.shape[0], self._words.stride(0), self._words.stride(1), DIGEST_WEIGHT,
                BLOCK=_BLOCK, KV=kv, num_warps=4,
            )

    def total(self, first: int | None = None, last: int | None = None) -> torch.Tensor:
        first = self._start if first is None else first
        last = self._end if last is None else last
        if not self._start <= first < last <= self._end:
            raise ValueError(f"layers [{first}, {last}) are not within [{self._start}, {self._end})")
        if self._triton:
            with on_device(self._pool.device):
                return self._partials[(first - self._start) * self._per_layer:
                                      (last - self._start) * self._per_layer].sum()
        parts = []
        for a, b, part in self._parts:
            if first <= a and b <= last:
                parts.append(part)
            elif a < last and first < b:
                raise ValueError(f"layers [{a}, {b}) were added as one group: no total of [{first}, {last})")
        if not parts:
            return torch.zeros((), dtype=torch.int64, device=self._pool.device)
        return torch.stack(parts).sum()


def head_slice_digest(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                      layer_end: int, heads: slice) -> int:
    """``page_digest(..., first_layer=0)`` of a pool that held only KV heads ``heads`` of
    each row: what a TP decode rank's pool of those heads digests after the copy.

    The pages are gathered (wire order, on the pool's device), the heads cut out and
    made contiguous, and ``kv_digest`` weighs each word by its place in that smaller
    buffer among all layers. It lives here, among the contract's sources, because
    it is part of the transfer's meaning: two builds that digest a head slice
    differently refuse each other at the handshake. One gather and int64
    temporaries more than ``page_digest`` (a kernel reading the slice in place
    would spare them; not built yet).
    """
    # [layers, planes, len(pages) * page_size, heads, head_dim]
    sliced = gather_pages(pool, pages, page_size, layer_start, layer_end)[:, :, :, heads].contiguous()
    row_bytes = sliced.shape[3] * sliced.shape[4] * sliced.element_size()
    if row_bytes % 4:
        raise ValueError(f"heads [{heads.start}, {heads.stop}) make rows of {row_bytes} bytes, "
                         "not whole 4-byte words")
    position = sliced.shape[1] * layer_start * sliced.shape[2] * row_bytes // 4
    return kv_digest(sliced, position) if sliced.numel() else 0
