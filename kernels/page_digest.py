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

import contextlib

import torch
import triton
import triton.language as tl

from kernels.backend import check_same_device, use_triton
from kernels.kv_layout import check_pool_tensor
from kernels.page_copy import gather_pages_ref

# The position weight of kv_digest, odd, as a signed int64.
DIGEST_WEIGHT = 0x9E3779B97F4A7C15 - (1 << 64)
_U64 = (1 << 64) - 1
_BLOCK = 1024
# Words per step of kv_digest: bounds its int64 temporaries.
_DIGEST_BLOCK = 1 << 24


def kv_digest(t: torch.Tensor) -> int:
    """A 64-bit digest of a contiguous tensor's bytes: sum of word[i] * w(i) mod 2^64.

    ``w(i)`` is odd and depends on the position, so any one changed word, and
    words that swapped places, change the digest. Integer sums wrap and
    commute, so the value does not depend on the device or the summation
    order: the prefill rank and the decode daemon get the same number.
    """
    if not t.is_contiguous():
        raise ValueError("kv_digest needs a contiguous tensor")
    flat = t.reshape(-1).view(torch.uint8)
    nbytes = flat.numel()
    words = flat.view(torch.int32) if nbytes % 4 == 0 else flat.view(torch.int16) if nbytes % 2 == 0 else flat
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _DIGEST_BLOCK):
        part = words[start:start + _DIGEST_BLOCK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=t.device)
        weights.mul_(DIGEST_WEIGHT).bitwise_or_(1)
        total += (part * weights).sum()
    return int(total.item()) & _U64


@triton.jit
def _page_digest_kernel(
    pool_ptr, pages_ptr, out_ptr,
    num_pool_pages, page_words, chunks_per_page, layer_start, num_slots,
    stride_pool_layer, stride_pool_kv, weight,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)  # (index in pages) * chunks_per_page + chunk
    lkv = tl.program_id(1)  # (layer - layer_start) * 2 + (0 for K, 1 for V)
    slot = pid // chunks_per_page
    chunk = pid % chunks_per_page
    layer = (lkv // 2).to(tl.int64)
    kv = (lkv % 2).to(tl.int64)
    page = tl.load(pages_ptr + slot).to(tl.int64)
    word = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bound = tl.where((page >= 0) & (page < num_pool_pages), page_words, 0)
    mask = word < bound
    src = (layer + layer_start) * stride_pool_layer + kv * stride_pool_kv + page * page_words + word
    values = tl.load(pool_ptr + src, mask=mask, other=0).to(tl.int64)
    # Where the word sits in the gathered buffer [layers, 2, pages, page_words].
    position = (lkv.to(tl.int64) * num_slots + slot) * page_words + word
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


def page_digest_triton(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                       layer_end: int) -> torch.Tensor:
    """0-dim int64 on the pool's device: the digest as a signed 64-bit integer."""
    num_pages = _check(pool, pages, page_size, layer_start, layer_end)
    row_bytes = pool.shape[3] * pool.shape[4] * pool.element_size()
    if row_bytes % 4 or not pool.is_contiguous():
        raise ValueError(f"page_digest_triton needs a contiguous pool with rows of whole 4-byte words, "
                         f"got rows of {row_bytes} bytes")
    words = pool.view(torch.uint8).view(torch.int32).view(*pool.shape[:3], -1)
    page_words = page_size * words.shape[3]
    chunks = triton.cdiv(page_words, _BLOCK)
    layers = layer_end - layer_start
    partials = torch.empty(layers * 2 * pages.shape[0] * chunks, dtype=torch.int64, device=pool.device)
    if pages.shape[0] == 0:
        return partials.sum()
    grid = (pages.shape[0] * chunks, layers * 2)
    # The launch and the sum below on one stream: the current one of the pool's device.
    with torch.cuda.device(pool.device) if pool.is_cuda else contextlib.nullcontext():
        _page_digest_kernel[grid](
            words, pages, partials,
            num_pages, page_words, chunks, layer_start, pages.shape[0],
            words.stride(0), words.stride(1), DIGEST_WEIGHT,
            BLOCK=_BLOCK, num_warps=4,
        )
        return partials.sum()


def page_digest_ref(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                    layer_end: int) -> torch.Tensor:
    _check(pool, pages, page_size, layer_start, layer_end)
    value = kv_digest(gather_pages_ref(pool, pages, page_size, layer_start, layer_end))
    return torch.tensor(value - (1 << 64) if value >= 1 << 63 else value, dtype=torch.int64, device=pool.device)


def page_digest(pool: torch.Tensor, pages: torch.Tensor, page_size: int, layer_start: int,
                layer_end: int) -> torch.Tensor:
    row_bytes = pool.shape[3] * pool.shape[4] * pool.element_size() if pool.dim() == 5 else 0
    if use_triton(pool) and row_bytes % 4 == 0 and pool.is_contiguous():
        return page_digest_triton(pool, pages, page_size, layer_start, layer_end)
    return page_digest_ref(pool, pages, page_size, layer_start, layer_end)
