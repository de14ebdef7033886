"""Per-token-group FP8 quantization of activations, alone or fused with SiLU-and-multiply.

``per_token_group_quant_fp8(x [M, K], group_size)`` -> ``(q [M, K] e4m3,
scale [M, cdiv(K, group_size)] float32)``: each row's consecutive groups of
``group_size`` values (the last may be partial) are divided by
``max(amax, 1e-10) / 448`` and rounded to e4m3, so ``q * scale`` restores the
row. With ``scale_ue8m0`` the scale is rounded up to a power of two (DeepSeek's
``scale_fmt: ue8m0`` checkpoints). Both divisions round to nearest (``div_rn``
in the kernel, a tensor divisor in the reference) and the quotient is clamped
to +-448 before the cast in both, so the cast is the same operation on both
sides: compiled, the hardware's round-to-nearest-even conversion
(``cvt.rn.satfinite``, as torch's ``.to(float8_e4m3fn)`` rounds); under the
interpreter, whose cast carries no mantissa overflow into the exponent, the
value is rounded to e4m3 in float32 bits first (``HW_CAST=False``). No
hand-rolled rounding runs on the GPU: an add-and-subtract rounding of e4m3
subnormals is exactly the kind of trick a compiler may contract or reorder.

``silu_mul_quant_fp8(gate_up [M, 2I], group_size)`` quantizes
``silu(gate) * up`` (each rounded to the input dtype, as the unfused torch ops
round them) without writing the product: the input of a quantized down
projection, one read of the gate/up GEMM's output instead of three passes.
``silu_mul(gate_up)`` writes that product unquantized (the input of a w8a16 or gemv
down projection that does not fuse it); ``silu_mul_tile`` is the one jit definition
of its rounding, which the fused down projections (``gemm_w8a16.py``,
``gemm_gemv.py``) compute in registers, bit for bit as this kernel writes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.backend import interpreter_enabled, use_triton
from lanekv.kernels.fp8.weights import FP8_DTYPE, FP8_MAX
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

AMAX_FLOOR = 1e-10  # an all-zero group still gets a finite, positive scale
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def hw_cast() -> bool:
    """Whether kernels cast to e4m3/bf16 with the hardware conversion (compiled) or
    round in float32 bits first (the interpreter, whose casts do not round right)."""
    return not interpreter_enabled()


@triton.jit
def _quantize_tile(x, k_ok, UE8M0: tl.constexpr, HW_CAST: tl.constexpr):
    """float32 ``x [R, G]`` -> (e4m3 values, float32 scale ``[R]``)."""
    amax = tl.max(tl.where(k_ok, tl.abs(x), 0.0), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-10), 448.0)
    if UE8M0:  # round the scale's exponent up unless it is a power of two already
        bits = scale.to(tl.int32, bitcast=True)
        scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)
    if HW_CAST:  # round to nearest even, as torch's cast (the value is in range)
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale
    return _round_e4m3(q).to(tl.float8e4nv), scale


@triton.jit
def _round_e4m3(x):
    """float32 ``x`` (|x| <= 448) rounded to nearest-even e4m3 value, still in float32,
    so the interpreter's cast to e4m3 below is exact: it carries no mantissa
    overflow into the exponent (1.94 became 1.0). Interpreter only (``HW_CAST``)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magnitude = (tl.abs(x) + 24576.0) - 24576.0  # multiples of 2^-9, rounded to nearest even
    subnormal = tl.where(bits < 0, -magnitude, magnitude)  # the sign kept, -0.0 included
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit(do_not_specialize=["rows", "cols"])
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, UE8M0: tl.constexpr, HW_CAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    r_ok = r < rows
    k_ok = (k < cols)[None, :]
    mask = r_ok[:, None] & k_ok
    r64 = r.to(tl.int64)
    x = tl.load(x_ptr + r64[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x, k_ok, UE8M0, HW_CAST)
    tl.store(q_ptr + r64[:, None] * stride_q + k[None, :], q, mask=mask)
    tl.store(s_ptr + r64 * stride_s + tl.program_id(1), scale, mask=r_ok)


@triton.jit
def silu_mul_tile(gate, up):
    """``silu(gate) * up`` in ``gate``'s dtype: the SiLU rounded to it (as ``F.silu``),
    then the product of the rounded SiLU and ``up`` rounded to it (as torch's multiply)."""
    dtype = gate.dtype
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(dtype)


@triton.jit(do_not_specialize=["rows", "cols"])
def _silu_mul_kernel(x_ptr, out_ptr, rows, cols, stride_x, stride_out, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    r = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = k < cols
    gate = tl.load(x_ptr + r * stride_x + k, mask=ok, other=0.0)
    up = tl.load(x_ptr + r * stride_x + cols + k, mask=ok, other=0.0)
    tl.store(out_ptr + r * stride_out + k, silu_mul_tile(gate, up), mask=ok)


@triton.jit(do_not_specialize=["rows", "cols"])
def _silu_mul_quant_kernel(
    x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_q, stride_s,
    GROUP: tl.constexpr, BLOCK_R: tl.constexpr, UE8M0: tl.constexpr, HW_CAST: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    r_ok = r < rows
    k_ok = (k < cols)[None, :]
    mask = r_ok[:, None] & k_ok
    r64 = r.to(tl.int64)
    gate = tl.load(x_ptr + r64[:, None] * stride_x + k[None, :], mask=mask, other=0.0)
    up = tl.load(x_ptr + r64[:, None] * stride_x + cols + k[None, :], mask=mask, other=0.0)
    h = silu_mul_tile(gate, up).to(tl.float32)  # rounded as the unfused torch ops round it
    q, scale = _quantize_tile(h, k_ok, UE8M0, HW_CAST)
    tl.store(q_ptr + r64[:, None] * stride_q + k[None, :], q, mask=mask)
    tl.store(s_ptr + r64 * stride_s + tl.program_id(1), scale, mask=r_ok)


def _check(x: torch.Tensor, group_size: int, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [M, K], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name}.dtype must be one of {_DTYPES}, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"{name} must be dense along its last dim, got strides {x.stride()}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 16 or (
            group_size & (group_size - 1)):
        raise ValueError(f"group_size must be a power of two >= 16, got group_size={group_size!r}")


def _outputs(x: torch.Tensor, cols: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty((x.shape[0], cols), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((x.shape[0], triton.cdiv(cols, group_size)), dtype=torch.float32,
                    device=x.device)
    return q, s


def _block_rows(rows: int) -> int:
    return 1 if rows <= 1 else min(16, triton.next_power_of_2(rows))


def per_token_group_quant_fp8_triton(x: torch.Tensor, group_size: int, *,
                                     scale_ue8m0: bool = False,
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, group_size)
    rows, cols = x.shape
    q, s = _outputs(x, cols, group_size)
    if rows and cols:
        block_r = _block_rows(rows)
        _per_token_group_quant_kernel[(triton.cdiv(rows, block_r), s.shape[1])](
            x, q, s, rows, cols, x.stride(0), q.stride(0), s.stride(0),
            GROUP=group_size, BLOCK_R=block_r, UE8M0=scale_ue8m0, HW_CAST=hw_cast(), num_warps=4,
            **pdl_args(x))
    return q, s


def _round_scale_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    bits = scale.view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def per_token_group_quant_fp8_ref(x: torch.Tensor, group_size: int, *,
                                  scale_ue8m0: bool = False,
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    _check(x, group_size)
    rows, cols = x.shape
    groups = -(-cols // group_size)
    padded = F.pad(x.float(), (0, groups * group_size - cols)).view(rows, groups, group_size)
    amax = padded.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)  # [M, G]
    # a tensor divisor: torch on CUDA multiplies by the reciprocal of a scalar one,
    # which is not the correctly rounded quotient the kernel computes
    scale = amax / torch.full_like(amax, FP8_MAX)
    if scale_ue8m0:
        scale = _round_scale_ue8m0(scale)
    q = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).view(rows, groups * group_size)[:, :cols]
    return q.to(FP8_DTYPE), scale.contiguous()


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, *, scale_ue8m0: bool = False,
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    run = per_token_group_quant_fp8_triton if use_triton(x) else per_token_group_quant_fp8_ref
    return run(x, group_size, scale_ue8m0=scale_ue8m0)


def _check_gate_up(gate_up: torch.Tensor, group_size: int) -> None:
    _check(gate_up, group_size, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [M, 2 * I], got {tuple(gate_up.shape)}")


def silu_mul_quant_fp8_triton(gate_up: torch.Tensor, group_size: int, *,
                              scale_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_gate_up(gate_up, group_size)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    q, s = _outputs(gate_up, inter, group_size)
    if rows and inter:
        block_r = _block_rows(rows)
        _silu_mul_quant_kernel[(triton.cdiv(rows, block_r), s.shape[1])](
            gate_up, q, s, rows, inter, gate_up.stride(0), q.stride(0), s.stride(0),
            GROUP=group_size, BLOCK_R=block_r, UE8M0=scale_ue8m0, HW_CAST=hw_cast(), num_warps=4,
            **pdl_args(gate_up))
    return q, s


def silu_mul_quant_fp8_ref(gate_up: torch.Tensor, group_size: int, *,
                           scale_ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    _check_gate_up(gate_up, group_size)
    gate, up = gate_up.chunk(2, dim=-1)
    return per_token_group_quant_fp8_ref(F.silu(gate) * up, group_size, scale_ue8m0=scale_ue8m0)


def silu_mul_quant_fp8(gate_up: torch.Tensor, group_size: int, *, scale_ue8m0: bool = False,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    run = silu_mul_quant_fp8_triton if use_triton(gate_up) else silu_mul_quant_fp8_ref
    return run(gate_up, group_size, scale_ue8m0=scale_ue8m0)


def _check_silu_mul(gate_up: torch.Tensor) -> None:
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be a 2-D tensor [M, 2 * I], got "
                         f"{tuple(getattr(gate_up, 'shape', ()))}")
    if gate_up.dtype not in _DTYPES:
        raise ValueError(f"gate_up.dtype must be one of {_DTYPES}, got {gate_up.dtype}")
    if gate_up.shape[1] > 1 and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be dense along its last dim, got strides {gate_up.stride()}")


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up [M, I]`` in ``gate_up``'s dtype (``silu_mul_tile``'s rounding)."""
    _check_silu_mul(gate_up)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, rows, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4,
            **pdl_args(gate_up))
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    _check_silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    run = silu_mul_triton if use_triton(gate_up) else silu_mul_ref
    return run(gate_up)
