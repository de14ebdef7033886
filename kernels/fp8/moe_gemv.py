"""The block-FP8 experts of one decode token on the CUDA cores: ``moe_experts_fp8_gemv``.

At batch 1 the decode experts' tensor-core kernels (``moe_decode.py``) multiply a
single row in 16-row tiles: on an H200 V2-Lite's e4m3 experts ran well under the copy
rate, no faster than the bf16 experts that read twice the bytes (BENCHMARKS.md, tenth
session). A GEMV's k loop is the weight's loads and one FMA per byte, as the dense
layers' ``gemm_gemv.py`` streams them, so the single token's experts take that form:

1. ``_gate_up_gemv_kernel``: a program per (slot, ``BLOCK_N`` columns of the expert
   width), a slot being one of the token's ``k`` routed choices (its expert read from
   ``ids`` on the device) or one routed-width slice of the shared expert. Per scale
   group of the hidden size it loads the gate and up rows' ``[BLOCK_N, GROUP_K]`` e4m3
   tiles, converts them to float32, multiplies them by x and sums over K, times the
   group's scale (one per tile: ``BLOCK_N`` divides ``GROUP_N``); then ``silu(gate) *
   up`` rounded as ``silu_mul`` rounds it, stored in x's dtype as ``h [k + S, I]``.
2. ``_down_gemv_kernel``: a program per (slot, ``BLOCK_N`` hidden columns), the same
   loop over ``h``'s scale groups against the down rows; a routed slot's sum times its
   routing weight, each rounded to x's dtype as the reference rounds a pair's output.
3. ``_decode_combine_kernel`` of ``kernels.moe.decode`` adds the slots' rows (the
   layout of the tensor-core path: the routed pairs, then the shared slices).

Three launches, as the tensor-core path; no split-K (352 and 512 programs at V2-Lite
shapes fill 132 SMs), no atomics, nothing read on the host, so a step captures.
Shapes: one token, every dimension whole scale groups (``gemv_fits``), which the
DeepSeek and Qwen3 FP8 checkpoints' 128 x 128 blocks give; the caller
(``moe_experts_fp8_decode``) takes the tensor-core path otherwise, and for every
batch when ``LANEKV_FP8_MOE_GEMV=0``. On by default since the H200 timed it
(BENCHMARKS.md, eleventh session): V2-Lite's one-token experts 29.9 us against 46.9 on
the tensor cores at the default tiles (32 columns a program, 8 warps; the sweep's best);
the FP8 step at batch 1 2.27 ms against 2.56 at 4 warps in one run, 2.12 at 8 in the next.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import env_choice
from lanekv.kernels.fp8.quant import silu_mul_tile
from lanekv.kernels.moe.decode import _decode_combine_kernel
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

GEMV_ENV = "LANEKV_FP8_MOE_GEMV"  # 0: one-token FP8 expert steps stay on the tensor cores


class MoEGemvTiles(NamedTuple):
    """Launch knobs: output columns per program of each kernel, warps of both."""

    block_n_up: int = 32
    block_n_down: int = 32
    num_warps: int = 8


DEFAULT_TILES = MoEGemvTiles()


def gemv_requested() -> bool:
    """``LANEKV_FP8_MOE_GEMV`` read strictly: unset, empty or ``1`` on, ``0`` off."""
    return env_choice(GEMV_ENV, ("0", "1"), "1") == "1"


def gemv_fits(tokens: int, inter: int, hidden: int, block: tuple[int, int],
              tiles: MoEGemvTiles = DEFAULT_TILES) -> bool:
    """One token, the expert width and the hidden size whole scale groups along both
    GEMMs, each program's columns inside one scale block."""
    group_n, group_k = block
    return (tokens == 1 and inter % group_n == 0 and inter % group_k == 0
            and hidden % group_n == 0 and hidden % group_k == 0
            and group_n % tiles.block_n_up == 0 and group_n % tiles.block_n_down == 0)


@triton.jit
def _rows_sum(w_rows, k, x):
    """``[BLOCK_N]`` float32 sums over K of the e4m3 rows at ``w_rows`` times ``x``."""
    return tl.sum(tl.load(w_rows[:, None] + k[None, :]).to(tl.float32) * x[None, :], axis=1)


@triton.jit
def _gate_up_sums(x_ptr, w, s, gate_row, up_row, stride_w, stride_s, hidden,
                  GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gate and up rows' ``[BLOCK_N]`` float32 products with x, from their first
    rows ``gate_row`` and ``up_row`` of the matrix at ``w`` (scales at ``s``)."""
    r = tl.arange(0, BLOCK_N).to(tl.int64)
    gate_rows = w + (gate_row + r) * stride_w
    up_rows = w + (up_row + r) * stride_w
    gate_s = s + (gate_row // GROUP_N).to(tl.int64) * stride_s
    up_s = s + (up_row // GROUP_N).to(tl.int64) * stride_s
    kk = tl.arange(0, GROUP_K)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, hidden // GROUP_K):
        k = g * GROUP_K + kk
        xk = tl.load(x_ptr + k).to(tl.float32)
        acc_g += _rows_sum(gate_rows, k, xk) * tl.load(gate_s + g)
        acc_u += _rows_sum(up_rows, k, xk) * tl.load(up_s + g)
    return acc_g, acc_u


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, w13_ptr, s13_ptr, sw13_ptr, ss13_ptr, ids_ptr, h_ptr, inter, hidden,
    stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    slot = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_N  # first column, inside one scale block (BLOCK_N | GROUP_N)
    if slot < TOP_K:  # a routed choice: its expert's gate rows, then its up rows
        e = tl.load(ids_ptr + slot).to(tl.int64)
        acc_g, acc_u = _gate_up_sums(x_ptr, w13_ptr + e * stride_we, s13_ptr + e * stride_se,
                                     col, inter + col, stride_wn, stride_sn, hidden,
                                     GROUP_N, GROUP_K, BLOCK_N)
    else:  # a slice of the shared expert: rows of its gate half, then of its up half
        first = (slot - TOP_K) * inter + col
        acc_g, acc_u = _gate_up_sums(x_ptr, sw13_ptr, ss13_ptr, first, SHARED * inter + first,
                                     stride_swn, stride_ssn, hidden, GROUP_N, GROUP_K, BLOCK_N)
    dtype = h_ptr.dtype.element_ty
    n = col + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + slot.to(tl.int64) * inter + n, silu_mul_tile(acc_g.to(dtype), acc_u.to(dtype)))


@triton.jit
def _down_sums(h_row, w, s, col, stride_w, stride_s, inter,
               GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows ``col ..`` of the down matrix at ``w`` (scales at ``s``) times the slot's h."""
    rows = w + (col + tl.arange(0, BLOCK_N).to(tl.int64)) * stride_w
    s_row = s + (col // GROUP_N).to(tl.int64) * stride_s
    kk = tl.arange(0, GROUP_K)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for g in range(0, inter // GROUP_K):
        k = g * GROUP_K + kk
        acc += _rows_sum(rows, k, tl.load(h_row + k).to(tl.float32)) * tl.load(s_row + g)
    return acc


@triton.jit
def _down_gemv_kernel(
    h_ptr, w2_ptr, s2_ptr, sw2_ptr, ss2_ptr, ids_ptr, weights_ptr, y_ptr, inter, hidden,
    stride_we, stride_wn, stride_se, stride_sn, stride_swn, stride_ssn,
    TOP_K: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    slot = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_N
    h_row = h_ptr + slot.to(tl.int64) * inter
    dtype = y_ptr.dtype.element_ty
    if slot < TOP_K:  # a pair's output rounded, then times its weight (the reference's order)
        e = tl.load(ids_ptr + slot).to(tl.int64)
        acc = _down_sums(h_row, w2_ptr + e * stride_we, s2_ptr + e * stride_se, col, stride_wn,
                         stride_sn, inter, GROUP_N, GROUP_K, BLOCK_N)
        y = acc.to(dtype).to(tl.float32) * tl.load(weights_ptr + slot)
    else:  # the shared expert's down columns of this slice
        first = (slot - TOP_K) * inter
        acc = _down_sums(h_row, sw2_ptr + first, ss2_ptr + first // GROUP_K, col, stride_swn,
                         stride_ssn, inter, GROUP_N, GROUP_K, BLOCK_N)
        y = acc
    n = col + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + slot.to(tl.int64) * hidden + n, y.to(dtype))


def moe_experts_fp8_gemv(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                         w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                         ids: torch.Tensor, block: tuple[int, int], *,
                         shared: tuple[torch.Tensor, ...] | None = None,
                         tiles: MoEGemvTiles = DEFAULT_TILES) -> torch.Tensor:
    """Triton launcher on checked inputs (``moe_experts_fp8_decode``'s checks and
    ``gemv_fits``): one token's routed experts and shared slices, ``[1, hidden]``."""
    hidden, inter, top_k = x.shape[1], w13.shape[1] // 2, ids.shape[1]
    sw13, ss13, sw2, ss2 = shared if shared is not None else (w13, s13, w2, s2)  # unread without
    slices = 0 if shared is None else sw2.shape[1] // inter
    slots = top_k + slices
    ids = ids.contiguous()
    x = x.contiguous()
    h = x.new_empty((slots, inter))
    _gate_up_gemv_kernel[(slots, inter // tiles.block_n_up)](
        x, w13, s13, sw13, ss13, ids, h, inter, hidden,
        w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), sw13.stride(-2),
        ss13.stride(-2), TOP_K=top_k, SHARED=slices, GROUP_N=block[0], GROUP_K=block[1],
        BLOCK_N=tiles.block_n_up, num_warps=tiles.num_warps, num_stages=1, **pdl_args(x),
    )
    y = x.new_empty((slots, hidden))
    _down_gemv_kernel[(slots, hidden // tiles.block_n_down)](
        h, w2, s2, sw2, ss2, ids, weights.contiguous(), y, inter, hidden,
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), sw2.stride(-2), ss2.stride(-2),
        TOP_K=top_k, GROUP_N=block[0], GROUP_K=block[1], BLOCK_N=tiles.block_n_down,
        num_warps=tiles.num_warps, num_stages=1, **pdl_args(x),
    )
    out = torch.empty_like(x)
    combine = min(1024, max(16, triton.next_power_of_2(hidden)))
    _decode_combine_kernel[(1, triton.cdiv(hidden, combine))](
        y, out, 1, hidden, y.stride(0), out.stride(0), TOP_K=top_k, SHARED=slices,
        BLOCK=combine, **pdl_args(y),
    )
    return out
