"""rerange: ``out[i] = src[index[i]]`` over rows of any dtype and trailing shape.

CP attention all-gathers each rank's rows (padded to the largest rank, so the
gathered tensor is rank-major with padding rows) and must put them back in
request order before attention. The planner builds ``index [T_out]`` (int64)
once per batch; this kernel is the one gather that applies it to K, V or any
other per-token tensor. Rows move as machine words: bit-exact for every dtype
(fp8 carried as uint8 too).

``index`` is checked against ``src`` on CPU. On CUDA the check would cost a
sync, so it is not made: a row whose index is out of range is left unwritten.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.kv_layout import CopyConfig, as_word_rows, word_bytes_for


@triton.jit(do_not_specialize=["num_out", "num_src"])  # vary per call
def _rerange_kernel(
    src_ptr, out_ptr, index_ptr,
    num_out, num_src, row_words, stride_src, stride_out,
    BLOCK_ROWS: tl.constexpr, BLOCK_WORDS: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_w = tl.program_id(1)
    row = pid_r.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    word = pid_w * BLOCK_WORDS + tl.arange(0, BLOCK_WORDS)
    in_out = row < num_out
    src_row = tl.load(index_ptr + row, mask=in_out, other=-1)
    row_ok = in_out & (src_row >= 0) & (src_row < num_src)
    mask = row_ok[:, None] & (word < row_words)[None, :]
    vals = tl.load(src_ptr + src_row[:, None] * stride_src + word[None, :], mask=mask)
    tl.store(out_ptr + row[:, None] * stride_out + word[None, :], vals, mask=mask)


def _check_args(src, index, out) -> torch.Tensor:
    if not isinstance(src, torch.Tensor) or src.dim() < 1:
        raise ValueError(f"src must be a tensor with a row dim, got {src!r:.80}")
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype != torch.int64:
        desc = (tuple(index.shape), index.dtype) if isinstance(index, torch.Tensor) else index
        raise ValueError(f"index must be a 1-D int64 tensor, got {desc}")
    check_same_device(src=src, index=index)
    expected = (index.shape[0], *src.shape[1:])
    if out is None:
        out = torch.empty(expected, dtype=src.dtype, device=src.device)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out has shape {shape}, expected {expected}")
    if out.dtype != src.dtype:
        raise ValueError(f"out.dtype is {out.dtype} but src.dtype is {src.dtype}")
    check_same_device(src=src, out=out)
    if not index.is_cuda and index.numel() > 0:
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= src.shape[0]:
            bad = low if low < 0 else high
            raise ValueError(f"index holds {bad}, outside src's {src.shape[0]} rows")
    return out


def rerange_triton(
    src: torch.Tensor,
    index: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: CopyConfig | None = None,
) -> torch.Tensor:
    """Triton launcher; rows must be dense, the row stride is free."""
    out = _check_args(src, index, out)
    if out.numel() == 0:
        return out
    row_bytes = math.prod(src.shape[1:]) * src.element_size()
    width = word_bytes_for(row_bytes, {"src": src, "out": out}, lead_dims=1)
    src_w = as_word_rows(src, 1, width, "src").words  # [N, row_words]
    out_w = as_word_rows(out, 1, width, "out").words
    row_words = out_w.shape[1]
    cfg = config or CopyConfig.for_rows(row_words)
    grid = (triton.cdiv(out.shape[0], cfg.block_rows), triton.cdiv(row_words, cfg.block_words))
    _rerange_kernel[grid](
        src_w, out_w, index,
        out.shape[0], src.shape[0], row_words, src_w.stride(0), out_w.stride(0),
        BLOCK_ROWS=cfg.block_rows, BLOCK_WORDS=cfg.block_words, num_warps=cfg.num_warps,
    )
    return out


def rerange_ref(
    src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    out = _check_args(src, index, out)
    if out.numel() == 0:
        return out
    # Through uint8 views (a trailing dim of itemsize bytes): index_select has
    # no fp8 kernels, and bytes are what we move.
    src_bytes = src.unsqueeze(-1).view(torch.uint8)
    out.unsqueeze(-1).view(torch.uint8).copy_(src_bytes.index_select(0, index))
    return out


def rerange(
    src: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of ``src`` in the order ``index`` gives: ``out[i] = src[index[i]]``."""
    if use_triton(src):
        return rerange_triton(src, index, out)
    return rerange_ref(src, index, out)
