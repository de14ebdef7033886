"""The CUDA-core split-K GEMV of a block-FP8 linear: decode's 1 to 4 rows.

``gemv_linear(x, weight, weight_scale_inv, block, bias, config)``: ``out [M, N] =
x @ (w * w_scale)^T + bias`` for ``x [M, K]`` in its own dtype (``M <=
GEMV_MAX_ROWS``; no activation quantization), ``w [N, K]`` e4m3 with one float32
scale per ``GROUP_N x GROUP_K`` block: the w8a16 family's operation (the
reference's own: ``F.linear`` of the unquantized x on the dequantized weight), on the
CUDA cores. A 1-row GEMM in a 16-row tensor-core tile computes fifteen empty rows
and spends its k loop converting and staging tiles for a mostly empty dot; a GEMV's
k loop is the weight's loads and one FMA per byte, so it can stream at the copy rate.

Each program owns ``BLOCK_N`` output columns and one k slice of whole scale groups
(``SPLIT_K`` slices, ``tile_order.tile_coords``' order). Per scale group it loads
``[BLOCK_N, BLOCK_K]`` e4m3 tiles (K contiguous: 16-byte vector loads along K),
converts them to float32, multiplies them by each row's x chunk (every row in the
same program: the weight is read once), sums over K into a float32 ``[BLOCK_N]``
per row, and adds that sum times the group's weight scale (a scalar when the tile
lies inside one scale block, else one per column) to the row's float32 total. Only
the last, ragged scale group of a K that is not a multiple of ``GROUP_K`` masks its
loads; the others load unmasked vectors. With ``num_stages > 1`` (``PREFETCH``; the
k step then one scale group) the next group's weight tile is loaded before this
group's FMAs run, a register double buffer, so two tiles a program are in flight. Split-K writes float32 partials ``[SPLIT_K,
M, N]``; the last split of each column tile to finish adds them in split order with
the bias (``kernels.arrivals``: one counter a tile, the sum deterministic), or, where no
counters can be had, ``_gemv_reduce_kernel`` does in a launch of its own, the same sums
in the same order, as the tensor-core GEMMs' reduction does.

``silu=True`` (the down projection of a gated MLP): ``x`` is the gate/up GEMM's
output ``[M, 2K]`` (gate half, then up half) and each chunk is ``silu(gate) * up``
computed in registers with ``quant.silu_mul_tile`` (rounded to x's dtype as
``silu_mul`` rounds it), so the result is bit for bit that of ``silu_mul`` then
this GEMV, one launch fewer.

Compiled offline for sm_90 (``bench/fp8_gemm_compile.py --gemv``, Triton 3.9): the
weight comes in 16-byte vector loads, the k loop is loads, conversions, FFMAs and the
K reduction's shuffles (no tensor-core instruction), and nothing spills from 16 to 128
columns, 2 to 8 warps, 1 to 4 rows, with or without the fused SiLU. Triton does not
software-pipeline a k loop without a dot (with the prefetch off, stages 1 to 4 compile
to the same kernel), hence the prefetch by hand: the bytes in flight per thread are
one or two tiles' (``BLOCK_N * BLOCK_K / threads`` each), and more come from more
resident programs (``SPLIT_K``). The carried e4m3 tile is not free: held across the
loop's back edge its bytes are permuted apart and together again (PRMT), which makes
the k loop longer and takes more registers; the sweep times that trade.

Which shapes run it is the tuned table's choice (``gemm_configs.py``); ``fp8_linear``
and ``silu_mul_fp8_linear`` (``gemm.py``) call ``gemv_linear`` when the config says
``gemv``.

The same kernel runs an unscaled 16-bit weight (``weight_scale_inv=None``: ``SCALED``
off, the k step ``config.block_k`` elements, no scale read): ``dense_linear`` sends a bf16
linear there where ``gemm_configs.DENSE_GEMV_TABLE`` names its shape (decode's one row on
an H200, where it beat cuBLAS: ``bench/dense_gemv.py``), and to ``F.linear`` otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.arrivals import arrived_last, counters, reset
from lanekv.kernels.backend import check_same_device, on_device
from lanekv.kernels.fp8.gemm_configs import (
    GEMV_MAX_ROWS,
    GemmConfig,
    check_config,
    dense_gemv_config,
)
from lanekv.kernels.fp8.quant import silu_mul_tile
from lanekv.kernels.fp8.tile_order import tile_coords
from lanekv.kernels.fp8.weights import FP8_DTYPE, scale_shape
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _x_chunk(row_ptr, k, k_ok, depth, SILU: tl.constexpr, MASK: tl.constexpr):
    """One row's activations at ``k`` as float32 ``[BLOCK_K]`` (with ``SILU``:
    ``silu(gate) * up`` of a gate/up row, up ``depth`` values after gate)."""
    if MASK:
        v = tl.load(row_ptr + k, mask=k_ok, other=0.0)
        if SILU:
            v = silu_mul_tile(v, tl.load(row_ptr + depth + k, mask=k_ok, other=0.0))
    else:
        v = tl.load(row_ptr + k)
        if SILU:
            v = silu_mul_tile(v, tl.load(row_ptr + depth + k))
    return v.to(tl.float32)


@triton.jit
def _tile_sums(w, x_ptr, stride_x, k, k_ok, depth, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
               SILU: tl.constexpr, MASK: tl.constexpr):
    """Each row's ``[BLOCK_N]`` float32 sum over K of the float32 weight tile ``w
    [BLOCK_N, BLOCK_K]`` at ``k`` times the row's x there (rows past ``ROWS``: zeros,
    never used)."""
    s0 = tl.sum(w * _x_chunk(x_ptr, k, k_ok, depth, SILU, MASK)[None, :], axis=1)
    s1 = tl.zeros([BLOCK_N], tl.float32)
    s2 = tl.zeros([BLOCK_N], tl.float32)
    s3 = tl.zeros([BLOCK_N], tl.float32)
    if ROWS > 1:
        s1 = tl.sum(w * _x_chunk(x_ptr + stride_x, k, k_ok, depth, SILU, MASK)[None, :], axis=1)
    if ROWS > 2:
        s2 = tl.sum(w * _x_chunk(x_ptr + 2 * stride_x, k, k_ok, depth, SILU, MASK)[None, :],
                    axis=1)
    if ROWS > 3:
        s3 = tl.sum(w * _x_chunk(x_ptr + 3 * stride_x, k, k_ok, depth, SILU, MASK)[None, :],
                    axis=1)
    return s0, s1, s2, s3


@triton.jit
def _group_sums(x_ptr, stride_x, w_rows, k0, depth, ROWS: tl.constexpr, GROUP_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU: tl.constexpr,
                MASK: tl.constexpr):
    """Each row's ``[BLOCK_N]`` float32 sum of weight times x over the scale group at
    ``k0``, in ``GROUP_K // BLOCK_K`` tiles."""
    kk = tl.arange(0, BLOCK_K)
    s0 = tl.zeros([BLOCK_N], tl.float32)
    s1 = tl.zeros([BLOCK_N], tl.float32)
    s2 = tl.zeros([BLOCK_N], tl.float32)
    s3 = tl.zeros([BLOCK_N], tl.float32)
    for step in tl.static_range(GROUP_K // BLOCK_K):
        k = k0 + step * BLOCK_K + kk
        k_ok = k < depth
        if MASK:
            w = tl.load(w_rows[:, None] + k[None, :], mask=k_ok[None, :], other=0.0)
        else:
            w = tl.load(w_rows[:, None] + k[None, :])
        t0, t1, t2, t3 = _tile_sums(w.to(tl.float32), x_ptr, stride_x, k, k_ok, depth, ROWS,
                                    BLOCK_N, SILU, MASK)
        s0 += t0
        s1 += t1
        s2 += t2
        s3 += t3
    return s0, s1, s2, s3


@triton.jit
def _scaled_add(acc0, acc1, acc2, acc3, s0, s1, s2, s3, ws_row, ws_cols, g,
                SCALED: tl.constexpr, SCALAR_WS: tl.constexpr):
    """Each row's total plus its scale group ``g``'s sum times the group's weight scale
    (one a tile, or one a column; an unscaled weight: the sum itself)."""
    if SCALED:
        if SCALAR_WS:
            w_s = tl.load(ws_row + g)
        else:
            w_s = tl.load(ws_cols + g)
        return acc0 + s0 * w_s, acc1 + s1 * w_s, acc2 + s2 * w_s, acc3 + s3 * w_s
    return acc0 + s0, acc1 + s1, acc2 + s2, acc3 + s3


@triton.jit
def _finish_row(acc, row, split, n, n_ok, bias, out_ptr, part_ptr, cols, stride_out,
                ROWS: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    if SPLIT_K > 1:  # float32 partials; the reduction adds the bias and casts
        tl.store(part_ptr + (split.to(tl.int64) * ROWS + row) * cols + n, acc, mask=n_ok)
    else:
        if HAS_BIAS:
            acc += bias
        tl.store(out_ptr + row * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, cols, depth,
    stride_x, stride_w, stride_ws, stride_out,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, SILU: tl.constexpr,
    PREFETCH: tl.constexpr, LAST_REDUCES: tl.constexpr, SCALED: tl.constexpr = True,
    USE_PDL: tl.constexpr = False,
):
    """``BLOCK_N`` columns of every row over one k slice of whole scale groups (an
    unscaled 16-bit weight: ``GROUP_K`` is the k step, and no scale is read)."""
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    _, pid_n, split, g_lo, g_hi = tile_coords(tl.program_id(0), ROWS, cols, depth, ROWS,
                                              BLOCK_N, GROUP_K, 1, SPLIT_K)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < cols
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)  # loads clamped, stores masked
    w_rows = w_ptr + n_safe * stride_w
    SCALAR_WS: tl.constexpr = GROUP_N % BLOCK_N == 0  # the tile inside one scale block
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // GROUP_N).to(tl.int64) * stride_ws
    ws_cols = ws_ptr + (n_safe // GROUP_N) * stride_ws
    acc0 = tl.zeros([BLOCK_N], tl.float32)
    acc1 = tl.zeros([BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_N], tl.float32)
    full = depth // GROUP_K  # scale groups wholly inside K: unmasked loads
    g_end = tl.minimum(g_hi, full)
    if PREFETCH:  # the slice's first tile here; each step then loads the next group's
        kk = tl.arange(0, BLOCK_K)
        # (a splatted scalar condition: uniform along K, the loads stay 16-byte vectors)
        zero_k = tl.zeros([BLOCK_K], tl.int32)
        w_next = tl.load(w_rows[:, None] + (g_lo * GROUP_K + kk)[None, :],
                         mask=(zero_k + g_lo < g_end)[None, :], other=0.0)
    for g in range(g_lo, g_end):
        if PREFETCH:  # one tile a group (BLOCK_K == GROUP_K): a register double buffer
            w = w_next.to(tl.float32)
            w_next = tl.load(w_rows[:, None] + ((g + 1) * GROUP_K + kk)[None, :],
                             mask=(zero_k + g + 1 < g_end)[None, :], other=0.0)
            k = g * GROUP_K + kk
            s0, s1, s2, s3 = _tile_sums(w, x_ptr, stride_x, k, k < depth, depth, ROWS, BLOCK_N,
                                        SILU, False)
        else:
            s0, s1, s2, s3 = _group_sums(x_ptr, stride_x, w_rows, g * GROUP_K, depth, ROWS,
                                         GROUP_K, BLOCK_N, BLOCK_K, SILU, False)
        acc0, acc1, acc2, acc3 = _scaled_add(acc0, acc1, acc2, acc3, s0, s1, s2, s3, ws_row,
                                              ws_cols, g, SCALED, SCALAR_WS)
    if (full >= g_lo) & (full < g_hi):  # this slice holds the ragged last group
        s0, s1, s2, s3 = _group_sums(x_ptr, stride_x, w_rows, full * GROUP_K, depth, ROWS,
                                     GROUP_K, BLOCK_N, BLOCK_K, SILU, True)
        acc0, acc1, acc2, acc3 = _scaled_add(acc0, acc1, acc2, acc3, s0, s1, s2, s3, ws_row,
                                              ws_cols, full, SCALED, SCALAR_WS)

    bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    _finish_row(acc0, 0, split, n, n_ok, bias, out_ptr, part_ptr, cols, stride_out, ROWS,
                SPLIT_K, HAS_BIAS)
    if ROWS > 1:
        _finish_row(acc1, 1, split, n, n_ok, bias, out_ptr, part_ptr, cols, stride_out, ROWS,
                    SPLIT_K, HAS_BIAS)
    if ROWS > 2:
        _finish_row(acc2, 2, split, n, n_ok, bias, out_ptr, part_ptr, cols, stride_out, ROWS,
                    SPLIT_K, HAS_BIAS)
    if ROWS > 3:
        _finish_row(acc3, 3, split, n, n_ok, bias, out_ptr, part_ptr, cols, stride_out, ROWS,
                    SPLIT_K, HAS_BIAS)
    if LAST_REDUCES:  # the column tile's last split adds the partials (kernels.arrivals)
        if arrived_last(count_ptr, pid_n, SPLIT_K):
            for row in tl.static_range(ROWS):
                _reduce_row(part_ptr, bias_ptr, out_ptr, row, n, n_ok, cols, stride_out,
                            ROWS, SPLIT_K, HAS_BIAS)
            reset(count_ptr, pid_n)


@triton.jit
def _reduce_row(part_ptr, bias_ptr, out_ptr, row, n, ok, cols, stride_out, ROWS: tl.constexpr,
                SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    """``out[row, n] = sum(partials[:, row, n]) + bias[n]`` in float32, the splits in
    order. The loads pass L1 by (``.cg``): in the last split, other SMs wrote the partials;
    each value is read once either way."""
    acc = tl.zeros(n.shape, tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * ROWS + row) * cols + n, mask=ok, other=0.0,
                       cache_modifier=".cg")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gemv_reduce_kernel(part_ptr, bias_ptr, out_ptr, cols, stride_out, ROWS: tl.constexpr,
                        SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                        USE_PDL: tl.constexpr = False):
    """``out[row] = sum(partials[:, row]) + bias`` in float32, the splits in order."""
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(1)
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _reduce_row(part_ptr, bias_ptr, out_ptr, row.to(tl.int64), n, n < cols, cols, stride_out,
                ROWS, SPLIT_K, HAS_BIAS)


def _check(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None,
           block: tuple[int, int], bias: torch.Tensor | None, config: GemmConfig,
           silu: bool) -> None:
    if not isinstance(config, GemmConfig) or not check_config(config).gemv:
        raise ValueError(f"config must be a GemmConfig with gemv=True, got {config!r}")
    name = "gate_up" if silu else "x"
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be a 2-D tensor of one of {_DTYPES}, got "
                         f"{getattr(x, 'dtype', x)} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[0] > GEMV_MAX_ROWS:
        raise ValueError(f"rows={x.shape[0]}: config.gemv=True ({config.name()}) takes at most "
                         f"{GEMV_MAX_ROWS} rows")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must be dense along its last dim, got strides {x.stride()}")
    if silu and x.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2 * I], got {tuple(x.shape)}")
    depth = x.shape[1] // 2 if silu else x.shape[1]
    want = FP8_DTYPE if weight_scale_inv is not None else x.dtype
    if not isinstance(weight, torch.Tensor) or weight.dtype != want or weight.dim() != 2 or (
            weight.shape[1] != depth or weight.stride(1) != 1):
        raise ValueError(f"weight must be a dense {want} [N, {depth}], got "
                         f"{getattr(weight, 'dtype', weight)} {tuple(getattr(weight, 'shape', ()))}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if weight_scale_inv is None:  # a 16-bit weight in x's dtype: no scales, no block
        check_same_device(x=x, weight=weight, bias=bias)
        return
    expected = scale_shape(tuple(weight.shape), block)
    if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != expected or (
            weight_scale_inv.stride(-1) != 1):
        raise ValueError(f"weight_scale_inv must be dense float32 {expected}, got "
                         f"{weight_scale_inv.dtype} {tuple(weight_scale_inv.shape)}")
    if block[1] % config.block_k:
        raise ValueError(f"config.block_k={config.block_k} must divide block_k={block[1]}")
    if config.num_stages > 1 and config.block_k != block[1]:
        raise ValueError(f"config.num_stages={config.num_stages} prefetches the next scale "
                         f"group's tile: it needs config.block_k={config.block_k} to equal "
                         f"block_k={block[1]}")
    check_same_device(x=x, weight=weight, weight_scale_inv=weight_scale_inv, bias=bias)


# Registers a thread of a GEMV with the last split's reduction may take, by warps a
# program, where ptxas would take more than the kernel without it: 8 warps went from 32
# to 46 registers (Triton 3.6, sm_90), 8 resident programs an SM to 5, and Llama-3-8B's
# gate/up GEMV from 32.7 to 39.7 us on an H200; compiled at 32 it spills nothing
# (``bench/fp8_gemm_compile.py``). 2 and 4 warps kept their counts.
LAST_REDUCE_REGISTERS = {8: 32}


def _register_cap(config: GemmConfig, last_reduces: bool) -> dict:
    cap = LAST_REDUCE_REGISTERS.get(config.num_warps) if last_reduces else None
    return {} if cap is None else {"maxnreg": cap}


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor | None,
                block: tuple[int, int] | None, bias: torch.Tensor | None, config: GemmConfig, *,
                silu: bool = False, last_reduces: bool = True) -> torch.Tensor:
    """``x [M, K]`` (``silu``: ``gate_up [M, 2K]``), ``M <= GEMV_MAX_ROWS`` -> ``[M, N]``
    in x's dtype, with the gemv ``config``'s tiles. Split-K partials are added by each
    column tile's last split (``kernels.arrivals``) where counters can be had, else (and
    with ``last_reduces=False``) by a launch of their own; the result is the same.
    ``weight_scale_inv=None`` (and ``block=None``): ``weight`` is a 16-bit ``[N, K]`` in
    x's dtype, unscaled, read in k steps of ``config.block_k`` (``dense_linear``)."""
    scaled = weight_scale_inv is not None
    block = (int(block[0]), int(block[1])) if scaled else (config.block_n, config.block_k)
    _check(x, weight, weight_scale_inv, block, bias, config, silu)
    rows, cols = x.shape[0], weight.shape[0]
    depth = weight.shape[1]
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    if rows == 0 or cols == 0:
        return out
    if depth == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    split = min(config.split_k, triton.cdiv(depth, block[1]))
    part = (torch.empty((split, rows, cols), dtype=torch.float32, device=x.device)
            if split > 1 else out)
    ws_arg = weight_scale_inv if scaled else out  # unread without scales
    bias_arg = bias if bias is not None else ws_arg  # unread without a bias
    tiles = triton.cdiv(cols, config.block_n)
    count = counters(x.device, tiles) if split > 1 and last_reduces else None
    with on_device(x.device):
        _gemv_kernel[(tiles * split,)](
            x, weight, ws_arg, bias_arg, out, part,
            count if count is not None else part, cols, depth, x.stride(0),
            weight.stride(0), ws_arg.stride(0), out.stride(0),
            GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None, ROWS=rows,
            BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, SILU=silu,
            PREFETCH=config.num_stages > 1, LAST_REDUCES=count is not None, SCALED=scaled,
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(x),
            **_register_cap(config, count is not None and x.is_cuda),
        )
        if split > 1 and count is None:
            reduce_block = min(1024, triton.next_power_of_2(cols))
            _gemv_reduce_kernel[(triton.cdiv(cols, reduce_block), rows)](
                part, bias_arg, out, cols, out.stride(0), ROWS=rows, SPLIT_K=split,
                HAS_BIAS=bias is not None, BLOCK=reduce_block, num_warps=4, **pdl_args(x))
    return out


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 silu: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` of a 16-bit weight (``silu``: of ``silu(gate) * up``
    for ``x = gate_up [M, 2K]``), through the GEMV where the device's table names a config
    for this shape at x's row count (``gemm_configs.DENSE_GEMV_TABLE``: decode's one row on
    an H200, where it measured faster than cuBLAS), else through torch."""
    config = None
    if x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype:
        config = dense_gemv_config(x.shape[0], weight.shape[0], weight.shape[1], silu, x.dtype,
                                   x.device)
    if config is not None and x.stride(-1) == 1 and weight.stride(-1) == 1:
        return gemv_linear(x, weight, None, None, bias, config, silu=silu)
    if silu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    return F.linear(x, weight, bias)
