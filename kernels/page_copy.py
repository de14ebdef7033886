"""gather_pages / scatter_pages: move whole pages between a pool and a wire buffer.

The wire buffer is ``[layer_end - layer_start, kv, len(pages) * page_size,
kv_heads, head_dim]`` (``kv`` as the pool's: 2 for K/V, 1 for an MLA latent
pool): layer, then K/V, then the pages in the order given,
then their rows. ``gather_pages`` fills it from a pool; ``scatter_pages`` puts
it into any list of pages of any pool with the same row shape and dtype (the
receiver's page order and pool size are its own).

Bytes move as machine words, so every dtype (fp8 as uint8 too) round-trips
bit for bit. A page of one layer's K (or V) is one dense run of
``page_size * row_bytes`` bytes in both tensors, so each program copies one
flat chunk of one page: wide, coalesced loads whatever the page size.

Page ids are checked against the pool on CPU. On CUDA the check would cost a
sync, so the kernel instead skips out-of-range ids (that part of the buffer,
or of the pool, is left as it was). Pages given to ``scatter_pages`` must be
distinct (checked on CPU): two writers to one page race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.kv_layout import CopyConfig, as_word_rows, check_pool_tensor, word_bytes_for


@triton.jit(do_not_specialize=["layer_start"])  # varies per call
def _page_copy_kernel(
    pool_ptr, buf_ptr, pages_ptr,
    num_pool_pages, page_words, chunks_per_page, layer_start,
    stride_pool_layer, stride_pool_kv, stride_buf_layer, stride_buf_kv,
    BLOCK: tl.constexpr, TO_POOL: tl.constexpr, KV: tl.constexpr,
):
    pid = tl.program_id(0)  # (index in pages) * chunks_per_page + chunk
    lkv = tl.program_id(1)  # (layer - layer_start) * KV + plane (0 for K, 1 for V)
    slot = pid // chunks_per_page
    chunk = pid % chunks_per_page
    layer = (lkv // KV).to(tl.int64)
    kv = (lkv % KV).to(tl.int64)
    page = tl.load(pages_ptr + slot).to(tl.int64)
    word = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # An out-of-range page id moves nothing (a bound of 0 masks the whole chunk).
    bound = tl.where((page >= 0) & (page < num_pool_pages), page_words, 0)
    mask = word < bound
    pool_off = (
        (layer + layer_start) * stride_pool_layer + kv * stride_pool_kv + page * page_words + word
    )
    buf_off = layer * stride_buf_layer + kv * stride_buf_kv + slot.to(tl.int64) * page_words + word
    if TO_POOL:
        tl.store(pool_ptr + pool_off, tl.load(buf_ptr + buf_off, mask=mask), mask=mask)
    else:
        tl.store(buf_ptr + buf_off, tl.load(pool_ptr + pool_off, mask=mask), mask=mask)


def _check_common(pool, pages, page_size, layer_start, layer_end, *, distinct: bool) -> int:
    num_pages = check_pool_tensor(pool, page_size, "pool")
    if not isinstance(pages, torch.Tensor) or pages.dim() != 1 or pages.dtype not in (
        torch.int32,
        torch.int64,
    ):
        desc = (tuple(pages.shape), pages.dtype) if isinstance(pages, torch.Tensor) else pages
        raise ValueError(f"pages must be a 1-D int32/int64 tensor, got {desc}")
    for name, value in (("layer_start", layer_start), ("layer_end", layer_end)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 0 <= layer_start <= layer_end <= pool.shape[0]:
        raise ValueError(
            f"layer range [{layer_start}, {layer_end}) is not inside the pool's "
            f"{pool.shape[0]} layers"
        )
    check_same_device(pool=pool, pages=pages)
    if not pages.is_cuda and pages.numel() > 0:
        low, high = int(pages.min()), int(pages.max())
        if low < 0 or high >= num_pages:
            bad = low if low < 0 else high
            raise ValueError(f"pages holds {bad}, outside the pool's {num_pages} pages")
        if distinct and torch.unique(pages).numel() != pages.numel():
            raise ValueError("pages holds a page twice; scatter targets must be distinct")
    return num_pages


def _buf_shape(pool, pages, page_size, layer_start, layer_end) -> tuple[int, ...]:
    rows = pages.shape[0] * page_size
    return (layer_end - layer_start, pool.shape[1], rows, pool.shape[3], pool.shape[4])


def _check_buf(buf, pool, expected, name: str) -> None:
    if not isinstance(buf, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if tuple(buf.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(buf.shape)}, expected {expected}")
    if buf.dtype != pool.dtype:
        raise ValueError(f"{name}.dtype is {buf.dtype} but pool.dtype is {pool.dtype}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {buf.stride()}")
    check_same_device(pool=pool, **{name: buf})


def _launch(pool, buf, pages, page_size, layer_start, num_pool_pages, to_pool, config) -> None:
    num_layers = buf.shape[0]
    if num_layers == 0 or pages.shape[0] == 0 or buf.numel() == 0:
        return
    row_bytes = pool.shape[3] * pool.shape[4] * pool.element_size()
    width = word_bytes_for(row_bytes, {"pool": pool, "buf": buf}, lead_dims=3)
    pool_w = as_word_rows(pool, 3, width, "pool").words  # [L, 2, R, row_words]
    buf_w = as_word_rows(buf, 3, width, "buf").words
    page_words = page_size * pool_w.shape[3]
    cfg = config or CopyConfig.for_rows(page_words)
    block = cfg.block_rows * cfg.block_words
    chunks = triton.cdiv(page_words, block)
    grid = (pages.shape[0] * chunks, num_layers * pool.shape[1])
    _page_copy_kernel[grid](
        pool_w, buf_w, pages,
        num_pool_pages, page_words, chunks, layer_start,
        pool_w.stride(0), pool_w.stride(1), buf_w.stride(0), buf_w.stride(1),
        BLOCK=block, TO_POOL=to_pool, KV=pool.shape[1], num_warps=cfg.num_warps,
    )


def gather_pages_triton(
    pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    layer_start: int,
    layer_end: int,
    out: torch.Tensor | None = None,
    *,
    config: CopyConfig | None = None,
) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the tile (benchmarks sweep it)."""
    num_pool_pages = _check_common(pool, pages, page_size, layer_start, layer_end, distinct=False)
    expected = _buf_shape(pool, pages, page_size, layer_start, layer_end)
    if out is None:
        out = torch.empty(expected, dtype=pool.dtype, device=pool.device)
    _check_buf(out, pool, expected, "out")
    _launch(pool, out, pages, page_size, layer_start, num_pool_pages, False, config)
    return out


def scatter_pages_triton(
    buf: torch.Tensor,
    pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    layer_start: int,
    layer_end: int,
    *,
    config: CopyConfig | None = None,
) -> None:
    """Triton launcher; ``config`` overrides the tile (benchmarks sweep it)."""
    num_pool_pages = _check_common(pool, pages, page_size, layer_start, layer_end, distinct=True)
    _check_buf(buf, pool, _buf_shape(pool, pages, page_size, layer_start, layer_end), "buf")
    _launch(pool, buf, pages, page_size, layer_start, num_pool_pages, True, config)


def _page_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    offsets = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    return (pages.to(torch.int64)[:, None] * page_size + offsets).reshape(-1)


def gather_pages_ref(
    pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    layer_start: int,
    layer_end: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_common(pool, pages, page_size, layer_start, layer_end, distinct=False)
    expected = _buf_shape(pool, pages, page_size, layer_start, layer_end)
    if out is None:
        out = torch.empty(expected, dtype=pool.dtype, device=pool.device)
    _check_buf(out, pool, expected, "out")
    # Through uint8 views: index_select has no fp8 kernels, and bytes are what we move.
    rows = _page_rows(pages, page_size)
    picked = pool.view(torch.uint8)[layer_start:layer_end].index_select(2, rows)
    out.view(torch.uint8).copy_(picked)
    return out


def scatter_pages_ref(
    buf: torch.Tensor,
    pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    layer_start: int,
    layer_end: int,
) -> None:
    _check_common(pool, pages, page_size, layer_start, layer_end, distinct=True)
    _check_buf(buf, pool, _buf_shape(pool, pages, page_size, layer_start, layer_end), "buf")
    rows = _page_rows(pages, page_size)
    pool.view(torch.uint8)[layer_start:layer_end].index_copy_(2, rows, buf.view(torch.uint8))


def gather_pages(
    pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    layer_start: int,
    layer_end: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy ``pages`` of layers ``[layer_start, layer_end)`` into the wire order."""
    if use_triton(pool):
        return gather_pages_triton(pool, pages, page_size, layer_start, layer_end, out)
    return gather_pages_ref(pool, pages, page_size, layer_start, layer_end, out)


def scatter_pages(
    buf: torch.Tensor,
    pool: torch.Tensor,
    pages: torch.Tensor,
    page_size: int,
    layer_start: int,
    layer_end: int,
) -> None:
    """Write a wire buffer into ``pages`` of ``pool`` (the inverse of gather_pages)."""
    if use_triton(pool):
        scatter_pages_triton(buf, pool, pages, page_size, layer_start, layer_end)
    else:
        scatter_pages_ref(buf, pool, pages, page_size, layer_start, layer_end)
