"""moe_experts_fp8_decode: the routed experts of a few tokens with block-FP8 expert weights.

The operation and the inputs of ``kernels.fp8.experts.moe_experts_fp8`` (``w13 [E, 2I, H]``
and ``w2 [E, H, I]`` in e4m3 with one float32 scale per ``block`` of weights), for
decode batches (at most ``kernels.moe.decode.MAX_DECODE_TOKENS`` tokens): the scheme of
``kernels.moe.decode`` (a slot per routing pair, the expert's first pair runs it, no sort,
three launches, captured in a CUDA graph), reading each touched expert's e4m3 weights
once, half the bytes of the bf16 experts.

The activations stay in x's dtype: each weight tile is dequantized in the kernel (e4m3
times its block's scale, rounded to x's dtype, as ``dequantize_weight_blocks`` does)
and multiplied with the unquantized rows. So this is ``moe_experts_fp8_ref``'s
operation (the dequantized weights against unquantized activations; transformers runs
FP8 checkpoints the same way), to the accumulation order, and there are no activation
scales (``scale_ue8m0`` is about those: the grouped path takes it, this one has none).
At a decode batch the weights' bytes are the cost; the activations are a few rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import use_triton
from lanekv.kernels.fp8.experts import _check_args, moe_experts_fp8_ref
from lanekv.kernels.moe.decode import (
    MAX_DECODE_TOKENS,
    DecodeTiles,
    _count_of,
    _decode_combine_kernel,
    _expert_of_slot,
    _load_ids,
    _p_block,
    _rows_of,
    default_decode_tiles,
)


def fp8_decode_tiles(x: torch.Tensor, active: int, inter: int, hidden: int,
                     block: tuple[int, int]) -> DecodeTiles:
    """``kernels.moe.decode``'s tiles, each inside one scale block (one scale per tile)."""
    cfg = default_decode_tiles(x, active, inter, hidden)
    return cfg._replace(block_n=min(cfg.block_n, block[0]), block_k=min(cfg.block_k, block[1]))


@triton.jit(do_not_specialize=["num_tokens", "num_experts"])
def _fp8_decode_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, ids_ptr, h_ptr, num_tokens, num_experts, inter, hidden,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ht,
    TOP_K: tl.constexpr, P_BLOCK: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    ids = _load_ids(ids_ptr, num_tokens, TOP_K, P_BLOCK)
    expert, runs = _expert_of_slot(ids, tl.program_id(0), num_tokens, num_experts, TOP_K, P_BLOCK)
    if runs == 0:
        return
    count = _count_of(ids, expert, num_tokens, num_experts)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    stride_n = stride_wn.to(tl.int64)
    w = w_ptr + expert.to(tl.int64) * stride_we
    up = inter * stride_n
    scales = s_ptr + expert.to(tl.int64) * stride_se
    gate_scales = scales + (n0 // GROUP_N) * stride_sn  # the tile lies in one block row
    up_scales = scales + ((inter + n0) // GROUP_N) * stride_sn  # inter: whole blocks
    dtype = h_ptr.dtype.element_ty
    for chunk in range(0, count, BLOCK_M):
        _, token, row, valid = _rows_of(ids, expert, num_tokens, num_experts, chunk, count,
                                        TOP_K, P_BLOCK, BLOCK_M)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            group = k0 // GROUP_K
            wg = tl.load(w + n[None, :] * stride_n + k[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w + up + n[None, :] * stride_n + k[:, None], mask=w_mask, other=0.0)
            wg = (wg.to(tl.float32) * tl.load(gate_scales + group)).to(dtype)
            wu = (wu.to(tl.float32) * tl.load(up_scales + group)).to(dtype)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        gate = acc_g.to(dtype).to(tl.float32)
        upv = acc_u.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(h_ptr + row[:, None] * stride_ht + n[None, :], (act * upv).to(dtype),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_experts"])
def _fp8_decode_down_kernel(
    h_ptr, w_ptr, s_ptr, ids_ptr, weights_ptr, y_ptr, num_tokens, num_experts, hidden, inter,
    stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_yt,
    TOP_K: tl.constexpr, P_BLOCK: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    ids = _load_ids(ids_ptr, num_tokens, TOP_K, P_BLOCK)
    expert, runs = _expert_of_slot(ids, tl.program_id(0), num_tokens, num_experts, TOP_K, P_BLOCK)
    if runs == 0:
        return
    count = _count_of(ids, expert, num_tokens, num_experts)
    n0 = tl.program_id(1) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    stride_n = stride_wn.to(tl.int64)
    w = w_ptr + expert.to(tl.int64) * stride_we
    scales = s_ptr + expert.to(tl.int64) * stride_se + (n0 // GROUP_N) * stride_sn
    dtype = y_ptr.dtype.element_ty
    for chunk in range(0, count, BLOCK_M):
        pair, _, row, valid = _rows_of(ids, expert, num_tokens, num_experts, chunk, count,
                                       TOP_K, P_BLOCK, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = tl.load(h_ptr + row[:, None] * stride_ht + k[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w + n[None, :] * stride_n + k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            b = (b.to(tl.float32) * tl.load(scales + k0 // GROUP_K)).to(dtype)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        weight = tl.load(weights_ptr + pair, mask=valid, other=1.0)
        out = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
        tl.store(y_ptr + row[:, None] * stride_yt + n[None, :], out,
                 mask=valid[:, None] & n_ok[None, :])


def _check_decode(x: torch.Tensor, w13, s13, w2, s2, weights, ids, block) -> None:
    _check_args(x, w13, s13, w2, s2, weights, ids, block)
    if x.shape[0] > MAX_DECODE_TOKENS:
        raise ValueError(f"x has {x.shape[0]} tokens; the decode kernels take at most "
                         f"{MAX_DECODE_TOKENS} (larger batches: moe_experts_fp8)")


def moe_experts_fp8_decode_triton(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                                  w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                                  ids: torch.Tensor, block: tuple[int, int], *,
                                  config: DecodeTiles | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the tiles (each must lie in one scale block)."""
    _check_decode(x, w13, s13, w2, s2, weights, ids, block)
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    cfg = config or fp8_decode_tiles(x, min(experts, top_k), inter, hidden, tuple(block))
    if block[0] % cfg.block_n or block[1] % cfg.block_k:
        raise ValueError(f"config.block_n={cfg.block_n} and config.block_k={cfg.block_k} must "
                         f"divide the weight block {tuple(block)}")
    ids = ids.contiguous()
    p_block = _p_block(x, top_k)  # the token bucket's pairs (one compile per bucket)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    pairs = tokens * top_k
    h = x.new_empty((pairs, inter))
    _fp8_decode_gate_up_kernel[(pairs, triton.cdiv(inter, cfg.block_n))](
        x, w13, s13, ids, h, tokens, experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0),
        TOP_K=top_k, P_BLOCK=p_block, GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    y = x.new_empty((pairs, hidden))
    _fp8_decode_down_kernel[(pairs, triton.cdiv(hidden, cfg.block_n))](
        h, w2, s2, ids, weights.reshape(-1).contiguous(), y, tokens, experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        TOP_K=top_k, P_BLOCK=p_block, GROUP_N=block[0], GROUP_K=block[1], BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    out = torch.empty_like(x)
    combine = min(1024, max(16, triton.next_power_of_2(hidden)))
    _decode_combine_kernel[(tokens, triton.cdiv(hidden, combine))](
        y, out, tokens, hidden, y.stride(0), out.stride(0), TOP_K=top_k, SHARED=0, BLOCK=combine,
    )
    return out


def moe_experts_fp8_decode_ref(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                               w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                               ids: torch.Tensor, block: tuple[int, int], *,
                               config: DecodeTiles | None = None) -> torch.Tensor:
    """The dequantized weights against unquantized activations (``config``: how the
    kernel runs, not what it computes)."""
    _check_decode(x, w13, s13, w2, s2, weights, ids, block)
    return moe_experts_fp8_ref(x, w13, s13, w2, s2, weights, ids, block)


def moe_experts_fp8_decode(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                           w2: torch.Tensor, s2: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, block: tuple[int, int], *,
                           config: DecodeTiles | None = None) -> torch.Tensor:
    run = moe_experts_fp8_decode_triton if use_triton(x) else moe_experts_fp8_decode_ref
    return run(x, w13, s13, w2, s2, weights, ids, block, config=config)
