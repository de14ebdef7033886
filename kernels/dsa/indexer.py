"""DSA lightning-indexer scores and the top-k key selection.

``score(i, s) = sum_h weights[i, h] * relu(softmax_scale * q[i, h] . k[s])``.

- ``index_scores(q [Tq, H, D], k [Tk, D], weights [Tq, H] f32, q_positions [Tq] int64,
  softmax_scale) -> [Tq, Tk] f32``: prefill, causal: a query at position ``p``
  sees keys ``[0, p]``; the others score ``-inf``. Keys are the request's rows
  in position order (CP ranks pass all gathered keys and their own queries).
- ``paged_index_scores(q [B, H, D], weights [B, H], pool, page_table [B, W] int32,
  seq_lens [B] int32, page_size, softmax_scale, spec) -> [B, W * page_size] f32``:
  decode, against the request's index-K pool rows (``kernels/dsa/index_cache.py``),
  dequantizing fp8 inside; keys at ``t >= seq_lens[b]`` score ``-inf``.
  ``paged_index_keys`` (same arguments) -> ``[B, W * page_size]`` int64: the same
  scores written as ``kernels/dsa/select.py``'s ``first_topk`` keys (``score_key``),
  so the decode selection reads them straight into its top-k.
- ``index_topk(scores [N, T], topk) -> [N, topk] int32``: the positions of the
  ``topk`` best keys per row (all visible keys when fewer), ``-1`` padded.

Ties: ``index_topk`` is ``torch.topk`` on both paths, as transformers selects,
so scores equal bit for bit give the same set. The torch reference of
``index_scores`` computes with transformers' op shapes (batch 1) so that it is
bit-identical with transformers' indexer; the Triton kernels sum in another
order and may swap keys whose scores lie within rounding (near-ties). Exact
ties (several keys at 0 after the relu) resolve as ``torch.topk`` does for the
row it is given, which depends on the row's length; the CUDA decode selection
(``kernels/dsa/select.py``) takes ``first_topk`` instead, whose ties go to the
lowest positions whatever the page table's width.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.dsa.index_cache import IndexCacheSpec, read_index_k_ref
from lanekv.kernels.kv_layout import check_page_table

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_INDEX_HEADS = 128


@triton.jit
def _index_scores_kernel(
    q_ptr, k_ptr, w_ptr, pos_ptr, out_ptr, num_q, num_k, num_heads, scale,
    stride_qt, stride_qh, stride_k, stride_wt, stride_o,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    m_ok = m < num_q
    n_ok = n < num_k
    pos = tl.load(pos_ptr + m, mask=m_ok, other=-1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # A block whose keys all lie after its last query is only masked.
    if tl.program_id(1) * BLOCK_N <= tl.max(pos):
        kt = tl.load(k_ptr + n[:, None] * stride_k + d[None, :],
                     mask=n_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        for h in range(num_heads):
            qh = tl.load(q_ptr + m[:, None] * stride_qt + h * stride_qh + d[None, :],
                         mask=m_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
            s = tl.dot(qh, tl.trans(kt), input_precision=DOT_PRECISION)
            w = tl.load(w_ptr + m * stride_wt + h, mask=m_ok, other=0.0)
            acc += w[:, None] * tl.maximum(s * scale, 0.0)
    visible = n[None, :] <= pos[:, None]
    acc = tl.where(visible, acc, float("-inf"))
    tl.store(out_ptr + m[:, None] * stride_o + n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


class IndexScoreConfig(NamedTuple):
    """Launch knobs of the paged (decode) index scoring kernel; bench/dsa_layer.py sweeps
    them. The defaults are the small-step config of ``default_index_score_config``."""

    block_n: int = 32  # keys per loop step of a program
    programs_per_sm: int = 4  # programs launched per SM over the whole batch (at most one per block)
    num_warps: int = 4
    num_stages: int = 3


# From the sweep of bench/dsa_layer.py on an H200 (V3.2 shapes, bf16 and fp8 rows): 32-key
# blocks with 3 stages were the fastest or tied at every measured step up to 128k keys
# in the batch (batch 1 at 8k and 128k, batch 16 at 8k), while at 2M keys (batch 16 at
# 128k) 64-key blocks with 2 stages were faster still. No config won everywhere, so the
# rule is by shape: the batch's keys (batch * table width) at or above LARGE_STEP_KEYS
# take the large-step config; the boundary lies between the measured 128k and 2M.
LARGE_STEP_KEYS = 1 << 20
LARGE_STEP_CONFIG = IndexScoreConfig(block_n=64, programs_per_sm=4, num_warps=4, num_stages=2)


def default_index_score_config(batch: int, max_len: int) -> IndexScoreConfig:
    """The scoring kernel's launch config for ``batch`` requests over a table of
    ``max_len`` positions (a function of shapes only, so a captured step keeps it)."""
    if batch * max_len >= LARGE_STEP_KEYS:
        return LARGE_STEP_CONFIG
    return IndexScoreConfig()


def index_score_programs(batch: int, max_len: int, num_sms: int,
                         config: IndexScoreConfig) -> int:
    """Programs per request: enough over the batch to fill ``num_sms`` SMs
    ``programs_per_sm`` deep, never more than the request's key blocks. A function
    of shapes only, so a captured step keeps its grid."""
    blocks = triton.cdiv(max_len, config.block_n)
    return max(1, min(blocks, triton.cdiv(num_sms * config.programs_per_sm, max(batch, 1))))


@triton.jit
def score_key(score, t, BLOCK: tl.constexpr):
    """``first_topk``'s int64 key of float32 ``score`` at position ``t``: the float's
    bits made monotonic (``-0.0`` counted as ``0.0``) in the high word, ``2**32 - 1 - t``
    in the low one, so a larger key is a larger score, or the same score earlier."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    low = tl.full([BLOCK], 4294967295, tl.int64) - t.to(tl.int64)  # 2**32 - 1 - t
    return (order << 32) + low


# The page size is a runtime value on purpose: as a constexpr, Triton 3.6 took
# ``page * PAGE_SIZE + t % PAGE_SIZE`` for a multiple of 16 in every lane and
# loaded the fp8 rows (132-byte stride) with 16-byte vector loads: "misaligned
# address" on an H200. The pool's row stride stays specialized, so rows at a
# stride that is a multiple of 16 (the DSA pool's 1296 and 800 bytes) load in
# 16-byte vectors.
#
# Each program loads its request's q and weights once and walks key blocks
# ``pid, pid + P, ...`` up to the request's ``seq_len`` (so any length spreads
# over all P programs, also under a captured step's wide table), then writes
# ``-inf`` over the rest of the table's width. fp8 keys are converted exactly
# to q's dtype (e4m3 values fit fp16/bf16/fp32) and the dot of each scale block
# is multiplied by that block's float32 scale afterwards: the bytes read are the
# row's 128 + 4, and the product is no less exact than dequantizing first.
@triton.jit(do_not_specialize=["stride_tb", "page_size", "max_len"])
def _paged_index_scores_kernel(
    q_ptr, w_ptr, pool_ptr, scale_ptr, table_ptr, lens_ptr, out_ptr,
    num_heads, max_len, scale,
    stride_qb, stride_qh, stride_wb, stride_pool, stride_scale, stride_tb, stride_o, page_size,
    HEAD_DIM: tl.constexpr, QBLOCK: tl.constexpr, FP8: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr, KEYS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid = tl.program_id(1)
    progs = tl.num_programs(1)
    seq_len = tl.minimum(tl.load(lens_ptr + b), max_len)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    h_ok = h < num_heads
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + b * stride_wb + h, mask=h_ok, other=0.0)
    live = tl.cdiv(seq_len, BLOCK_N)
    for blk in tl.range(pid, live, progs, num_stages=NUM_STAGES):
        t = blk * BLOCK_N + n
        t_ok = t < seq_len
        page = tl.load(table_ptr + b * stride_tb + t // page_size, mask=t_ok, other=0)
        row = page.to(tl.int64) * page_size + t % page_size
        raw = tl.load(pool_ptr + row[:, None] * stride_pool + d[None, :],
                      mask=t_ok[:, None] & d_ok[None, :], other=0)
        if FP8:
            k = raw.to(tl.float8e4nv, bitcast=True).to(q.dtype)  # exact
            s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
            for qb in tl.static_range(HEAD_DIM // QBLOCK):
                sc = tl.load(scale_ptr + row * stride_scale + HEAD_DIM // 4 + qb, mask=t_ok,
                             other=0.0)
                if HEAD_DIM == QBLOCK:
                    kb = k
                else:
                    kb = tl.where(((d // QBLOCK) == qb)[None, :], k, 0.0)
                s += tl.dot(q, tl.trans(kb), input_precision=DOT_PRECISION) * sc[None, :]
        else:
            s = tl.dot(q, tl.trans(raw), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        score = tl.where(t_ok, tl.sum(w[:, None] * tl.maximum(s * scale, 0.0), 0), float("-inf"))
        if KEYS:
            tl.store(out_ptr + b * stride_o + t, score_key(score, t, BLOCK_N), mask=t < max_len)
        else:
            tl.store(out_ptr + b * stride_o + t, score, mask=t < max_len)
    hidden = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for blk in range(live + pid, tl.cdiv(max_len, BLOCK_N), progs):
        t = blk * BLOCK_N + n
        if KEYS:
            tl.store(out_ptr + b * stride_o + t, score_key(hidden, t, BLOCK_N), mask=t < max_len)
        else:
            tl.store(out_ptr + b * stride_o + t, hidden, mask=t < max_len)


def _check_scale(softmax_scale) -> None:
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")


def _check_tensor(name, t, dims, dtypes, desc) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dims}-D tensor {desc}, got {shape}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}.dtype must be one of {dtypes}, got {t.dtype}")
    if t.shape[-1] > 1 and t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a dense last dim, got strides {t.stride()}")


def _check_q_w(q, weights, lead: str) -> None:
    _check_tensor("q", q, 3, _DTYPES, f"[{lead}, H, D]")
    _check_tensor("weights", weights, 2, (torch.float32,), f"[{lead}, H]")
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights has shape {tuple(weights.shape)} but q has "
                         f"{tuple(q.shape[:2])} (rows, heads)")
    if not 1 <= q.shape[1] <= MAX_INDEX_HEADS:
        raise ValueError(f"q has {q.shape[1]} index heads, outside [1, {MAX_INDEX_HEADS}]")


def _check_scores_args(q, k, weights, q_positions, softmax_scale) -> None:
    _check_q_w(q, weights, "Tq")
    _check_tensor("k", k, 2, _DTYPES, "[Tk, D]")
    if k.dtype != q.dtype:
        raise ValueError(f"k.dtype is {k.dtype} but q.dtype is {q.dtype}")
    if k.shape[1] != q.shape[2]:
        raise ValueError(f"k rows have {k.shape[1]} values but q heads have {q.shape[2]}")
    if not isinstance(q_positions, torch.Tensor) or q_positions.dim() != 1 or (
        q_positions.dtype != torch.int64
    ) or q_positions.shape[0] != q.shape[0]:
        raise ValueError(f"q_positions must be a 1-D int64 tensor of {q.shape[0]} entries, "
                         f"got {q_positions!r:.80}")
    _check_scale(softmax_scale)
    check_same_device(q=q, k=k, weights=weights, q_positions=q_positions)


def index_scores_triton(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                        q_positions: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    _check_scores_args(q, k, weights, q_positions, softmax_scale)
    out = torch.empty((q.shape[0], k.shape[0]), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    block_m, block_n = 16, 64
    grid = (triton.cdiv(q.shape[0], block_m), triton.cdiv(k.shape[0], block_n))
    _index_scores_kernel[grid](
        q, k, weights, q_positions, out, q.shape[0], k.shape[0], q.shape[1], float(softmax_scale),
        q.stride(0), q.stride(1), k.stride(0), weights.stride(0), out.stride(0),
        HEAD_DIM=q.shape[2], BLOCK_D=max(16, triton.next_power_of_2(q.shape[2])),
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out


def index_scores_ref(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                     q_positions: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Transformers' indexer ops at batch 1: the same matmul shapes, so the same bits."""
    _check_scores_args(q, k, weights, q_positions, softmax_scale)
    scores = torch.matmul(q.float()[None], k.float().T[None, None]) * softmax_scale  # [1,Tq,H,Tk]
    scores = torch.relu(scores)
    out = torch.matmul(weights[None, :, None, :], scores).squeeze(-2)[0]  # [Tq, Tk]
    hidden = torch.arange(k.shape[0], device=k.device)[None, :] > q_positions[:, None]
    return out.masked_fill(hidden, float("-inf"))


def index_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                 q_positions: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Causal index scores of queries at ``q_positions`` against keys ``[0, Tk)``."""
    if use_triton(q):
        return index_scores_triton(q, k, weights, q_positions, softmax_scale)
    return index_scores_ref(q, k, weights, q_positions, softmax_scale)


def _check_paged_args(q, weights, pool, page_table, seq_lens, page_size, softmax_scale,
                      spec) -> None:
    _check_q_w(q, weights, "B")
    if not isinstance(spec, IndexCacheSpec):
        raise ValueError(f"spec must be an IndexCacheSpec, got {type(spec).__name__}")
    if q.shape[2] != spec.head_dim:
        raise ValueError(f"q heads have {q.shape[2]} values but spec.head_dim is {spec.head_dim}")
    if q.dtype != spec.model_dtype:
        raise ValueError(f"q.dtype is {q.dtype} but spec.model_dtype is {spec.model_dtype}")
    if not isinstance(pool, torch.Tensor) or pool.dim() != 2 or pool.dtype != torch.uint8 or (
        pool.shape[1] != spec.row_bytes
    ):
        desc = (tuple(pool.shape), pool.dtype) if isinstance(pool, torch.Tensor) else pool
        raise ValueError(f"pool must be a uint8 tensor [rows, {spec.row_bytes}], got {desc}")
    if pool.stride(1) != 1 or pool.stride(0) % 4 or pool.storage_offset() % 4:
        raise ValueError(f"pool must have dense rows at a 4-byte aligned stride, got strides "
                         f"{pool.stride()}")
    for name, t in (("page_table", page_table), ("seq_lens", seq_lens)):
        dims = 2 if name == "page_table" else 1
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != torch.int32:
            raise ValueError(f"{name} must be a {dims}-D int32 tensor, got {t!r:.80}")
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has {t.shape[0]} rows but q has batch {q.shape[0]}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must have a dense last dim, got strides {page_table.stride()}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0 or (
        pool.shape[0] % page_size
    ):
        raise ValueError(f"page_size must be a positive int dividing the pool's {pool.shape[0]} "
                         f"rows, got {page_size!r}")
    _check_scale(softmax_scale)
    check_same_device(q=q, weights=weights, pool=pool, page_table=page_table, seq_lens=seq_lens)
    if not seq_lens.is_cuda and q.shape[0]:
        check_page_table(page_table, seq_lens, page_size, pool.shape[0] // page_size, "pool")


def _launch_paged(q, weights, pool, page_table, seq_lens, page_size, softmax_scale, spec,
                  config, keys: bool) -> torch.Tensor:
    _check_paged_args(q, weights, pool, page_table, seq_lens, page_size, softmax_scale, spec)
    if config is not None and not isinstance(config, IndexScoreConfig):
        raise ValueError(f"config must be an IndexScoreConfig or None, got {config!r:.80}")
    max_len = page_table.shape[1] * page_size
    cfg = config or default_index_score_config(q.shape[0], max_len)
    if max_len >= 1 << 32:
        raise ValueError(f"page_table spans {max_len} positions, 2**32 or more")
    out = torch.empty((q.shape[0], max_len), dtype=torch.int64 if keys else torch.float32,
                      device=q.device)
    if out.numel() == 0:
        return out
    fp8 = spec.cache_dtype == "fp8_e4m3"
    rows = pool if fp8 else pool.view(spec.model_dtype)
    scales = pool.view(torch.float32)
    num_sms = (torch.cuda.get_device_properties(q.device).multi_processor_count
               if q.is_cuda else 1)  # the interpreter runs programs one by one
    block_n = max(16, triton.next_power_of_2(cfg.block_n))
    progs = index_score_programs(q.shape[0], max_len, num_sms, cfg._replace(block_n=block_n))
    _paged_index_scores_kernel[(q.shape[0], progs)](
        q, weights, rows, scales, page_table, seq_lens, out, q.shape[1], max_len,
        float(softmax_scale), q.stride(0), q.stride(1), weights.stride(0), rows.stride(0),
        scales.stride(0), page_table.stride(0), out.stride(0), page_size,
        HEAD_DIM=spec.head_dim, QBLOCK=spec.block, FP8=fp8,
        BLOCK_H=max(16, triton.next_power_of_2(q.shape[1])),
        BLOCK_D=max(16, triton.next_power_of_2(spec.head_dim)), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_STAGES=cfg.num_stages, KEYS=keys, num_warps=cfg.num_warps,
    )
    return out


def paged_index_scores_triton(q, weights, pool, page_table, seq_lens, page_size: int,
                              softmax_scale: float, spec: IndexCacheSpec, *,
                              config: IndexScoreConfig | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` (bench sweeps) picks the key block, the programs
    per SM and the pipelining, ``None`` the shape's (``default_index_score_config``)."""
    return _launch_paged(q, weights, pool, page_table, seq_lens, page_size, softmax_scale, spec,
                         config, keys=False)


def paged_index_keys_triton(q, weights, pool, page_table, seq_lens, page_size: int,
                            softmax_scale: float, spec: IndexCacheSpec, *,
                            config: IndexScoreConfig | None = None) -> torch.Tensor:
    """``paged_index_scores_triton``'s scores written as ``first_topk``'s int64 keys
    (``score_key``) by the same kernel: the decode selection's first launch."""
    return _launch_paged(q, weights, pool, page_table, seq_lens, page_size, softmax_scale, spec,
                         config, keys=True)


def paged_index_keys_ref(q, weights, pool, page_table, seq_lens, page_size: int,
                         softmax_scale: float, spec: IndexCacheSpec, *,
                         config: IndexScoreConfig | None = None) -> torch.Tensor:
    """``paged_index_scores_ref``'s scores as int64 keys (``config`` has no effect here)."""
    scores = paged_index_scores_ref(q, weights, pool, page_table, seq_lens, page_size,
                                    softmax_scale, spec)
    return score_keys_ref(scores)


def score_keys_ref(scores: torch.Tensor) -> torch.Tensor:
    """``score_key`` of each float32 score of ``[N, T]`` at its column ``t``."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    order = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()  # monotonic in the float
    pos = torch.arange(scores.shape[1], device=scores.device, dtype=torch.int64)
    return order * (1 << 32) + ((1 << 32) - 1 - pos)


def paged_index_keys(q, weights, pool, page_table, seq_lens, page_size: int,
                     softmax_scale: float, spec: IndexCacheSpec) -> torch.Tensor:
    """Each request's new-token index scores as ``first_topk``'s int64 keys."""
    run = paged_index_keys_triton if use_triton(q) else paged_index_keys_ref
    return run(q, weights, pool, page_table, seq_lens, page_size, softmax_scale, spec)


def paged_index_scores_ref(q, weights, pool, page_table, seq_lens, page_size: int,
                           softmax_scale: float, spec: IndexCacheSpec) -> torch.Tensor:
    _check_paged_args(q, weights, pool, page_table, seq_lens, page_size, softmax_scale, spec)
    max_len = page_table.shape[1] * page_size
    out = torch.full((q.shape[0], max_len), float("-inf"), device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        t = torch.arange(seq_len, device=q.device)
        rows = page_table[b, t // page_size].long() * page_size + t % page_size
        k = read_index_k_ref(pool, rows, spec).float()  # [seq_len, D]
        scores = torch.relu(q[b].float() @ k.T * softmax_scale)  # [H, seq_len]
        out[b, :seq_len] = weights[b] @ scores
    return out


def paged_index_scores(q, weights, pool, page_table, seq_lens, page_size: int,
                       softmax_scale: float, spec: IndexCacheSpec) -> torch.Tensor:
    """Each request's new-token index scores against its index-K pages."""
    if use_triton(q):
        return paged_index_scores_triton(q, weights, pool, page_table, seq_lens, page_size,
                                         softmax_scale, spec)
    return paged_index_scores_ref(q, weights, pool, page_table, seq_lens, page_size,
                                  softmax_scale, spec)


def index_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """``[N, T]`` scores -> ``[N, topk]`` int32 key positions, ``-1`` where no key is left."""
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D float32 tensor, got {scores!r:.80}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk <= 0:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    kept = min(topk, scores.shape[1])
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=scores.device)
    if kept == 0 or scores.shape[0] == 0:
        return out
    best = scores.topk(kept, dim=-1)
    out[:, :kept] = best.indices.to(torch.int32).masked_fill(best.values == float("-inf"), -1)
    return out
