"""router_logits: a MoE router's float32 logits ``x.float() @ weight.T``, one launch.

``x [T, H]`` in the model dtype and the gate's ``weight [E, H]`` float32 ->
``logits [T, E]`` float32, what ``F.linear(x.float(), weight)`` gives (DeepSeek's and
transformers' routers compute in float32). At decode sizes that torch line is three
launches on CUDA: the cast of ``x`` to float32 (a copy) and cuBLAS's float GEMV as a dot
kernel plus its reduction. The Triton kernel reads ``x`` in its own dtype, converts it
as it loads and sums the products in float32 (no TF32), one program per (expert, block
of tokens); its sums run in another order than cuBLAS's, so the logits agree to float32
rounding, not bit for bit.

Batches above ``MAX_GATE_TOKENS`` (prefill) take the torch line: there the GEMM is
large enough for cuBLAS and the copy is a small part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The most tokens the Triton kernel takes (decode batches); more take cuBLAS.
MAX_GATE_TOKENS = 64


@triton.jit(do_not_specialize=["num_tokens"])
def _router_logits_kernel(
    x_ptr, w_ptr, out_ptr, num_tokens, hidden, stride_xt, stride_we, stride_ot,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    e = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < num_tokens
    acc = tl.zeros([BLOCK_T], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        w = tl.load(w_ptr + e * stride_we + k, mask=k_ok, other=0.0)
        x = tl.load(x_ptr + t[:, None].to(tl.int64) * stride_xt + k[None, :],
                    mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(x * w[None, :], 1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + e, acc, mask=t_ok)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a 2-D tensor [T, H] of {_DTYPES}, got "
                         f"{getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or (
        weight.dtype != torch.float32 or weight.shape[1] != x.shape[1]
    ):
        raise ValueError(f"weight must be a float32 tensor [E, {x.shape[1]}], got "
                         f"{getattr(weight, 'shape', type(weight))} {getattr(weight, 'dtype', '')}")
    for name, t in (("x", x), ("weight", weight)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be dense along its last dim, got strides {t.stride()}")
    check_same_device(x=x, weight=weight)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    _check(x, weight)
    tokens, hidden = x.shape
    experts = weight.shape[0]
    out = torch.empty((tokens, experts), dtype=torch.float32, device=x.device)
    if out.numel() == 0:
        return out
    # GPU: a whole V2-Lite row (2048) per load, four tokens per program (64 fp32 registers
    # per thread at 8 warps); the interpreter: small blocks, so tests span several.
    block_k = min(2048, triton.next_power_of_2(hidden)) if x.is_cuda else 16
    block_t = 4 if x.is_cuda else 2
    _router_logits_kernel[(experts, triton.cdiv(tokens, block_t))](
        x, weight, out, tokens, hidden, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_K=block_k, num_warps=8 if block_k >= 2048 else 4,
        **pdl_args(x),
    )
    return out


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The routers' torch line (transformers' order: cast, then the float32 GEMM)."""
    _check(x, weight)
    return F.linear(x.float(), weight)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x.float() @ weight.T`` (module doc): the Triton kernel for decode batches."""
    small = isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] <= MAX_GATE_TOKENS
    return (router_logits_triton if small and use_triton(x) else router_logits_ref)(x, weight)
