"""moe_experts_fp8: the routed experts of a MoE layer with block-FP8 expert weights.

The same operation as ``kernels.moe.experts.moe_experts`` (``out[t] = sum_j
weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))``), the experts' weights
stored as the checkpoint stores them: ``w13 [E, 2I, H]`` e4m3 (gate rows, then
up rows) with ``s13 [E, 2I / block_n, cdiv(H, block_k)]``, ``w2 [E, H, I]`` e4m3
with ``s2 [E, cdiv(H, block_n), cdiv(I, block_k)]``; ``I`` is a multiple of
``block_n`` so gate and up blocks stack.

The Triton path quantizes ``x`` per token group, runs the gate/up grouped GEMM
(fp8 dots scaled per k step, SiLU * up rounded to x's dtype), quantizes that
product per group and runs the down grouped GEMM with the routing weight: the
pairs are sorted by expert on the device and the grid depends only on ``T``
(the bf16 path's scheme), so a decode step with FP8 experts captures in a CUDA
graph. The reference (CPU) dequantizes the weights and runs the bf16 reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.fp8.gemm import check_block, check_fp8_weight
from lanekv.kernels.fp8.quant import per_token_group_quant_fp8
from lanekv.kernels.fp8.weights import dequantize_weight_blocks
from lanekv.kernels.moe.experts import (
    MAX_EXPERTS,
    MoETiles,
    _expert_block,
    _sort_pairs,
    moe_experts_ref,
    prefill_tile_min_pairs,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def default_fp8_moe_tiles(pairs: int, num_experts: int, block: tuple[int, int],
                          x: torch.Tensor) -> MoETiles:
    """One k step per scale group on CUDA; decode sizes thin, prefill sizes square."""
    if not x.is_cuda:  # the interpreter: small tiles, so tests span several blocks
        return MoETiles(16, 16, 16, 4, 1)
    block_k = min(block[1], 128)
    if pairs < prefill_tile_min_pairs(num_experts):
        return MoETiles(16, 64, block_k, 4, 4)
    return MoETiles(64, 128, block_k, 8, 3)


@triton.jit
def _group_dot(a, b, BLOCK_K: tl.constexpr):
    """One k step's e4m3 product in float32. Triton's fp8 dot on sm_90 needs K >= 32; a
    narrower scale group (tiny test checkpoints) multiplies in float16 instead, which
    holds every e4m3 value exactly, so the products and their float32 sum are the same."""
    if BLOCK_K < 32:
        out = tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    else:
        out = tl.dot(a, b, out_dtype=tl.float32)
    return out


@triton.jit(do_not_specialize=["num_experts"])
def _fp8_gate_up_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, order_ptr, offsets_ptr, h_ptr, num_experts, inter, hidden,
    stride_xt, stride_xs, stride_we, stride_wn, stride_se, stride_sn, stride_ht,
    TOP_K: tl.constexpr, E_BLOCK: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, first, last = _expert_block(offsets_ptr, num_experts, tl.program_id(0), BLOCK_M,
                                        E_BLOCK)
    if expert >= num_experts:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < last
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w = w_ptr + expert.to(tl.int64) * stride_we
    s_gate = ws_ptr + expert.to(tl.int64) * stride_se + (n // GROUP_N) * stride_sn
    s_up = s_gate + (inter // GROUP_N) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        group = k0 // GROUP_K
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(xs_ptr + token * stride_xs + group, mask=row_ok, other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w + (inter + n)[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        g_s = tl.load(s_gate + group, mask=n_ok, other=0.0)
        u_s = tl.load(s_up + group, mask=n_ok, other=0.0)
        acc_g += _group_dot(a, wg, BLOCK_K) * a_s[:, None] * g_s[None, :]
        acc_u += _group_dot(a, wu, BLOCK_K) * a_s[:, None] * u_s[None, :]
    dtype = h_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_ht + n[None, :], (act * up).to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_experts"])
def _fp8_down_kernel(
    h_ptr, hs_ptr, w_ptr, ws_ptr, order_ptr, offsets_ptr, weights_ptr, out_ptr, num_experts,
    hidden, inter, stride_ht, stride_hs, stride_we, stride_wn, stride_se, stride_sn, stride_ot,
    E_BLOCK: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, first, last = _expert_block(offsets_ptr, num_experts, tl.program_id(0), BLOCK_M,
                                        E_BLOCK)
    if expert >= num_experts:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < last
    rows64 = rows.to(tl.int64)
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = w_ptr + expert.to(tl.int64) * stride_we
    s_w = ws_ptr + expert.to(tl.int64) * stride_se + (n // GROUP_N) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        group = k0 // GROUP_K
        a = tl.load(h_ptr + rows64[:, None] * stride_ht + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(hs_ptr + rows64 * stride_hs + group, mask=row_ok, other=0.0)
        b = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        b_s = tl.load(s_w + group, mask=n_ok, other=0.0)
        acc += _group_dot(a, b, BLOCK_K) * a_s[:, None] * b_s[None, :]
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pair[:, None] * stride_ot + n[None, :], y.to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


def _check_args(x, w13, s13, w2, s2, weights, ids, block) -> None:
    block = check_block(block)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DTYPES:
        raise ValueError(f"x must be a 2-D tensor [T, H] of one of {_DTYPES}, got "
                         f"{getattr(x, 'dtype', x)} {tuple(getattr(x, 'shape', ()))}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must be dense along its last dim, got strides {x.stride()}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[2] != hidden or w13.shape[1] % (2 * block[0]):
        raise ValueError(f"w13 must be [E, 2 * I, {hidden}] with I a multiple of "
                         f"block_n={block[0]}, got {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"w13 has {experts} experts, expected 1 to {MAX_EXPERTS}")
    if tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2 must be [{experts}, {hidden}, {inter}], got {tuple(w2.shape)}")
    check_fp8_weight(w13, s13, block, "w13")
    check_fp8_weight(w2, s2, block, "w2")
    if ids.dim() != 2 or ids.shape[0] != tokens or ids.dtype != torch.int64:
        raise ValueError(f"ids must be an int64 tensor [{tokens}, k], got {tuple(ids.shape)} "
                         f"{ids.dtype}")
    if weights.shape != ids.shape or weights.dtype != torch.float32:
        raise ValueError(f"weights must be a float32 tensor of shape {tuple(ids.shape)}, got "
                         f"{tuple(weights.shape)} {weights.dtype}")
    check_same_device(x=x, w13=w13, s13=s13, w2=w2, s2=s2, weights=weights, ids=ids)


def moe_experts_fp8_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                           w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, block: tuple[int, int], *,
                           scale_ue8m0: bool = False, tiles: MoETiles | None = None,
                           ) -> torch.Tensor:
    """Triton launcher; ``tiles`` overrides the choice (benchmarks sweep them)."""
    _check_args(x, w13, s13, w2, s2, weights, ids, block)
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    cfg = tiles or default_fp8_moe_tiles(pairs, experts, tuple(block), x)
    if block[1] % cfg.block_k:
        raise ValueError(f"tiles.block_k={cfg.block_k} must divide block_k={block[1]}")
    order, offsets = _sort_pairs(ids, experts)
    slots = triton.cdiv(pairs, cfg.block_m) + min(pairs, experts)
    e_block = max(2, triton.next_power_of_2(experts))
    xq, xs = per_token_group_quant_fp8(x, block[1], scale_ue8m0=scale_ue8m0)
    h = x.new_empty((pairs, inter))
    _fp8_gate_up_kernel[(slots, triton.cdiv(inter, cfg.block_n))](
        xq, xs, w13, s13, order, offsets, h, experts, inter, hidden,
        xq.stride(0), xs.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        h.stride(0), TOP_K=top_k, E_BLOCK=e_block, GROUP_N=block[0], GROUP_K=block[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    hq, hs = per_token_group_quant_fp8(h, block[1], scale_ue8m0=scale_ue8m0)
    per_pair = x.new_empty((pairs, hidden))
    _fp8_down_kernel[(slots, triton.cdiv(hidden, cfg.block_n))](
        hq, hs, w2, s2, order, offsets, weights.reshape(-1).contiguous(), per_pair, experts,
        hidden, inter, hq.stride(0), hs.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), per_pair.stride(0), E_BLOCK=e_block, GROUP_N=block[0], GROUP_K=block[1],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return per_pair.view(tokens, top_k, hidden).sum(1)


def moe_experts_fp8_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                        w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                        ids: torch.Tensor, block: tuple[int, int], *,
                        scale_ue8m0: bool = False) -> torch.Tensor:
    """The bf16 reference on the dequantized weights (activations unquantized)."""
    _check_args(x, w13, s13, w2, s2, weights, ids, block)
    return moe_experts_ref(x, dequantize_weight_blocks(w13, s13, tuple(block), x.dtype),
                           dequantize_weight_blocks(w2, s2, tuple(block), x.dtype), weights, ids)


def moe_experts_fp8(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                    s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    block: tuple[int, int], *, scale_ue8m0: bool = False) -> torch.Tensor:
    run = moe_experts_fp8_triton if use_triton(x) else moe_experts_fp8_ref
    return run(x, w13, s13, w2, s2, weights, ids, block, scale_ue8m0=scale_ue8m0)
