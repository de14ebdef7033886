"""The block-FP8 (w8a8) GEMM of a quantized linear, and the linear itself.

``block_fp8_matmul(a, a_scale, w, w_scale, block, out_dtype, bias=None)``:
``a [M, K]`` e4m3 with ``a_scale [M, cdiv(K, block_k)]`` (per token group),
``w [N, K]`` e4m3 with ``w_scale [cdiv(N, block_n), cdiv(K, block_k)]`` (per
block) -> ``out [M, N] = (a * a_scale) @ (w * w_scale)^T + bias`` in
``out_dtype``. The kernel's k step is one scale group (``BLOCK_K`` divides
``block_k``), so each step's fp8 dot is scaled once per row and column and
accumulated in float32; the reference dequantizes both sides and multiplies in
float32 (so the two agree to float32 summation order).

``fp8_linear(x, weight, weight_scale_inv, block, bias=None)`` is what a
quantized linear calls: on CUDA, ``x`` quantized per token group then the GEMM,
or, for decode's few rows in 16-row tiles, the GEMM quantizing ``x`` itself
(``linear_plan`` decides: every column tile repeats its rows' quantization, which
costs little in a 16-row tile and dominates the k loop in a 64-row one);
or, with a w8a16 config (the default at <= 16 rows on CUDA: ``gemm_configs.py``),
no quantization at all: ``gemm_w8a16.py`` reads ``x`` in its own dtype and
dequantizes each e4m3 weight tile in the kernel; or, with a gemv config (1 to 4
rows, a tuned table's pick), the CUDA-core split-K GEMV of ``gemm_gemv.py``, x
unquantized as well;
the reference (CPU) runs ``F.linear`` on the dequantized weight in ``x``'s dtype,
unquantized activations, so a CPU run equals the same model with the weights
dequantized.

The kernel: each k step is one scale group (``BLOCK_K`` divides ``block_k``;
128 on real checkpoints), so a step loads one activation scale per row and one
weight scale per column block (a scalar when the tile lies inside one weight
scale block), and its fp8 ``tl.dot``, started from zero, is scaled and added to
a float32 accumulator (Hopper's fp8 tensor cores add at reduced precision: one
step's products at most pass through them). The dot is at least 32 deep, as
Triton's fp8 dot on sm_90 requires: a narrower scale group (tiny test
checkpoints) keeps its step and pads the dot with zero columns (masked loads).
The weight stays ``[N, K]`` as stored (K contiguous, which is the K-major
operand Hopper's fp8 tensor cores take): tiles are loaded along K, coalesced. Tiles are handed out grouped by rows (``group_m``) for L2 reuse of
the weight; decode's few rows can split K over more programs (float32 partials
and one deterministic reduction); TMA descriptors, persistent programs and a
lagged scaling of the products are switches of the config. Loads index rows and
columns clamped into range (no masks along them); stores index them as they are,
masked, so the compiler sees each row's columns contiguous and stores 16-byte
vectors (with the clamped indices it stored bf16 one element per instruction;
the first prefill sweep's times fit a fixed ~30 us per wave of 128x128 tiles
on top of the k loop). The config comes
from a tuned table or a heuristic: ``gemm_configs.py``.

``silu_mul_fp8_linear(gate_up, ...)`` (a gated MLP's down projection): with a w8a8
config ``silu_mul_quant_fp8`` quantizes ``silu(gate) * up`` and the GEMM follows; with
a w8a16 or gemv config (the unquantized families) the GEMM reads ``gate_up`` itself and
computes the product in registers, rounded as ``silu_mul`` rounds it: bit for bit the
result of ``silu_mul`` then ``fp8_linear``, one launch fewer (``fuse_silu=False`` runs
that unfused pair).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, on_device, use_triton
from lanekv.kernels.fp8.gemm_configs import (
    GEMV_MAX_ROWS,
    GemmConfig,
    check_config,
    select_config,
)
from lanekv.kernels.fp8.gemm_gemv import gemv_linear
from lanekv.kernels.fp8.gemm_w8a16 import _w8a16_kernel
from lanekv.kernels.fp8.quant import (
    _quantize_tile,
    hw_cast,
    per_token_group_quant_fp8,
    silu_mul_quant_fp8,
    silu_mul_triton,
)
from lanekv.kernels.fp8.tile_order import tile_coords
from lanekv.kernels.fp8.weights import FP8_DTYPE, dequantize_weight_blocks, scale_shape
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from triton.tools.tensor_descriptor import TensorDescriptor

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _gemm_tile(
    tile, a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, rows, cols, depth,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    TMA: tl.constexpr, LAG: tl.constexpr, QUANT_A: tl.constexpr, UE8M0: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """One output tile (or one k slice of it): grouped tile order, one scale per
    row and per column block for every k step, float32 accumulation. A k step is
    ``BLOCK_K`` deep; its dot is ``DOT_K >= BLOCK_K`` deep, the columns past
    ``BLOCK_K`` loaded as zeros (fp8 dots are at least 32 deep; a 16-wide scale
    group still takes one step, its scales applied to it alone)."""
    pid_m, pid_n, split, k_lo, k_hi = tile_coords(tile, rows, cols, depth, BLOCK_M, BLOCK_N,
                                                  BLOCK_K, GROUP_M, SPLIT_K)

    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < rows, n < cols
    m_safe = tl.where(m_ok, m, 0).to(tl.int64)  # out-of-range rows/columns reread row 0
    n_safe = tl.where(n_ok, n, 0).to(tl.int64)
    kk = tl.arange(0, DOT_K)
    PAD_K: tl.constexpr = DOT_K > BLOCK_K
    MASK_K: tl.constexpr = PAD_K or not EVEN_K  # loads along k need a mask
    as_rows = as_ptr + m_safe * stride_as
    # the tile inside one weight scale block: one scalar scale per k step
    SCALAR_WS: tl.constexpr = GROUP_N % BLOCK_N == 0
    if SCALAR_WS:
        ws_tile = ws_ptr + ((pid_n * BLOCK_N) // GROUP_N).to(tl.int64) * stride_ws
    else:
        ws_cols = ws_ptr + (n_safe // GROUP_N) * stride_ws
    if QUANT_A or not TMA:
        a_ptrs = a_ptr + m_safe[:, None] * stride_a + (k_lo * BLOCK_K + kk)[None, :]
    if not TMA:
        w_ptrs = w_ptr + n_safe[None, :] * stride_w + (k_lo * BLOCK_K + kk)[:, None]

    # the scales of a step are loaded one step ahead: their latency hides behind a dot
    # (the pipeliner only prefetches the tiles that feed the dot)
    last_group = tl.cdiv(depth, GROUP_K) - 1
    g_first = tl.minimum((k_lo * BLOCK_K) // GROUP_K, last_group)
    if not QUANT_A:
        a_s_next = tl.load(as_rows + g_first)
    if SCALAR_WS:  # (a vector of weight scales carried over the loop stops the pipelining)
        w_s_next = tl.load(ws_tile + g_first)

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if LAG:
        prev = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        prev_s = tl.zeros([BLOCK_M], tl.float32)
    for ks in range(k_lo, k_hi):
        k0 = ks * BLOCK_K
        if MASK_K:  # the step's own columns (not the padding), inside the depth
            k_ok = kk < BLOCK_K
            if not EVEN_K:
                k_ok = k_ok & (k0 + kk < depth)
        g_next = tl.minimum((k0 + BLOCK_K) // GROUP_K, last_group)
        if SCALAR_WS:
            w_s = w_s_next
            w_s_next = tl.load(ws_tile + g_next)
        else:
            w_s = tl.load(ws_cols + k0 // GROUP_K)
        if QUANT_A:  # a is the unquantized activation: one scale group per k step
            if MASK_K:
                x = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0).to(tl.float32)
                a, a_s = _quantize_tile(x, k_ok[None, :], UE8M0, HW_CAST)
            else:
                x = tl.load(a_ptrs).to(tl.float32)
                a, a_s = _quantize_tile(x, (kk < DOT_K)[None, :], UE8M0, HW_CAST)
        else:
            a_s = a_s_next
            a_s_next = tl.load(as_rows + g_next)
            if TMA:
                a = a_ptr.load([pid_m * BLOCK_M, k0])
            elif MASK_K:
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs)
        if TMA:
            w = w_ptr.load([pid_n * BLOCK_N, k0]).T
        elif MASK_K:
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs)
        # Each step's dot starts from zero and is scaled into the float32 sum: Hopper's fp8
        # tensor cores add at reduced precision, so no more than one step's products pass
        # through their accumulator (a running sum handed to the dot as its accumulator
        # drifts from the reference as K grows: gemm_configs.py, the removed fold family).
        if LAG:  # issue this step's dot, then scale the previous one's
            d = tl.dot(a, w, out_dtype=tl.float32)
            acc += prev * prev_s[:, None]
            prev = d
            prev_s = a_s * w_s
        elif SCALAR_WS:
            acc += tl.dot(a, w, out_dtype=tl.float32) * (a_s * w_s)[:, None]
        else:
            acc += tl.dot(a, w, out_dtype=tl.float32) * a_s[:, None] * w_s[None, :]
        if not TMA:
            w_ptrs += BLOCK_K
        if QUANT_A or not TMA:
            a_ptrs += BLOCK_K
    if LAG:
        acc += prev * prev_s[:, None]

    # The stores index by the unclamped rows and columns (masked): the clamped indices
    # hide from the compiler that a row's columns are contiguous, and it then stores one
    # element per instruction (scalar 2-byte stores).
    mask = m_ok[:, None] & n_ok[None, :]
    m_out = m.to(tl.int64)[:, None]
    if SPLIT_K > 1:  # float32 partials; the reduction adds the bias and casts
        part = part_ptr + split.to(tl.int64) * rows * cols
        tl.store(part + m_out * cols + n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + m_out * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@triton.jit(do_not_specialize=["rows"])
def _block_fp8_matmul_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, rows, cols, depth,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    TMA: tl.constexpr, LAG: tl.constexpr, PERSISTENT: tl.constexpr, QUANT_A: tl.constexpr,
    UE8M0: tl.constexpr, HW_CAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    pid = tl.program_id(0)
    if PERSISTENT:  # one program per SM walks the tiles
        tiles = tl.cdiv(rows, BLOCK_M) * tl.cdiv(cols, BLOCK_N) * SPLIT_K
        for tile in range(pid, tiles, tl.num_programs(0)):
            _gemm_tile(tile, a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, rows, cols,
                       depth, stride_a, stride_as, stride_w, stride_ws, stride_out, GROUP_N, GROUP_K,
                       HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_K, GROUP_M, SPLIT_K, EVEN_K, TMA,
                       LAG, QUANT_A, UE8M0, HW_CAST)
    else:
        _gemm_tile(pid, a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, rows, cols,
                   depth, stride_a, stride_as, stride_w, stride_ws, stride_out, GROUP_N, GROUP_K,
                   HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, DOT_K, GROUP_M, SPLIT_K, EVEN_K, TMA,
                   LAG, QUANT_A, UE8M0, HW_CAST)


@triton.jit
def _split_k_reduce_kernel(part_ptr, bias_ptr, out_ptr, numel, cols,
                           SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """``out = sum(partials) + bias`` in float32, then cast (split order fixed: deterministic)."""
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + i % cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=ok)


def check_block(block: tuple[int, int]) -> tuple[int, int]:
    """``(block_n, block_k)``: powers of two >= 16 (Triton dot tiles)."""
    if not isinstance(block, tuple | list) or len(block) != 2 or any(
            isinstance(b, bool) or not isinstance(b, int) or b < 16 or b & (b - 1) for b in block):
        raise ValueError(f"block must be two powers of two >= 16 (block_n, block_k), got {block!r}")
    return int(block[0]), int(block[1])


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8_DTYPE:
        raise ValueError(f"{name} must be a {FP8_DTYPE} tensor, got {getattr(weight, 'dtype', weight)}")
    if weight.stride(-1) != 1:
        raise ValueError(f"{name} must be dense along its last dim, got strides {weight.stride()}")
    expected = scale_shape(tuple(weight.shape), block)
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or (
            tuple(scale.shape) != expected):
        raise ValueError(f"{name}_scale must be float32 {expected} for {name} "
                         f"{tuple(weight.shape)} and block {tuple(block)}, got "
                         f"{getattr(scale, 'dtype', scale)} {tuple(getattr(scale, 'shape', ()))}")
    if scale.stride(-1) != 1:
        raise ValueError(f"{name}_scale must be dense along its last dim, got {scale.stride()}")


def _check_matmul(a, a_scale, w, w_scale, block, out_dtype, bias) -> None:
    block = check_block(block)
    if not isinstance(a, torch.Tensor) or a.dim() != 2 or a.dtype != FP8_DTYPE:
        raise ValueError(f"a must be a 2-D {FP8_DTYPE} tensor, got "
                         f"{getattr(a, 'dtype', a)} {tuple(getattr(a, 'shape', ()))}")
    if a.shape[1] > 1 and a.stride(1) != 1:
        raise ValueError(f"a must be dense along its last dim, got strides {a.stride()}")
    if w.dim() != 2 or w.shape[1] != a.shape[1]:
        raise ValueError(f"w must be [N, {a.shape[1]}], got {tuple(w.shape)}")
    check_fp8_weight(w, w_scale, block, "w")
    groups = -(-a.shape[1] // block[1])
    if a_scale.dtype != torch.float32 or tuple(a_scale.shape) != (a.shape[0], groups) or (
            groups > 1 and a_scale.stride(1) != 1):
        raise ValueError(f"a_scale must be float32 [{a.shape[0]}, {groups}] and dense, got "
                         f"{a_scale.dtype} {tuple(a_scale.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {_OUT_DTYPES}, got {out_dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != w.shape[0]):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    check_same_device(a=a, a_scale=a_scale, w=w, w_scale=w_scale, bias=bias)


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA's rules for a 2-D fp8 tensor: 16-byte aligned base and row stride, dense rows."""
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0


def _launch(a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor,
            w_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
            bias: torch.Tensor | None, config: GemmConfig | None,
            ue8m0: bool = False, silu: bool = False) -> torch.Tensor:
    """``a_scale is None``: ``a`` is unquantized and either the config is w8a16 (the
    weight-only-dequant kernel, ``gemm_w8a16.py``) or each tile quantizes its rows'
    groups on the fly (``_quantize_tile``, the quantization kernel's own code).
    Pre-quantized ``a`` with a w8a16 config: refused when the caller named the
    config; a table's or the heuristic's w8a16 pick runs as its w8a8 twin (same
    tiles, the switch off), so ``silu_mul_fp8_linear``'s quantized input keeps working.
    The same for a gemv config (it runs through ``gemm_gemv.gemv_linear``, not here).
    ``silu`` (w8a16 only): ``a`` is ``gate_up [M, 2K]`` and the kernel multiplies
    ``silu(gate) * up``."""
    rows, cols, depth = a.shape[0], w.shape[0], w.shape[1]
    out = torch.empty((rows, cols), dtype=out_dtype, device=a.device)
    if rows == 0 or cols == 0:
        return out
    if depth == 0:
        out.zero_()
        return out if bias is None else out.add_(bias)
    cfg = check_config(config) if config is not None else select_config(
        rows, cols, depth, tuple(block), a.device)
    if a_scale is not None and (cfg.w8a16 or cfg.gemv):
        family = "gemv" if cfg.gemv else "w8a16"
        if config is not None:
            raise ValueError(f"config.{family}=True ({cfg.name()}) reads the activations "
                             "unquantized: block_fp8_matmul takes quantized a and a_scale "
                             f"(run a {family} config through fp8_linear)")
        cfg = cfg._replace(w8a16=False, gemv=False)
    if cfg.gemv:
        raise ValueError(f"config.gemv=True ({cfg.name()}) runs through gemm_gemv.gemv_linear")
    if silu and not cfg.w8a16:
        raise ValueError(f"silu=True needs a w8a16 config, got {cfg.name()}")
    if block[1] % cfg.block_k:
        raise ValueError(f"config.block_k={cfg.block_k} must divide block_k={block[1]}")
    if cfg.lag and block[0] % cfg.block_n:
        raise ValueError(f"config.lag needs config.block_n={cfg.block_n} to divide "
                         f"block_n={block[0]}")
    split = min(cfg.split_k, triton.cdiv(depth, cfg.block_k))
    part = (torch.empty((split, rows, cols), dtype=torch.float32, device=a.device)
            if split > 1 else out)
    bias_arg = bias if bias is not None else w_scale
    if cfg.w8a16:
        tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(cols, cfg.block_n) * split
        with on_device(a.device):
            _w8a16_kernel[(tiles,)](
                a, w, w_scale, bias_arg, out, part, rows, cols, depth, a.stride(0), w.stride(0),
                w_scale.stride(0), out.stride(0),
                GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                GROUP_M=cfg.group_m, SPLIT_K=split, EVEN_K=depth % cfg.block_k == 0,
                DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", SILU=silu,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(a),
            )
            _reduce_splits(part, bias, bias_arg, out, split)
        return out
    quant_a = a_scale is None
    if quant_a and cfg.block_k != block[1]:
        raise ValueError(f"quantizing in the GEMM needs config.block_k={cfg.block_k} to equal "
                         f"block_k={block[1]}")
    tiles = triton.cdiv(rows, cfg.block_m) * triton.cdiv(cols, cfg.block_n) * split
    # (a padded dot tile reads zeros past the step: pointer loads with a mask)
    use_tma = cfg.tma and cfg.dot_k == cfg.block_k and _tma_ok(w) and (quant_a or _tma_ok(a))
    a_arg, w_arg = a, w
    if use_tma:
        if not quant_a:
            a_arg = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        w_arg = TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k])
    programs = tiles
    if cfg.persistent:
        sms = (torch.cuda.get_device_properties(a.device).multi_processor_count
               if a.is_cuda else 4)
        programs = min(tiles, sms)
    with on_device(a.device):
        _block_fp8_matmul_kernel[(programs,)](
            a_arg, w_scale if quant_a else a_scale, w_arg, w_scale, bias_arg, out, part, rows,
            cols, depth, a.stride(0), 0 if quant_a else a_scale.stride(0), w.stride(0),
            w_scale.stride(0), out.stride(0),
            GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_K=cfg.dot_k,
            GROUP_M=cfg.group_m, SPLIT_K=split, EVEN_K=depth % cfg.block_k == 0, TMA=use_tma,
            LAG=cfg.lag, PERSISTENT=cfg.persistent, QUANT_A=quant_a, UE8M0=ue8m0, HW_CAST=hw_cast(),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(a),
        )
        _reduce_splits(part, bias, bias_arg, out, split)
    return out


def _reduce_splits(part: torch.Tensor, bias: torch.Tensor | None, bias_arg: torch.Tensor,
                   out: torch.Tensor, split: int) -> None:
    """Split-K: ``out = sum(part) + bias`` (nothing to do for one split)."""
    if split > 1:
        numel = out.numel()
        reduce_block = 1024
        _split_k_reduce_kernel[(triton.cdiv(numel, reduce_block),)](
            part, bias_arg, out, numel, out.shape[1], SPLIT_K=split, HAS_BIAS=bias is not None,
            BLOCK=reduce_block, num_warps=4, **pdl_args(part))


def block_fp8_matmul_triton(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                            w_scale: torch.Tensor, block: tuple[int, int],
                            out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
                            config: GemmConfig | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the table's or the heuristic's choice
    (the benchmark sweeps them, the tests run each family)."""
    _check_matmul(a, a_scale, w, w_scale, block, out_dtype, bias)
    return _launch(a, a_scale, w, w_scale, tuple(block), out_dtype, bias, config)


def block_fp8_matmul_ref(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                         w_scale: torch.Tensor, block: tuple[int, int],
                         out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                         ) -> torch.Tensor:
    _check_matmul(a, a_scale, w, w_scale, block, out_dtype, bias)
    a32 = a.float() * a_scale.repeat_interleave(block[1], dim=1)[:, : a.shape[1]]
    out = a32 @ dequantize_weight_blocks(w, w_scale, tuple(block)).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def block_fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                     w_scale: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    run = block_fp8_matmul_triton if use_triton(a) else block_fp8_matmul_ref
    return run(a, a_scale, w, w_scale, block, out_dtype, bias)


def _check_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  block: tuple[int, int]) -> None:
    check_block(block)
    if not isinstance(x, torch.Tensor) or x.dtype not in _OUT_DTYPES:
        raise ValueError(f"x must be a tensor of one of {_OUT_DTYPES}, got {getattr(x, 'dtype', x)}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim {x.shape[-1]} != weight's in_features {weight.shape[1]}")
    check_fp8_weight(weight, scale, block)


FUSED_QUANT_MAX_ROWS = 64  # decode: quantize inside the GEMM (one launch, no round trip)
# ... and only in row tiles of at most this many rows: every column tile quantizes its row
# tile's activations again (N / block_n times over), on the CUDA cores of the GEMM's own
# warps, one correctly rounded division per element. A 16-row tile on 4 warps quantizes 16
# values per thread per k step, a 64-row tile 64, and then the quantization is most of the
# compiled k loop (``bench/fp8_gemm_compile.py --quant-a`` counts its instructions).
FUSED_QUANT_MAX_BLOCK_M = 16


class LinearPlan(NamedTuple):
    """How ``fp8_linear`` runs a shape: the GEMM's config, and whether the GEMM
    quantizes the activations itself (else ``per_token_group_quant_fp8`` runs first;
    neither for a w8a16 config, which reads them unquantized: ``fuse_quant`` False)."""
    config: GemmConfig
    fuse_quant: bool


def linear_plan(rows: int, n: int, k: int, block: tuple[int, int], device: torch.device, *,
                fuse_quant: bool | None = None, config: GemmConfig | None = None) -> LinearPlan:
    """For ``rows`` of a ``[n, k]`` weight: the config (``config``, else the table's
    or the heuristic's) and the fusion (``fuse_quant``, else: at most
    ``FUSED_QUANT_MAX_ROWS`` rows, row tiles of at most ``FUSED_QUANT_MAX_BLOCK_M``,
    the k step one scale group, unless the config says ``quant_first``: the sweep timed
    the quantization kernel then the GEMM faster for that shape). A w8a16 or gemv config
    quantizes nothing: ``fuse_quant`` is False. An explicit ``fuse_quant`` asks for
    quantized activations: a table's or the heuristic's w8a16 or gemv pick then runs as
    its w8a8 twin; with such a ``config`` it is refused, as is a gemv ``config`` for more
    than ``GEMV_MAX_ROWS`` rows."""
    cfg = config if config is not None else select_config(rows, n, k, tuple(block), device)
    if (cfg.w8a16 or cfg.gemv) and fuse_quant is not None:
        if config is not None:
            family = "gemv" if cfg.gemv else "w8a16"
            raise ValueError(f"fuse_quant={fuse_quant} asks for quantized activations but "
                             f"config {cfg.name()} has {family}=True (leave fuse_quant None)")
        cfg = cfg._replace(w8a16=False, gemv=False)
    if cfg.gemv and rows > GEMV_MAX_ROWS:
        raise ValueError(f"rows={rows}: config.gemv=True ({cfg.name()}) takes at most "
                         f"{GEMV_MAX_ROWS} rows")
    if cfg.w8a16 or cfg.gemv:
        return LinearPlan(cfg, False)
    if fuse_quant is None:
        fuse_quant = (rows <= FUSED_QUANT_MAX_ROWS and cfg.block_m <= FUSED_QUANT_MAX_BLOCK_M
                      and cfg.block_k == block[1] and not cfg.quant_first)
    return LinearPlan(cfg, fuse_quant)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None = None, *,
                      scale_ue8m0: bool = False, fuse_quant: bool | None = None,
                      config: GemmConfig | None = None) -> torch.Tensor:
    """``x [..., K]``: per-token-group quantization then the w8a8 GEMM. With
    ``fuse_quant`` (default: ``linear_plan``'s rule) the GEMM reads ``x`` itself and
    quantizes each tile's groups with the quantization kernel's own code, so the
    result is the same as quantizing first, one launch fewer. A w8a16 config (the
    default at <= 16 rows on CUDA) runs ``x`` unquantized against the dequantized
    weight tiles: ``fp8_linear_ref``'s operation."""
    _check_linear(x, weight, weight_scale_inv, block)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    cfg, fuse_quant = linear_plan(flat.shape[0], weight.shape[0], weight.shape[1], block,
                                  x.device, fuse_quant=fuse_quant, config=config)
    check_same_device(x=x, weight=weight, weight_scale_inv=weight_scale_inv, bias=bias)
    if cfg.gemv:
        out = gemv_linear(flat, weight, weight_scale_inv, tuple(block), bias, cfg)
    elif fuse_quant or cfg.w8a16:
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
            raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
        out = _launch(flat, None, weight, weight_scale_inv, tuple(block), x.dtype, bias, cfg,
                      ue8m0=scale_ue8m0)
    else:
        a, a_scale = per_token_group_quant_fp8(flat, block[1], scale_ue8m0=scale_ue8m0)
        out = block_fp8_matmul_triton(a, a_scale, weight, weight_scale_inv, block, x.dtype,
                                      bias, config=cfg)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None, *,
                   scale_ue8m0: bool = False, fuse_quant: bool | None = None,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """``F.linear`` with the dequantized weight (activations stay as they are;
    ``fuse_quant`` and ``config`` choose how the kernel runs, not what it computes)."""
    _check_linear(x, weight, weight_scale_inv, block)
    return F.linear(x, dequantize_weight_blocks(weight, weight_scale_inv, tuple(block), x.dtype),
                    bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None, *,
               scale_ue8m0: bool = False, fuse_quant: bool | None = None,
               config: GemmConfig | None = None) -> torch.Tensor:
    run = fp8_linear_triton if use_triton(x) else fp8_linear_ref
    return run(x, weight, weight_scale_inv, block, bias, scale_ue8m0=scale_ue8m0,
               fuse_quant=fuse_quant, config=config)


def silu_mul_fp8_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor,
                               weight_scale_inv: torch.Tensor, block: tuple[int, int],
                               bias: torch.Tensor | None = None, *,
                               scale_ue8m0: bool = False, config: GemmConfig | None = None,
                               fuse_silu: bool | None = None) -> torch.Tensor:
    """A down projection of ``silu(gate) * up`` for ``gate_up [..., 2I]``. The config
    (``config``, else the table's or the heuristic's for these rows) decides: w8a8:
    the product quantized in one pass over ``gate_up`` (``silu_mul_quant_fp8``), then
    the GEMM; w8a16 or gemv: the GEMM reads ``gate_up`` and computes the product in
    registers (``fuse_silu`` None or True), or ``silu_mul`` writes it first
    (``fuse_silu=False``), the same result bit for bit."""
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2 * I], got {tuple(getattr(gate_up, 'shape', ()))}")
    _check_linear(gate_up[..., : gate_up.shape[-1] // 2], weight, weight_scale_inv, block)
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    rows, (cols, inter) = flat.shape[0], weight.shape
    cfg = check_config(config) if config is not None else select_config(
        rows, cols, inter, tuple(block), gate_up.device)
    if cfg.w8a16 or cfg.gemv:
        if fuse_silu is False:
            out = fp8_linear_triton(silu_mul_triton(flat), weight, weight_scale_inv, block, bias,
                                    config=cfg)
        else:
            check_same_device(gate_up=gate_up, weight=weight, weight_scale_inv=weight_scale_inv,
                              bias=bias)
            if bias is not None and (bias.dim() != 1 or bias.shape[0] != cols):
                raise ValueError(f"bias must be [{cols}], got {tuple(bias.shape)}")
            out = (gemv_linear(flat, weight, weight_scale_inv, tuple(block), bias, cfg, silu=True)
                   if cfg.gemv else _launch(flat, None, weight, weight_scale_inv, tuple(block),
                                            gate_up.dtype, bias, cfg, silu=True))
        return out.view(*gate_up.shape[:-1], cols)
    if fuse_silu:
        raise ValueError(f"fuse_silu=True needs a w8a16 or gemv config, got {cfg.name()} (w8a8 "
                         "quantizes the product with silu_mul_quant_fp8)")
    a, a_scale = silu_mul_quant_fp8(flat, block[1], scale_ue8m0=scale_ue8m0)
    out = block_fp8_matmul_triton(a, a_scale, weight, weight_scale_inv, block, gate_up.dtype,
                                  bias, config=cfg)
    return out.view(*gate_up.shape[:-1], cols)


def silu_mul_fp8_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                            weight_scale_inv: torch.Tensor, block: tuple[int, int],
                            bias: torch.Tensor | None = None, *,
                            scale_ue8m0: bool = False, config: GemmConfig | None = None,
                            fuse_silu: bool | None = None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return fp8_linear_ref(F.silu(gate) * up, weight, weight_scale_inv, block, bias)


def silu_mul_fp8_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                        weight_scale_inv: torch.Tensor, block: tuple[int, int],
                        bias: torch.Tensor | None = None, *,
                        scale_ue8m0: bool = False, config: GemmConfig | None = None,
                        fuse_silu: bool | None = None) -> torch.Tensor:
    run = silu_mul_fp8_linear_triton if use_triton(gate_up) else silu_mul_fp8_linear_ref
    return run(gate_up, weight, weight_scale_inv, block, bias, scale_ue8m0=scale_ue8m0,
               config=config, fuse_silu=fuse_silu)
