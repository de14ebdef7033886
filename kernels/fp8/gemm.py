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
quantized linear calls: on CUDA, ``x`` quantized per token group then the GEMM;
the reference (CPU) runs ``F.linear`` on the dequantized weight in ``x``'s dtype,
unquantized activations, so a CPU run equals the same model with the weights
dequantized. Tiles: decode's few rows take thin row blocks and narrow column
blocks (more programs streaming the weight), prefill's many take square ones.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.quant import per_token_group_quant_fp8, silu_mul_quant_fp8
from lanekv.kernels.fp8.weights import FP8_DTYPE, dequantize_weight_blocks, scale_shape

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class GemmTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def default_gemm_tiles(rows: int, block: tuple[int, int], device: torch.device) -> GemmTiles:
    """Tiles by row count: decode (<= 16 rows), mid-size batches, prefill."""
    block_k = min(block[1], 128)
    if device.type != "cuda":  # the interpreter: small tiles, several blocks per test
        return GemmTiles(16, 32, min(block_k, 32), 4, 1)
    if rows <= 16:
        return GemmTiles(16, 32, block_k, 4, 4)
    if rows <= 64:
        return GemmTiles(32, 64, block_k, 4, 4)
    if rows <= 256:
        return GemmTiles(64, 128, block_k, 4, 3)
    return GemmTiles(128, 128, block_k, 8, 3)


@triton.jit(do_not_specialize=["rows"])
def _block_fp8_matmul_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, rows, cols, depth,
    stride_a, stride_as, stride_w, stride_ws, stride_out,
    GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < rows, n < cols
    m64, n64 = m.to(tl.int64), n.to(tl.int64)
    a_rows = a_ptr + m64[:, None] * stride_a
    w_cols = w_ptr + n64[None, :] * stride_w
    ws_cols = ws_ptr + (n // GROUP_N).to(tl.int64) * stride_ws
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, depth, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < depth
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        group = k0 // GROUP_K
        a_s = tl.load(as_ptr + m64 * stride_as + group, mask=m_ok, other=0.0)
        w_s = tl.load(ws_cols + group, mask=n_ok, other=0.0)
        acc += tl.dot(a, w, out_dtype=tl.float32) * a_s[:, None] * w_s[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m64[:, None] * stride_out + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


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


def block_fp8_matmul_triton(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor,
                            w_scale: torch.Tensor, block: tuple[int, int],
                            out_dtype: torch.dtype, bias: torch.Tensor | None = None, *,
                            tiles: GemmTiles | None = None) -> torch.Tensor:
    """Triton launcher; ``tiles`` overrides the row-count choice (benchmarks sweep them)."""
    _check_matmul(a, a_scale, w, w_scale, block, out_dtype, bias)
    (rows, depth), cols = a.shape, w.shape[0]
    out = torch.empty((rows, cols), dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    cfg = tiles or default_gemm_tiles(rows, tuple(block), a.device)
    if block[1] % cfg.block_k:
        raise ValueError(f"tiles.block_k={cfg.block_k} must divide block_k={block[1]}")
    grid = (triton.cdiv(cols, cfg.block_n), triton.cdiv(rows, cfg.block_m))
    _block_fp8_matmul_kernel[grid](
        a, a_scale, w, w_scale, bias if bias is not None else w_scale, out, rows, cols, depth,
        a.stride(0), a_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0),
        GROUP_N=block[0], GROUP_K=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


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


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                      block: tuple[int, int], bias: torch.Tensor | None = None, *,
                      scale_ue8m0: bool = False) -> torch.Tensor:
    """``x [..., K]``: per-token-group quantization then the w8a8 GEMM."""
    _check_linear(x, weight, weight_scale_inv, block)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[1] > 1 and flat.stride(1) != 1:
        flat = flat.contiguous()
    a, a_scale = per_token_group_quant_fp8(flat, block[1], scale_ue8m0=scale_ue8m0)
    out = block_fp8_matmul_triton(a, a_scale, weight, weight_scale_inv, block, x.dtype, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   block: tuple[int, int], bias: torch.Tensor | None = None, *,
                   scale_ue8m0: bool = False) -> torch.Tensor:
    """``F.linear`` with the dequantized weight (activations stay as they are)."""
    _check_linear(x, weight, weight_scale_inv, block)
    return F.linear(x, dequantize_weight_blocks(weight, weight_scale_inv, tuple(block), x.dtype),
                    bias)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               block: tuple[int, int], bias: torch.Tensor | None = None, *,
               scale_ue8m0: bool = False) -> torch.Tensor:
    run = fp8_linear_triton if use_triton(x) else fp8_linear_ref
    return run(x, weight, weight_scale_inv, block, bias, scale_ue8m0=scale_ue8m0)


def silu_mul_fp8_linear_triton(gate_up: torch.Tensor, weight: torch.Tensor,
                               weight_scale_inv: torch.Tensor, block: tuple[int, int],
                               bias: torch.Tensor | None = None, *,
                               scale_ue8m0: bool = False) -> torch.Tensor:
    """A down projection of ``silu(gate) * up``: the product quantized in one pass
    over ``gate_up [T, 2I]`` (``silu_mul_quant_fp8``), then the GEMM."""
    _check_linear(gate_up[..., : gate_up.shape[-1] // 2], weight, weight_scale_inv, block)
    a, a_scale = silu_mul_quant_fp8(gate_up, block[1], scale_ue8m0=scale_ue8m0)
    return block_fp8_matmul_triton(a, a_scale, weight, weight_scale_inv, block, gate_up.dtype,
                                   bias)


def silu_mul_fp8_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor,
                            weight_scale_inv: torch.Tensor, block: tuple[int, int],
                            bias: torch.Tensor | None = None, *,
                            scale_ue8m0: bool = False) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return fp8_linear_ref(F.silu(gate) * up, weight, weight_scale_inv, block, bias)


def silu_mul_fp8_linear(gate_up: torch.Tensor, weight: torch.Tensor,
                        weight_scale_inv: torch.Tensor, block: tuple[int, int],
                        bias: torch.Tensor | None = None, *,
                        scale_ue8m0: bool = False) -> torch.Tensor:
    run = silu_mul_fp8_linear_triton if use_triton(gate_up) else silu_mul_fp8_linear_ref
    return run(gate_up, weight, weight_scale_inv, block, bias, scale_ue8m0=scale_ue8m0)
