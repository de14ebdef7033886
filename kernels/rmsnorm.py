"""add_rmsnorm: the residual add fused into RMSNorm, one pass over each row.

``x, residual [T, N]`` and ``weight [N]`` in the model dtype give
``(out, summed)`` with ``summed = residual + x`` (rounded to the model dtype,
as a plain add is) and ``out = weight * (s * rsqrt(mean(s**2) + eps))`` where
``s`` is ``summed`` in float32 and the normalised row is cast back to the model
dtype before the weight multiply (the order transformers uses). ``residual``
may be None: then ``summed`` is ``x`` itself and only the norm runs.
``out`` (optional, ``[T, N]`` of x's dtype, a dense last dim, any row stride)
receives the normalised rows instead of a new tensor; it may be ``x`` itself
(each row is read whole before it is written): MLA normalises the compressed
KV in place inside its GEMM output, so the latent row needs no concatenation.

The Triton kernel runs one program per row; the row length is a compile-time
block, the row count is never specialised on (it varies per batch).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["num_rows"])
def _add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, num_rows, n_cols, eps,
    stride_x, stride_res, stride_out, stride_sum,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    ok = col < n_cols
    x = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + col, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + col, x, mask=ok)
    s = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(s * s, 0) / n_cols + eps)
    normed = (s * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + col, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _check_out(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty_like(x)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be a {x.dtype} tensor of shape {tuple(x.shape)}, got "
                         f"{getattr(out, 'shape', type(out))} {getattr(out, 'dtype', '')}")
    check_same_device(x=x, out=out)
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must be dense along its last dim, got strides {out.stride()}")
    return out


def _check_args(x, residual, weight, eps) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, N], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x.dtype must be one of {_DTYPES}, got {x.dtype}")
    if residual is not None and (not isinstance(residual, torch.Tensor)
                                 or residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be a {x.dtype} tensor of shape {tuple(x.shape)}, got "
                         f"{getattr(residual, 'shape', type(residual))}")
    if not isinstance(weight, torch.Tensor) or weight.shape != (x.shape[1],) or (
        weight.dtype != x.dtype
    ):
        raise ValueError(f"weight must be a {x.dtype} tensor of shape ({x.shape[1]},), got "
                         f"{getattr(weight, 'shape', type(weight))}")
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (
        math.isfinite(eps) and eps > 0
    ):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    check_same_device(x=x, residual=residual, weight=weight)
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        if t is not None and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be dense along its last dim, got strides {t.stride()}")


def add_rmsnorm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, *, out: torch.Tensor | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, residual, weight, eps)
    out = _check_out(x, out)
    summed = x if residual is None else torch.empty_like(x)
    if x.shape[0] == 0:
        return out, summed
    block = triton.next_power_of_2(x.shape[1])
    res = x if residual is None else residual
    _add_rmsnorm_kernel[(x.shape[0],)](
        x, res, weight, out, summed, x.shape[0], x.shape[1], float(eps),
        x.stride(0), res.stride(0), out.stride(0), summed.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=max(1, min(16, block // 256)), **pdl_args(x),
    )
    return out, summed


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float, *, out: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    _check_args(x, residual, weight, eps)
    if out is not None:
        _check_out(x, out)
    summed = x if residual is None else residual + x
    s = summed.float()
    variance = s.pow(2).mean(-1, keepdim=True)
    normed = weight * (s * torch.rsqrt(variance + eps)).to(x.dtype)
    if out is None:
        return normed, summed
    return out.copy_(normed), summed


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, *, out: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(RMSNorm(residual + x), residual + x)``, the first in ``out`` if given; see the
    module doc."""
    run = add_rmsnorm_triton if use_triton(x) else add_rmsnorm_ref
    return run(x, residual, weight, eps, out=out)
