"""The weight-only-dequant (w8a16) block-FP8 GEMM tile: decode's few rows.

``out [M, N] = x @ (w * w_scale)^T`` with ``x [M, K]`` in its own dtype (bf16, fp16
or fp32: no activation quantization, no ``a_scale``) and ``w [N, K]`` e4m3 with one
float32 scale per ``GROUP_N x GROUP_K`` block. Each k step (inside one scale group:
``BLOCK_K`` divides ``GROUP_K``) loads the e4m3 weight tile, converts it to x's
dtype (exact: every e4m3 value is a bf16 and an fp16 value), runs a 16-bit
tensor-core dot from zero with a float32 result and adds it, scaled by the weight
scale (a scalar when the tile lies inside one scale block, else one per column), to
the float32 sum. That is ``fp8_linear_ref``'s operation (``F.linear`` of the
unquantized activations on the dequantized weight), up to the weight's rounding to
x's dtype there and the summation order; the w8a8 path's per-k-step quantization
of the activations (issue 33: most of the fused decode GEMM's k loop) is gone.

Swap AB: the tile is computed transposed, ``acc [BLOCK_N, BLOCK_M] = w_tile
[BLOCK_N, BLOCK_K] @ x_tile^T [BLOCK_K, BLOCK_M]``, and stored transposed. Hopper's
wgmma takes its A operand from registers or shared memory and B from shared memory,
and its M is 64 per warpgroup. Decided by compiling offline for sm_90
(``bench/fp8_gemm_compile.py --w8a16``, Triton 3.9): swapped, with ``BLOCK_N >= 64``
on 4 warps, the ttgir is a ``warp_group_dot`` whose A operand is the converted weight
in registers (``local_load`` of the e4m3 tile into the dot-operand layout,
``fp_to_fp`` to bf16 there, no ``local_store`` of the converted tile) and x^T
pipelined through shared memory as B; the ptx has ``wgmma.mma_async``. Unswapped
(``x [16, BLOCK_K] @ w^T``) the 16-row M is below wgmma's 64 and Triton emits
``mma.sync`` for it. ``BLOCK_N = 32`` (swapped) also takes ``mma.sync``.

``SILU`` (the down projection of a gated MLP): ``x`` is the gate/up GEMM's output
``[M, 2K]`` (gate half, then up half) and each x tile is ``silu(gate) * up`` computed
in registers (``quant.silu_mul_tile``: rounded to x's dtype as ``silu_mul`` rounds it,
so the result is bit for bit that of ``silu_mul`` then this GEMM, one launch fewer).

Split-K writes float32 partials ``[SPLIT_K, M, N]`` that gemm.py's reduction adds
(with the bias) in a fixed order. The launcher (gemm.py ``_launch``) checks layouts.
"""

from __future__ import annotations

import triton
import triton.language as tl
from lanekv.kernels.fp8.quant import silu_mul_tile
from lanekv.kernels.fp8.tile_order import tile_coords
from lanekv.kernels.pdl import pdl_launch_dependents, pdl_wait


@triton.jit(do_not_specialize=["rows"])
def _w8a16_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, rows, cols, depth,
    stride_x, stride_w, stride_ws, stride_out,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SILU: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    """One output tile (or one k slice of it), tiles in the grouped order of the w8a8
    kernel. Rows and columns are loaded clamped into range (no masks along them) and
    stored unclamped, masked (the compiler then sees a row's columns contiguous)."""
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    tile = tl.program_id(0)
    pid_m, pid_n, split, k_lo, k_hi = tile_coords(tile, rows, cols, depth, BLOCK_M, BLOCK_N,
                                                  BLOCK_K, GROUP_M, SPLIT_K)

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < rows, n < cols
    m_safe = tl.where(m_ok, m, 0).to(tl.int64)
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    # [BLOCK_N, BLOCK_K] weight (K contiguous) and [BLOCK_K, BLOCK_M] x^T
    w_ptrs = w_ptr + n_safe[:, None] * stride_w + (k_lo * BLOCK_K + kk)[None, :]
    x_ptrs = x_ptr + m_safe[None, :] * stride_x + (k_lo * BLOCK_K + kk)[:, None]
    SCALAR_WS: tl.constexpr = GROUP_N % BLOCK_N == 0  # the tile inside one scale block
    if SCALAR_WS:
        ws_tile = ws_ptr + ((pid_n * BLOCK_N) // GROUP_N).to(tl.int64) * stride_ws
    else:
        ws_cols = ws_ptr + (n_safe // GROUP_N) * stride_ws
    dtype = x_ptr.dtype.element_ty

    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for ks in range(k_lo, k_hi):
        k0 = ks * BLOCK_K
        if SCALAR_WS:
            w_s = tl.load(ws_tile + k0 // GROUP_K)
        else:
            w_s = tl.load(ws_cols + k0 // GROUP_K)[:, None]
        if EVEN_K:
            w = tl.load(w_ptrs)
            xt = tl.load(x_ptrs)
            if SILU:  # x_ptrs point at gate; up is depth values further on
                xt = silu_mul_tile(xt, tl.load(x_ptrs + depth))
        else:
            k_ok = k0 + kk < depth
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
            if SILU:
                xt = silu_mul_tile(xt, tl.load(x_ptrs + depth, mask=k_ok[:, None], other=0.0))
        # the converted weight is the dot's A operand (registers); one scale group per dot
        acc += tl.dot(w.to(dtype), xt, out_dtype=tl.float32, input_precision=DOT_PRECISION) * w_s
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K

    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    mask = m_ok[:, None] & n_ok[None, :]
    m_out = m.to(tl.int64)[:, None]
    if SPLIT_K > 1:  # float32 partials; the reduction adds the bias and casts
        part = part_ptr + split.to(tl.int64) * rows * cols
        tl.store(part + m_out * cols + n[None, :], out, mask=mask)
    else:
        if HAS_BIAS:
            out += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m_out * stride_out + n[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)
