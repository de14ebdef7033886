"""Context-parallel prefill attention: the contract, its checks and the torch reference.

One CP rank holds a few query segments per request (the zigzag split gives a
rank a "prev" and a "next" chunk) and, after the all-gather, its requests'
whole K/V. A query at absolute position ``p`` attends the keys at positions
``[0, p]`` of its own request, a cached prefix included.

q and k share the qk head dim, v has its own (DeepSeek MLA decompressed: 192 =
128 nope + 64 rope for q/k, 128 for v); neither needs to be a power of two.

The Triton launcher in ``kernels/prefill/attention.py`` shares these checks;
``cp_prefill_attention_ref`` is the float32 reference it is tested against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from lanekv.kernels.backend import check_same_device
from lanekv.kernels.invariant.attention import blocked_attention

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # qk and v head dims each in [1, MAX_HEAD_DIM]
# Query rows the reference scores at once: bounds its [rows, key block, Hq, D] buffers.
_REF_ROWS_PER_CHUNK = 256


class AttnSegments(NamedTuple):
    """Query segments of one batch; four int32 ``[S]`` tensors on q's device.

    q rows ``[q_start, q_start + q_len)`` sit at positions ``q_pos ..
    q_pos + q_len - 1``. Contiguous K/V: position ``j`` of the segment's
    request is row ``kv_start + j`` of k/v. Paged K/V: ``kv_start`` is the
    row of ``page_table`` that maps the request's pages.
    """

    q_start: torch.Tensor
    q_len: torch.Tensor
    q_pos: torch.Tensor
    kv_start: torch.Tensor


class AttnOutput(NamedTuple):
    out: torch.Tensor  # [Tq, Hq, Dv], q's dtype
    lse: torch.Tensor  # [Tq, Hq] float32, natural log


def _check_rows_tensor(name: str, t: object, device: torch.device, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be [rows, heads, head_dim], got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} differs from q dtype {dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")


def out_shape(q: torch.Tensor, v: torch.Tensor) -> torch.Size:
    """``[Tq, Hq, Dv]``: q's rows and heads, v's head dim."""
    return torch.Size((q.shape[0], q.shape[1], v.shape[2]))


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> None:
    """q, k, v and the scale: types, dtypes, devices, shapes (no tensor data read)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {SUPPORTED_DTYPES}")
    _check_rows_tensor("q", q, q.device, q.dtype)
    _check_rows_tensor("k", k, q.device, q.dtype)
    _check_rows_tensor("v", v, q.device, q.dtype)
    head_dim, v_head_dim = q.shape[2], v.shape[2]
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head_dim {head_dim} must be in [1, {MAX_HEAD_DIM}]")
    if not 1 <= v_head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"v head_dim {v_head_dim} must be in [1, {MAX_HEAD_DIM}]")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"v shape {tuple(v.shape)} differs from k shape {tuple(k.shape)} "
                         "in rows or heads")
    if k.shape[2] != head_dim:
        raise ValueError(f"k head_dim {k.shape[2]} differs from q head_dim {head_dim}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} must be a multiple of k heads {k.shape[1]}")
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale}")


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    page_table: torch.Tensor | None,
    page_size: int,
    out: torch.Tensor | None,
    return_lse: bool,
    lse_out: torch.Tensor | None,
) -> None:
    """Layout checks that read no tensor data (no device sync)."""
    check_qkv(q, k, v, softmax_scale)
    if not isinstance(segments, AttnSegments):
        raise TypeError(f"segments must be an AttnSegments, got {type(segments).__name__}")
    num_segments = None
    for field, t in zip(AttnSegments._fields, segments, strict=True):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32:
            desc = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"segments.{field} must be a 1-D int32 tensor, got {desc}")
        num_segments = t.shape[0] if num_segments is None else num_segments
        if t.shape[0] != num_segments:
            raise ValueError(f"segments.{field} has {t.shape[0]} entries, segments.q_start has {num_segments}")
    check_same_device(q=q, **dict(zip(AttnSegments._fields, segments, strict=True)))
    if page_table is None:
        if page_size != 0:
            raise ValueError(f"page_size {page_size} given without a page_table")
    else:
        if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2:
            raise ValueError("page_table must be a 2-D [batch, max_pages] tensor")
        if page_table.dtype != torch.int32:
            raise ValueError(f"page_table dtype {page_table.dtype} must be torch.int32")
        check_same_device(q=q, page_table=page_table)
        if page_table.shape[1] > 1 and page_table.stride(1) != 1:
            raise ValueError(f"page_table needs a contiguous last dim, got strides {page_table.stride()}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1 with a page_table, got {page_size}")
    if out is not None:
        _check_rows_tensor("out", out, q.device, q.dtype)
        if out.shape != out_shape(q, v):
            raise ValueError(f"out shape {tuple(out.shape)} must be [Tq, Hq, Dv] = "
                             f"{tuple(out_shape(q, v))}")
    if lse_out is not None:
        if not return_lse:
            raise ValueError("lse_out given but return_lse is False")
        if not isinstance(lse_out, torch.Tensor) or lse_out.shape != q.shape[:2]:
            shape = tuple(lse_out.shape) if isinstance(lse_out, torch.Tensor) else None
            raise ValueError(f"lse_out shape {shape} must be {tuple(q.shape[:2])}")
        if lse_out.dtype != torch.float32:
            raise ValueError(f"lse_out dtype {lse_out.dtype} must be torch.float32")
        check_same_device(q=q, lse_out=lse_out)


def check_segment_bounds(
    q: torch.Tensor,
    k: torch.Tensor,
    segments: AttnSegments,
    page_table: torch.Tensor | None,
    page_size: int,
) -> None:
    """Data-dependent checks: every row a segment names exists, rows are disjoint.

    Reads the segment tensors (and the used page ids), so on CUDA it syncs.
    """
    q_start, q_len, q_pos, kv_start = (t.to("cpu", torch.int64) for t in segments)
    for name, t in (("q_start", q_start), ("q_len", q_len), ("q_pos", q_pos), ("kv_start", kv_start)):
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"segments.{name} has a negative entry {int(t.min())}")
    if q_len.numel() == 0:
        return
    q_end = q_start + q_len
    if int(q_end.max()) > q.shape[0]:
        raise ValueError(f"segments.q_start + q_len reaches row {int(q_end.max())} of q with {q.shape[0]} rows")
    # Disjoint query rows keep the launcher's upper-bound grid large enough.
    used = q_len > 0
    starts, order = torch.sort(q_start[used])
    ends = q_end[used][order]
    if starts.numel() > 1 and bool((ends[:-1] > starts[1:]).any()):
        raise ValueError("segments.q_start/q_len: query rows of two segments overlap")
    if not bool(used.any()):
        return
    kv_start, kv_len = kv_start[used], (q_pos + q_len)[used]  # kv_len: keys of the last row
    if page_table is None:
        if int((kv_start + kv_len).max()) > k.shape[0]:
            raise ValueError(f"segments.kv_start + q_pos + q_len passes the {k.shape[0]} rows of k")
        return
    if int(kv_start.max()) >= page_table.shape[0]:
        raise ValueError(f"segments.kv_start {int(kv_start.max())} >= page_table rows {page_table.shape[0]}")
    pages_needed = (kv_len + page_size - 1) // page_size
    if int(pages_needed.max()) > page_table.shape[1]:
        raise ValueError(f"segment needs {int(pages_needed.max())} pages, page_table has {page_table.shape[1]} columns")
    table = page_table.to("cpu", torch.int64)[kv_start]  # [S, max_pages]
    needed = torch.arange(table.shape[1])[None, :] < pages_needed[:, None]
    ids = table[needed]
    num_pages = k.shape[0] // page_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_pages):
        raise ValueError(f"page_table holds page id out of [0, {num_pages}) for k with {k.shape[0]} rows")


def _key_rows(kv_start: int, kv_len: int, page_table: torch.Tensor | None, page_size: int) -> torch.Tensor:
    device = page_table.device if page_table is not None else "cpu"
    pos = torch.arange(kv_len, device=device)
    if page_table is None:
        return kv_start + pos
    pages = page_table[kv_start, pos // page_size].to(torch.int64)
    return pages * page_size + pos % page_size


def cp_prefill_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    *,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor | AttnOutput:
    """Plain torch, float32 math, one segment at a time (``blocked_attention``: a query's
    result does not depend on the segment or the batch around it); always checks bounds."""
    del validate  # the reference reads the segments on the host anyway
    check_attention_args(q, k, v, segments, softmax_scale, page_table, page_size, out, return_lse, lse_out)
    check_segment_bounds(q, k, segments, page_table, page_size)
    if out is None:
        out = q.new_empty(out_shape(q, v))
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else q.new_empty(q.shape[:2], dtype=torch.float32)
    for q_start, q_len, q_pos, kv_start in zip(*(t.tolist() for t in segments), strict=True):
        if q_len == 0:
            continue
        rows = _key_rows(kv_start, q_pos + q_len, page_table, page_size).to(k.device)
        keys, values = k[rows], v[rows]  # [L, Hkv, D]: the request's keys [0, q_pos + q_len)
        for lo in range(0, q_len, _REF_ROWS_PER_CHUNK):
            hi = min(q_len, lo + _REF_ROWS_PER_CHUNK)
            # each query's bits independent of the segment around it (kernels/invariant)
            seg_out, seg_lse = blocked_attention(
                q[q_start + lo : q_start + hi], keys, values,
                q_pos + torch.arange(lo, hi, device=q.device), softmax_scale)
            out[q_start + lo : q_start + hi] = seg_out
            if lse is not None:
                lse[q_start + lo : q_start + hi] = seg_lse
    return AttnOutput(out, lse) if return_lse else out
