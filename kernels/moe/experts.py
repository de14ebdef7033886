"""moe_experts: the routed experts of a MoE layer, each token through its top-k SwiGLU experts.

``x [T, H]``, the stacked expert weights ``w13 [E, 2I, H]`` (each expert's gate
rows then its up rows) and ``w2 [E, H, I]``, and the router's ``weights [T, k]``
(float32) and ``ids [T, k]`` (int64 expert ids) give
``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))`` with
``e = ids[t, j]``, in x's dtype. Every intermediate is rounded to x's dtype where
the unfused torch modules round it (each GEMM's output, the SiLU, the product,
the weighted expert output).

The Triton path never syncs with the host and its shapes depend only on ``T``:
the ``T * k`` (token, choice) pairs are sorted by expert on the device, and
two grouped GEMMs (gate/up fused with SiLU * up, then down with the routing
weight) run over a fixed grid of ``cdiv(T*k, BLOCK_M) + min(T*k, E)`` row-block
slots; each program finds its expert and row block from the per-expert offsets
on the device and exits if its slot is past the last block. Each selected
expert's weights are read once per row block (once per step at decode sizes),
so the step can be captured in a CUDA graph. The torch reference (CPU) loops
over the experts that got tokens, sized on the host.

An id of -1 is a choice that is not there (the capturable EP dispatch's padding,
``model.parallel.dispatch_capturable``): the sort puts it after every real pair and
the per-expert offsets leave it out, so no GEMM row computes it and the real pairs'
blocks are those of the same batch without it (the same bits); its programs of the
shape-fixed grid exit at once. The reference adds nothing for it; the Triton paths
(and the block-FP8 kernels, which share the sort) leave its per-pair row unwritten,
so a token with a -1 choice is defined only there: callers pass such pairs one a
token (k = 1) and discard those rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 1024


class MoETiles(NamedTuple):
    """Tiles of both grouped GEMMs (block_n counts gate columns: the up tile is as wide)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def prefill_tile_min_pairs(num_experts: int) -> int:
    """The fewest (token, expert) pairs for which ``default_moe_tiles`` picks the prefill
    tiles on CUDA. Each tile set is its own compiled kernel, so the prefill warm-up
    (``prefill.warmup``) runs both sides of this."""
    return 4 * num_experts + 1


def default_moe_tiles(pairs: int, num_experts: int, x: torch.Tensor) -> MoETiles:
    """Decode sizes (a few rows per expert): thin row blocks, long k steps, deep
    pipelines; prefill sizes: square tiles. float32 tiles take half the stages' shared
    memory of 16-bit ones."""
    if not x.is_cuda:  # the interpreter: small tiles, so tests span several blocks
        return MoETiles(16, 16, 16, 4, 1)
    wide = x.dtype == torch.float32
    if pairs < prefill_tile_min_pairs(num_experts):
        return MoETiles(16, 64, 64, 4, 2) if wide else MoETiles(16, 64, 128, 4, 4)
    return MoETiles(64, 64, 32, 4, 2) if wide else MoETiles(64, 64, 64, 4, 3)


@triton.jit
def _expert_block(offsets_ptr, num_experts, slot, BLOCK_M: tl.constexpr, E_BLOCK: tl.constexpr):
    """(expert, first sorted row, end row) of row-block ``slot``; expert ``>= num_experts``
    when the slot is past the last block. Experts without rows have no block."""
    e = tl.arange(0, E_BLOCK)
    e_ok = e < num_experts
    start = tl.load(offsets_ptr + e, mask=e_ok, other=0)
    end = tl.load(offsets_ptr + 1 + e, mask=e_ok, other=0)
    blocks = (end - start + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, 0)
    expert = tl.sum((ends <= slot).to(tl.int32), 0)
    this = e == expert
    m_block = slot - tl.sum(tl.where(this, ends - blocks, 0), 0)
    first = tl.sum(tl.where(this, start, 0), 0) + m_block * BLOCK_M
    last = tl.sum(tl.where(this, end, 0), 0)
    return expert, first, last


@triton.jit(do_not_specialize=["num_experts"])
def _moe_gate_up_kernel(
    x_ptr, w_ptr, order_ptr, offsets_ptr, h_ptr, num_experts, inter, hidden,
    stride_xt, stride_we, stride_wn, stride_ht,
    TOP_K: tl.constexpr, E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
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
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        wu = tl.load(w + (inter + n)[None, :] * stride_wn + k[:, None], mask=w_mask, other=0.0)
        acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    dtype = h_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)
    up = acc_u.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_ht + n[None, :], (act * up).to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_experts"])
def _moe_down_kernel(
    h_ptr, w_ptr, order_ptr, offsets_ptr, weights_ptr, out_ptr, num_experts, hidden, inter,
    stride_ht, stride_we, stride_wn, stride_ot,
    E_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    expert, first, last = _expert_block(offsets_ptr, num_experts, tl.program_id(0), BLOCK_M,
                                        E_BLOCK)
    if expert >= num_experts:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < last
    pair = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(h_ptr + rows.to(tl.int64)[:, None] * stride_ht + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w + n[None, :] * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + pair[:, None] * stride_ot + n[None, :], y.to(dtype),
             mask=row_ok[:, None] & n_ok[None, :])


def _check_args(x, w13, w2, weights, ids) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [T, H], got {getattr(x, 'shape', type(x))}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x.dtype must be one of {_DTYPES}, got {x.dtype}")
    tokens, hidden = x.shape
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3 or w13.shape[2] != hidden or (
        w13.shape[1] % 2
    ):
        raise ValueError(f"w13 must be [E, 2 * I, {hidden}], got {getattr(w13, 'shape', w13)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"w13 has {experts} experts, expected 1 to {MAX_EXPERTS}")
    if not isinstance(w2, torch.Tensor) or tuple(w2.shape) != (experts, hidden, inter):
        raise ValueError(f"w2 must be [{experts}, {hidden}, {inter}], got "
                         f"{getattr(w2, 'shape', w2)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != x.dtype:
            raise ValueError(f"{name}.dtype is {w.dtype} but x.dtype is {x.dtype}")
        if w.stride(2) != 1:
            raise ValueError(f"{name} must be dense along its last dim, got strides {w.stride()}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must be dense along its last dim, got strides {x.stride()}")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != tokens or (
        ids.dtype != torch.int64
    ):
        raise ValueError(f"ids must be an int64 tensor [{tokens}, k], got "
                         f"{getattr(ids, 'shape', ids)} {getattr(ids, 'dtype', '')}")
    if not isinstance(weights, torch.Tensor) or weights.shape != ids.shape or (
        weights.dtype != torch.float32
    ):
        raise ValueError(f"weights must be a float32 tensor of shape {tuple(ids.shape)}, got "
                         f"{getattr(weights, 'shape', weights)} {getattr(weights, 'dtype', '')}")
    check_same_device(x=x, w13=w13, w2=w2, weights=weights, ids=ids)
    if not ids.is_cuda and ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= experts):
        bad = int(ids.min()) if int(ids.min()) < -1 else int(ids.max())
        raise ValueError(f"ids holds expert {bad}, outside the {experts} experts of w13")


def _sort_pairs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs grouped by expert (stable) and each expert's first
    row among them, ``[E + 1]`` int32: device ops only. Pairs of id -1 sort last and
    are in no expert's rows (``offsets[E]`` counts the real pairs)."""
    flat = torch.where(ids.reshape(-1) < 0, num_experts, ids.reshape(-1))
    order = torch.sort(flat, stable=True)[1]
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)  # [E]: the skipped
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
    torch.cumsum(counts[:num_experts], 0, out=offsets[1:])
    return order, offsets


def moe_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor, *,
                       config: MoETiles | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the tiles (benchmarks sweep them)."""
    _check_args(x, w13, w2, weights, ids)
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    pairs = tokens * top_k
    if pairs == 0:
        return torch.zeros_like(x)
    cfg = config or default_moe_tiles(pairs, experts, x)
    order, offsets = _sort_pairs(ids, experts)
    slots = triton.cdiv(pairs, cfg.block_m) + min(pairs, experts)
    e_block = max(2, triton.next_power_of_2(experts))
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = x.new_empty((pairs, inter))
    _moe_gate_up_kernel[(slots, triton.cdiv(inter, cfg.block_n))](
        x, w13, order, offsets, h, experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, E_BLOCK=e_block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    per_pair = x.new_empty((pairs, hidden))
    _moe_down_kernel[(slots, triton.cdiv(hidden, cfg.block_n))](
        h, w2, order, offsets, weights.reshape(-1).contiguous(), per_pair, experts, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        E_BLOCK=e_block, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return per_pair.view(tokens, top_k, hidden).sum(1)


def moe_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Plain torch: the pairs sorted by expert, one GEMM pair per expert that got
    tokens (sized on the host), the weighted outputs added back per token (pairs of
    id -1 sort last and add nothing)."""
    _check_args(x, w13, w2, weights, ids)
    top_k, inter, experts = ids.shape[1], w13.shape[1] // 2, w13.shape[0]
    flat = torch.where(ids.reshape(-1) < 0, experts, ids.reshape(-1))
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, skipped last
    counts = torch.bincount(flat, minlength=experts + 1)[:experts].tolist()
    order = order[:sum(counts)]
    tokens = order // top_k
    rows = x[tokens]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            part = rows[start : start + count]
            gate, up = F.linear(part, w13[expert]).split(inter, dim=-1)
            out_rows[start : start + count] = F.linear(F.silu(gate) * up, w2[expert])
            start += count
    return torch.zeros_like(x).index_add_(
        0, tokens, (out_rows * weights.reshape(-1)[order, None]).to(x.dtype))


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor) -> torch.Tensor:
    """The weighted sum of each token's routed SwiGLU experts (see the module doc)."""
    run = moe_experts_triton if use_triton(x) else moe_experts_ref
    return run(x, w13, w2, weights, ids)
