"""store_kv: write a step's K/V token rows into one layer's caches at physical rows.

``k, v [T, Hkv, D]`` go to ``k_cache[locs[t]]`` / ``v_cache[locs[t]]`` in
place; ``locs [T]`` int64, and ``loc < 0`` skips the row (compute-padding rows
are never written). Locs written in one call must be distinct: two rows aimed
at one cache row race. The caches are ``pool[l, 0]`` / ``pool[l, 1]`` views; any
row stride works as long as one row (``Hkv * D`` values) is dense.

Range checks: on CPU every ``loc`` is checked ``< R`` before anything is
written. On CUDA that check would cost a device sync per layer, so it is not
made; instead the kernel drops rows whose loc is ``>= R`` (no out-of-bounds
write ever happens, but the row is silently lost: callers own their locs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.kv_layout import CopyConfig, as_word_rows, word_bytes_for
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, locs_ptr,
    num_tokens, num_rows, row_words,
    stride_k, stride_v, stride_kc, stride_vc,
    BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    pid_t = tl.program_id(0)
    pid_w = tl.program_id(1)
    tok = pid_t.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    word = pid_w * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    in_tok = tok < num_tokens
    loc = tl.load(locs_ptr + tok, mask=in_tok, other=-1)
    row_ok = in_tok & (loc >= 0) & (loc < num_rows)
    mask = row_ok[:, None] & (word < row_words)[None, :]
    src_k = k_ptr + tok[:, None] * stride_k + word[None, :]
    src_v = v_ptr + tok[:, None] * stride_v + word[None, :]
    dst_k = kc_ptr + loc[:, None] * stride_kc + word[None, :]
    dst_v = vc_ptr + loc[:, None] * stride_vc + word[None, :]
    tl.store(dst_k, tl.load(src_k, mask=mask), mask=mask)
    tl.store(dst_v, tl.load(src_v, mask=mask), mask=mask)


def _check_args(k, v, k_cache, v_cache, locs) -> None:
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 3-D tensor [rows, kv_heads, head_dim], got {shape}")
    if not isinstance(locs, torch.Tensor) or locs.dim() != 1 or locs.dtype != torch.int64:
        desc = (tuple(locs.shape), locs.dtype) if isinstance(locs, torch.Tensor) else locs
        raise ValueError(f"locs must be a 1-D int64 tensor, got {desc}")
    check_same_device(k=k, v=v, k_cache=k_cache, v_cache=v_cache, locs=locs)
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)} but k has {tuple(k.shape)}")
    if locs.shape[0] != k.shape[0]:
        raise ValueError(f"locs has {locs.shape[0]} entries but k has {k.shape[0]} rows")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache has shape {tuple(v_cache.shape)} but k_cache has {tuple(k_cache.shape)}"
        )
    if k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"k_cache rows are {tuple(k_cache.shape[1:])} but k rows are {tuple(k.shape[1:])}"
        )
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != k.dtype:
            raise ValueError(f"{name}.dtype is {t.dtype} but k.dtype is {k.dtype}")
    if not locs.is_cuda and locs.numel() > 0:
        top = int(locs.max())
        if top >= k_cache.shape[0]:
            raise ValueError(f"locs holds {top}, beyond the {k_cache.shape[0]} cache rows")


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    locs: torch.Tensor,
    *,
    config: CopyConfig | None = None,
) -> None:
    """Triton launcher; ``config`` overrides the tile (benchmarks sweep it)."""
    _check_args(k, v, k_cache, v_cache, locs)
    tensors = {"k": k, "v": v, "k_cache": k_cache, "v_cache": v_cache}
    row_bytes = k[0].numel() * k.element_size() if k.shape[0] else 0
    if k.shape[0] == 0 or row_bytes == 0:
        return
    width = word_bytes_for(row_bytes, tensors, lead_dims=1)
    kw, vw, kcw, vcw = (as_word_rows(t, 1, width, name).words for name, t in tensors.items())
    row_words = kw.shape[1]
    cfg = config or CopyConfig.for_rows(row_words)
    grid = (triton.cdiv(k.shape[0], cfg.block_rows), triton.cdiv(row_words, cfg.block_words))
    _store_kv_kernel[grid](
        kw, vw, kcw, vcw, locs,
        k.shape[0], k_cache.shape[0], row_words,
        kw.stride(0), vw.stride(0), kcw.stride(0), vcw.stride(0),
        BLOCK_ROWS=cfg.block_rows, BLOCK_WORDS=cfg.block_words, num_warps=cfg.num_warps,
        **pdl_args(k),
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    locs: torch.Tensor,
) -> None:
    _check_args(k, v, k_cache, v_cache, locs)
    keep = (locs >= 0) & (locs < k_cache.shape[0])
    rows = locs[keep]
    k_cache[rows] = k[keep]
    v_cache[rows] = v[keep]


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    locs: torch.Tensor,
) -> None:
    """Write ``k[t]``/``v[t]`` to cache row ``locs[t]`` for every ``locs[t] >= 0``."""
    if use_triton(k_cache):
        store_kv_triton(k, v, k_cache, v_cache, locs)
    else:
        store_kv_ref(k, v, k_cache, v_cache, locs)
