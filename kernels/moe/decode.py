"""moe_experts_decode: the routed experts of a few tokens (decode batches), the shared
experts fused in, three launches and no sort.

Same inputs as ``kernels/moe/experts.py`` (``x [T, H]``, ``w13 [E, 2I, H]`` gate rows
then up rows, ``w2 [E, H, I]``, float32 ``weights [T, k]``, int64 ``ids [T, k]``),
plus optionally the shared experts as one SwiGLU of ``S`` times the routed width:
``shared_w13 [2SI, H]`` (its ``SI`` gate rows, then its ``SI`` up rows, as the fused
gate/up of ``model.llama.FusedLinear``) and ``shared_w2 [H, SI]``. Returns

    out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))   (e = ids[t, j])
             + shared_down(silu(shared_gate(x[t])) * shared_up(x[t]))

in x's dtype. The shared expert runs as ``S`` more experts of width ``I`` that every
token picks with weight 1 (its intermediate cut into ``S`` slices of ``I``), so its
weights are read in the same launches.

Three kernels, none sized on the host from the routing, so a decode step captures
in a CUDA graph:

1. gate/up, grid ``(T*k + S, cdiv(I, BLOCK_N))``: slot ``j < T*k`` runs the expert of
   pair ``j`` if ``j`` is that expert's first pair (else it exits at once), so each
   touched expert runs once and at batch 1 no program idles; it finds the expert's
   pairs by scanning ``ids`` (``T * k`` ints, one load per program before the weights
   stream, no sort, no offsets) and streams the
   expert's gate and up columns once per ``BLOCK_M`` of its pairs (once per step at
   decode sizes), SiLU * up in the epilogue: ``h [T*k + S*T, I]``; slot ``T*k + s``
   runs shared slice ``s`` for every token;
2. down, grid ``(T*k + S, cdiv(H, BLOCK_N))``: the same pairs through ``w2``, the routing
   weight applied, one row per pair: ``y [T*k + S*T, H]``;
3. the combine, grid ``(T, cdiv(H, BLOCK))``: each token's ``k + S`` rows added in
   float32 in a fixed order (deterministic, no atomics), rounded once.

Tiles (``DecodeTiles``) are per kernel: ``DECODE_TILE_TABLE`` by (kernel, token bucket,
N, K), else ``default_decode_tiles``; the token buckets (1, 4, 16, 64) are all a launch
compiles on besides the weights' shapes, so the graph ladder's sizes compile every
variant a step can take. ``bench/moe_decode_sweep.py`` times candidate tiles per kernel
against the bytes each reads.

Every GEMM output, the SiLU, the product and the weighted expert output are rounded
to x's dtype as ``moe_experts`` rounds them. The reference (``moe_experts_decode_ref``)
loops over the pairs one by one and runs the shared expert at its full width.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.moe.experts import _check_args
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

# The most tokens the decode kernels take (larger batches take the sorted grouped GEMMs
# of kernels/moe/experts.py). Each program scans the ids in one block of
# next_power_of_2(bucket * k) slots, the bucket being the smallest of TOKEN_BUCKETS that
# holds T, and the tiles depend on the weights' shapes, k and that bucket only, so every
# batch size of a bucket runs the kernels compiled for the first.
MAX_DECODE_TOKENS = 64


class DecodeTiles(NamedTuple):
    block_m: int  # pairs per weight pass (tl.dot needs >= 16)
    block_n: int  # output columns per program
    block_k: int
    num_warps: int
    num_stages: int


# Token buckets: the tiles and the ids block a launch compiles on depend on the smallest
# bucket holding the batch, never on the batch itself. The CUDA-graph capture compiles
# its sizes' buckets and then every bucket the model uses (``MoE.warm_up_decode``), so
# an eager step above a short ladder compiles nothing either.
TOKEN_BUCKETS = (1, 4, 16, MAX_DECODE_TOKENS)
GATE_UP, DOWN = "gate_up", "down"

# Tiles by (kernel, token bucket, N, K) for 16-bit weights on a GPU; N is the GEMM's
# output width (gate_up: the expert width I, down: the hidden size H), K its reduction.
# Shapes and buckets not listed take ``default_decode_tiles``. DeepSeek-V2-Lite (H 2048,
# I 1408, 6 routed + 2 shared slices: 8 experts at batch 1): the batch-1 gate_up tiles
# give 8 x 44 = 352 programs of 60 KiB of shared memory (3 stages), so all of them are
# resident at once on 132 SMs (3 per SM) instead of 1.33 waves of the 80 KiB default;
# bench/moe_decode_sweep.py times these against the other candidates and the byte floor.
DECODE_TILE_TABLE: Mapping[tuple[str, int, int, int], DecodeTiles] = MappingProxyType({
    (GATE_UP, 1, 1408, 2048): DecodeTiles(16, 32, 128, 4, 3),
    (DOWN, 1, 2048, 1408): DecodeTiles(16, 32, 128, 4, 4),
    (GATE_UP, 4, 1408, 2048): DecodeTiles(16, 32, 128, 4, 3),
    (DOWN, 4, 2048, 1408): DecodeTiles(16, 32, 128, 4, 4),
    (GATE_UP, 16, 1408, 2048): DecodeTiles(16, 64, 64, 4, 4),
    (DOWN, 16, 2048, 1408): DecodeTiles(16, 64, 64, 4, 4),
})


def token_bucket(tokens: int) -> int:
    """The smallest of ``TOKEN_BUCKETS`` holding ``tokens`` (``tokens`` <= MAX_DECODE_TOKENS)."""
    return next(b for b in TOKEN_BUCKETS if tokens <= b)


def default_decode_tiles(x: torch.Tensor, active: int, inter: int, hidden: int) -> DecodeTiles:
    """Thin row blocks; columns per program chosen so the ``active`` experts' programs
    at batch 1 (``min(E, k) + S``; never the batch's own count, so that the tiles do not
    change with it) cover every SM about twice in the narrower of both GEMMs.
    On the interpreter small tiles, so tests span several blocks."""
    if not x.is_cuda:
        return DecodeTiles(16, 16, 16, 4, 1)
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    block_n = 64
    while block_n > 16 and active * triton.cdiv(min(inter, hidden), block_n) < 2 * sms:
        block_n //= 2
    if x.dtype == torch.float32:
        return DecodeTiles(16, block_n, 64, 4, 2)
    return DecodeTiles(16, block_n, 128, 4, 4)


def decode_tiles(x: torch.Tensor, kernel: str, active: int, inter: int,
                 hidden: int) -> DecodeTiles:
    """The tiles of ``kernel`` (GATE_UP or DOWN) for ``x``'s batch: ``DECODE_TILE_TABLE``'s
    entry for the batch's token bucket and the kernel's (N, K) where there is one (16-bit
    weights on a GPU), else ``default_decode_tiles``; the row block covers the bucket's
    tokens (at most 64), so a shared slice streams its weights once."""
    listed = table_tiles(kernel, x.shape[0], inter, hidden) if (
        x.is_cuda and x.dtype != torch.float32) else None
    tiles = listed or default_decode_tiles(x, active, inter, hidden)
    if not x.is_cuda:
        return tiles
    return tiles._replace(block_m=max(tiles.block_m, min(token_bucket(max(1, x.shape[0])), 64)))


def table_tiles(kernel: str, tokens: int, inter: int, hidden: int,
                table: Mapping[tuple[str, int, int, int], DecodeTiles] = DECODE_TILE_TABLE,
                ) -> DecodeTiles | None:
    """``table``'s tiles for ``kernel`` at ``tokens``' bucket, or None (tables are keyed
    as ``DECODE_TILE_TABLE``; block-FP8 experts have their own)."""
    if kernel not in (GATE_UP, DOWN):
        raise ValueError(f"kernel={kernel!r} must be {GATE_UP!r} or {DOWN!r}")
    n, k = (inter, hidden) if kernel == GATE_UP else (hidden, inter)
    return table.get((kernel, token_bucket(max(1, tokens)), n, k))


@triton.jit
def _rows_of(ids, pid, num_tokens, num_experts, chunk, count_hint,
             TOP_K: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows ``chunk .. chunk + BLOCK_M`` of program ``pid``'s pairs: (pair or -1 for a
    shared slice, token, row of h / y, valid). Routed: the pairs whose id is ``pid``,
    in pair order; shared slice ``s = pid - E``: every token, rows after the pairs.
    ``ids``: the step's ids as ``_load_ids`` gives them (loaded once per program)."""
    num_pairs = num_tokens * TOP_K
    p = tl.arange(0, P_BLOCK)
    mine = ids == pid
    rank = tl.cumsum(mine.to(tl.int32), 0) - 1
    r = chunk + tl.arange(0, BLOCK_M)
    hit = mine[None, :] & (rank[None, :] == r[:, None])
    pair = tl.sum(tl.where(hit, p[None, :], 0), 1)
    shared = pid >= num_experts
    token = tl.where(shared, r, pair // TOP_K)
    row = tl.where(shared, num_pairs + (pid - num_experts) * num_tokens + r, pair)
    valid = r < count_hint
    return tl.where(shared, -1, pair), token.to(tl.int64), row.to(tl.int64), valid


@triton.jit
def _load_ids(ids_ptr, num_tokens, TOP_K: tl.constexpr, P_BLOCK: tl.constexpr):
    """The step's ``T * k`` expert ids as one block (-1 past them): the one load of them
    a program makes, before its weights stream (the helpers below work on it)."""
    p = tl.arange(0, P_BLOCK)
    return tl.load(ids_ptr + p, mask=p < num_tokens * TOP_K, other=-1).to(tl.int32)


@triton.jit
def _expert_of_slot(ids, slot, num_tokens, num_experts, TOP_K: tl.constexpr,
                    P_BLOCK: tl.constexpr):
    """(expert or shared slice id, whether this slot runs it). Slot ``j < T*k`` runs pair
    ``j``'s expert if ``j`` is that expert's first pair (the others exit: no expert runs
    twice, and idle programs are at most the pairs); slot ``T*k + s`` runs shared slice ``s``."""
    num_pairs = num_tokens * TOP_K
    p = tl.arange(0, P_BLOCK)
    routed = slot < num_pairs
    expert = tl.sum(tl.where(p == slot, ids, 0), 0)  # ids[slot], from the block in registers
    earlier = tl.sum(((ids == expert) & (p < slot)).to(tl.int32), 0)
    pid = tl.where(routed, expert, num_experts + slot - num_pairs)
    return pid, ((earlier == 0) | (slot >= num_pairs)).to(tl.int32)


@triton.jit
def _count_of(ids, pid, num_tokens, num_experts):
    """How many rows program ``pid`` has: its pairs, or every token for a shared slice."""
    routed = tl.sum((ids == pid).to(tl.int32), 0)
    return tl.where(pid >= num_experts, num_tokens, routed)


@triton.jit(do_not_specialize=["num_tokens", "num_experts", "stride_sn", "stride_ssn"])
def _decode_gate_up_kernel(
    x_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, ids_ptr, h_ptr, num_tokens, num_experts, inter, hidden,
    stride_xt, stride_we, stride_wn, stride_wsn, stride_se, stride_sn, stride_ssn, stride_ht,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    ids = _load_ids(ids_ptr, num_tokens, TOP_K, P_BLOCK)
    pid, runs = _expert_of_slot(ids, tl.program_id(0), num_tokens, num_experts, TOP_K, P_BLOCK)
    if runs == 0:
        return
    count = _count_of(ids, pid, num_tokens, num_experts)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    if pid < num_experts:
        w = w_ptr + pid.to(tl.int64) * stride_we
        stride_n = stride_wn.to(tl.int64)
        up = inter * stride_n
    else:  # shared slice s: gate rows s*I.., up rows S*I + s*I..
        stride_n = stride_wsn.to(tl.int64)
        w = ws_ptr + (pid - num_experts).to(tl.int64) * inter * stride_n
        up = SHARED * inter * stride_n
    if W_FP8:  # e4m3 weights, a scale per GROUP_N x GROUP_K block; the tile lies in one
        n0 = tl.program_id(1) * BLOCK_N  # block row (inter spans whole blocks)
        if pid < num_experts:
            scales = s_ptr + pid.to(tl.int64) * stride_se
            gate_scales = scales + (n0 // GROUP_N) * stride_sn
            up_scales = scales + ((inter + n0) // GROUP_N) * stride_sn
        else:  # shared slice s: the block rows of its gate rows s*I.. and up rows S*I + s*I..
            first = (pid - num_experts) * inter + n0
            gate_scales = ss_ptr + (first // GROUP_N) * stride_ssn
            up_scales = ss_ptr + ((SHARED * inter + first) // GROUP_N) * stride_ssn
    dtype = h_ptr.dtype.element_ty
    for chunk in range(0, count, BLOCK_M):
        _, token, row, valid = _rows_of(ids, pid, num_tokens, num_experts, chunk, count,
                                        TOP_K, P_BLOCK, BLOCK_M)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < hidden
            a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w + n[None, :] * stride_n + k[:, None], mask=w_mask, other=0.0)
            wu = tl.load(w + up + n[None, :] * stride_n + k[:, None], mask=w_mask, other=0.0)
            if W_FP8:  # dequantized as dequantize_weight_blocks does: e4m3 x scale, rounded
                wg = (wg.to(tl.float32) * tl.load(gate_scales + k0 // GROUP_K)).to(dtype)
                wu = (wu.to(tl.float32) * tl.load(up_scales + k0 // GROUP_K)).to(dtype)
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
        gate = acc_g.to(dtype).to(tl.float32)
        upv = acc_u.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(h_ptr + row[:, None] * stride_ht + n[None, :], (act * upv).to(dtype),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "num_experts", "stride_sn", "stride_ssn"])
def _decode_down_kernel(
    h_ptr, w_ptr, ws_ptr, s_ptr, ss_ptr, ids_ptr, weights_ptr, y_ptr, num_tokens, num_experts,
    hidden, inter, stride_ht, stride_we, stride_wn, stride_wsn, stride_se, stride_sn, stride_ssn,
    stride_yt,
    TOP_K: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    ids = _load_ids(ids_ptr, num_tokens, TOP_K, P_BLOCK)
    pid, runs = _expert_of_slot(ids, tl.program_id(0), num_tokens, num_experts, TOP_K, P_BLOCK)
    if runs == 0:
        return
    count = _count_of(ids, pid, num_tokens, num_experts)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    if pid < num_experts:
        w = w_ptr + pid.to(tl.int64) * stride_we
        stride_n = stride_wn.to(tl.int64)
    else:  # shared slice s: columns s*I .. (s+1)*I of shared_w2
        w = ws_ptr + (pid - num_experts).to(tl.int64) * inter
        stride_n = stride_wsn.to(tl.int64)
    if W_FP8:  # e4m3 weights: the tile's block row of scales
        n_block = tl.program_id(1) * BLOCK_N // GROUP_N
        if pid < num_experts:
            scales = s_ptr + pid.to(tl.int64) * stride_se + n_block * stride_sn
        else:  # shared slice s: its columns s*I.. start a block column (I: whole k blocks)
            scales = ss_ptr + n_block * stride_ssn + (pid - num_experts) * inter // GROUP_K
    dtype = y_ptr.dtype.element_ty
    for chunk in range(0, count, BLOCK_M):
        pair, _, row, valid = _rows_of(ids, pid, num_tokens, num_experts, chunk, count,
                                       TOP_K, P_BLOCK, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < inter
            a = tl.load(h_ptr + row[:, None] * stride_ht + k[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w + n[None, :] * stride_n + k[:, None],
                        mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if W_FP8:
                b = (b.to(tl.float32) * tl.load(scales + k0 // GROUP_K)).to(dtype)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        routed = pair >= 0
        weight = tl.load(weights_ptr + tl.where(routed, pair, 0), mask=valid & routed, other=1.0)
        out = acc.to(dtype).to(tl.float32)
        out = tl.where(routed[:, None], (out * weight[:, None]).to(dtype).to(tl.float32), out)
        tl.store(y_ptr + row[:, None] * stride_yt + n[None, :], out.to(dtype),
                 mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _decode_combine_kernel(
    y_ptr, out_ptr, num_tokens, hidden, stride_yt, stride_ot,
    TOP_K: tl.constexpr, SHARED: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + j) * stride_yt + n, mask=n_ok, other=0.0).to(tl.float32)
    for s in tl.static_range(SHARED):
        row = num_tokens * TOP_K + s * num_tokens + t
        acc += tl.load(y_ptr + row * stride_yt + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def _check_shared(x, w13, shared_w13, shared_w2) -> int:
    """The number of routed-width slices of the shared expert (0 without one)."""
    if shared_w13 is None and shared_w2 is None:
        return 0
    if shared_w13 is None or shared_w2 is None:
        raise ValueError("shared_w13 and shared_w2 go together: got one of them only")
    hidden, inter = x.shape[1], w13.shape[1] // 2
    for name, w in (("shared_w13", shared_w13), ("shared_w2", shared_w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got {getattr(w, 'shape', type(w))}")
        if w.dtype != x.dtype:
            raise ValueError(f"{name}.dtype is {w.dtype} but x.dtype is {x.dtype}")
        if w.stride(1) != 1:
            raise ValueError(f"{name} must be dense along its last dim, got strides {w.stride()}")
    width = shared_w2.shape[1]
    if shared_w2.shape[0] != hidden or width % inter or width == 0:
        raise ValueError(f"shared_w2 must be [{hidden}, S * {inter}], got {tuple(shared_w2.shape)}")
    if tuple(shared_w13.shape) != (2 * width, hidden):
        raise ValueError(f"shared_w13 must be [{2 * width}, {hidden}], got "
                         f"{tuple(shared_w13.shape)}")
    check_same_device(x=x, shared_w13=shared_w13, shared_w2=shared_w2)
    return width // inter


def _check(x, w13, w2, weights, ids, shared_w13, shared_w2) -> int:
    _check_args(x, w13, w2, weights, ids)
    if x.shape[0] > MAX_DECODE_TOKENS:
        raise ValueError(f"x has {x.shape[0]} tokens, more than the {MAX_DECODE_TOKENS} of "
                         f"the decode path (use moe_experts)")
    return _check_shared(x, w13, shared_w13, shared_w2)


def _p_block(x: torch.Tensor, top_k: int) -> int:
    """The ids block: the token bucket's pairs on a GPU; on the interpreter (nothing
    compiles) the batch's own."""
    tokens = token_bucket(max(1, x.shape[0])) if x.is_cuda else x.shape[0]
    return max(16, triton.next_power_of_2(tokens * top_k))


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def launch_decode_gate_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor,
                          shared_w13: torch.Tensor | None, tiles: DecodeTiles,
                          scales: torch.Tensor | None = None,
                          block: tuple[int, int] = (1, 1),
                          shared_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel 1 on checked inputs (``ids`` contiguous): ``h [T*k + S*T, I]``, SiLU(gate) * up
    of every pair's expert, then of every shared slice per token. ``scales``: ``w13`` is
    e4m3 with a float32 scale per ``block`` (tiles inside blocks), and so is ``shared_w13``
    with ``shared_scales`` where there is one."""
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    shared = 0 if shared_w13 is None else shared_w13.shape[0] // (2 * inter)
    ws13 = w13 if shared_w13 is None else shared_w13  # unused without a shared expert
    h = x.new_empty((tokens * top_k + shared * tokens, inter))
    programs = tokens * top_k + shared  # a slot per pair (its expert's first runs it), the slices
    s13 = w13 if scales is None else scales  # unused without scales
    ss13 = s13 if shared_scales is None else shared_scales  # unused without shared FP8 slices
    _decode_gate_up_kernel[(programs, triton.cdiv(inter, tiles.block_n))](
        x, w13, ws13, s13, ss13, ids, h, tokens, experts, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), ws13.stride(-2), s13.stride(0), s13.stride(1),
        ss13.stride(-2), h.stride(0), TOP_K=top_k, SHARED=shared, P_BLOCK=_p_block(x, top_k), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=_precision(x),
        W_FP8=scales is not None, GROUP_N=block[0], GROUP_K=block[1],
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(x),
    )
    return h


def launch_decode_down(x: torch.Tensor, h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor, shared_w2: torch.Tensor | None,
                       tiles: DecodeTiles, scales: torch.Tensor | None = None,
                       block: tuple[int, int] = (1, 1),
                       shared_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel 2 on checked inputs (``x`` only for its shape and dtype): ``y [T*k + S*T, H]``,
    each pair's expert output times its routing weight, then the shared slices' outputs.
    ``scales`` and ``shared_scales``: ``w2`` and ``shared_w2`` are e4m3, as in kernel 1."""
    tokens, hidden = x.shape
    experts, inter, top_k = w2.shape[0], w2.shape[2], ids.shape[1]
    shared = 0 if shared_w2 is None else shared_w2.shape[1] // inter
    ws2 = w2 if shared_w2 is None else shared_w2
    y = x.new_empty((h.shape[0], hidden))
    s2 = w2 if scales is None else scales  # unused without scales
    ss2 = s2 if shared_scales is None else shared_scales  # unused without shared FP8 slices
    _decode_down_kernel[(tokens * top_k + shared, triton.cdiv(hidden, tiles.block_n))](
        h, w2, ws2, s2, ss2, ids, weights.reshape(-1).contiguous(), y, tokens, experts, hidden,
        inter, h.stride(0), w2.stride(0), w2.stride(1), ws2.stride(-2), s2.stride(0),
        s2.stride(1), ss2.stride(-2), y.stride(0), TOP_K=top_k, P_BLOCK=_p_block(x, top_k), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, DOT_PRECISION=_precision(x),
        W_FP8=scales is not None, GROUP_N=block[0], GROUP_K=block[1],
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl_args(x),
    )
    return y


def moe_experts_decode_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                              weights: torch.Tensor, ids: torch.Tensor, *,
                              shared_w13: torch.Tensor | None = None,
                              shared_w2: torch.Tensor | None = None,
                              config: DecodeTiles | None = None,
                              down_config: DecodeTiles | None = None) -> torch.Tensor:
    """Triton launcher; ``config`` overrides the tiles of both GEMM kernels and
    ``down_config`` those of the down kernel (benchmarks sweep them); else ``decode_tiles``."""
    shared = _check(x, w13, w2, weights, ids, shared_w13, shared_w2)
    tokens, hidden = x.shape
    experts, inter, top_k = w13.shape[0], w13.shape[1] // 2, ids.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    active = min(experts, top_k) + shared
    up_tiles = config or decode_tiles(x, GATE_UP, active, inter, hidden)
    down_tiles = down_config or config or decode_tiles(x, DOWN, active, inter, hidden)
    ids = ids.contiguous()
    h = launch_decode_gate_up(x, w13, ids, shared_w13 if shared else None, up_tiles)
    y = launch_decode_down(x, h, w2, ids, weights, shared_w2 if shared else None, down_tiles)
    out = torch.empty_like(x)
    block = min(1024, max(16, triton.next_power_of_2(hidden)))
    _decode_combine_kernel[(tokens, triton.cdiv(hidden, block))](
        y, out, tokens, hidden, y.stride(0), out.stride(0),
        TOP_K=top_k, SHARED=shared, BLOCK=block, **pdl_args(y),
    )
    return out


def moe_experts_decode_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           weights: torch.Tensor, ids: torch.Tensor, *,
                           shared_w13: torch.Tensor | None = None,
                           shared_w2: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, one (token, choice) pair at a time; the shared expert at its full width."""
    shared = _check(x, w13, w2, weights, ids, shared_w13, shared_w2)
    inter = w13.shape[1] // 2
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = F.linear(x[t:t + 1], w13[e]).split(inter, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])[0]
            acc[t] += (y * weights[t, j]).to(x.dtype).float()
    if shared:
        gate, up = F.linear(x, shared_w13).chunk(2, dim=-1)
        acc += F.linear(F.silu(gate) * up, shared_w2).float()
    return acc.to(x.dtype)


def moe_experts_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                       weights: torch.Tensor, ids: torch.Tensor, *,
                       shared_w13: torch.Tensor | None = None,
                       shared_w2: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts (and the shared one) of a few tokens (see the module doc)."""
    run = moe_experts_decode_triton if use_triton(x) else moe_experts_decode_ref
    return run(x, w13, w2, weights, ids, shared_w13=shared_w13, shared_w2=shared_w2)
