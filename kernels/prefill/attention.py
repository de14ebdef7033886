"""cp_prefill_attention: causal varlen attention for one context-parallel rank's query rows.

The launcher checks the arguments (``reference.py``'s contract), picks a launch config
(``config.py``) and launches the kernel (``kernel.py``) without a host sync: its grid
is an upper bound on the query blocks, so the segment tensors are never read on the
host. The dispatcher ``cp_prefill_attention`` runs Triton for CUDA tensors (or the
opted-in interpreter) and the float32 reference otherwise.

Bounds of the segments (rows inside q and k, page ids inside the pool, rows
disjoint) need the segment data: they are checked when the segment tensors
live on the CPU, and on CUDA only with ``validate=True``, so the per-layer hot
path launches without waiting on the device.
"""

from __future__ import annotations

import torch
import triton
from lanekv.kernels.backend import interpreter_enabled, on_device, use_triton
from lanekv.kernels.prefill.config import (
    AttnLaunchConfig,
    check_launch_config,
    default_config,
    head_dim_split,
    runnable_config,
)
from lanekv.kernels.prefill.kernel import _cp_prefill_attention_kernel
from lanekv.kernels.prefill.reference import (
    AttnOutput,
    AttnSegments,
    check_attention_args,
    check_segment_bounds,
    cp_prefill_attention_ref,
    out_shape,
)
from triton.tools.tensor_descriptor import TensorDescriptor

_LOG2E = 1.4426950408889634

_MAX_GRID_Y = 65535


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")  # 128-byte aligned blocks


def _ensure_tma_scratch() -> None:
    """Descriptors made inside a kernel (the warp-specialized q) live in global scratch
    that Triton takes from ``triton.set_allocator``: a torch allocation unless the
    caller set one (Triton's default refuses to launch)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_tma_scratch)


def kernel_constexprs(config: AttnLaunchConfig, *, heads: int, kv_heads: int, qk_dim: int, v_dim: int,
                      paged: bool, page_size: int, store_lse: bool, num_segments: int, float32: bool,
                      interpret: bool) -> dict:
    """The kernel's compile-time arguments for one launch (the launcher and the offline
    sm_90 compile, ``bench/mla_prefill_compile.py``, take them from here)."""
    split = head_dim_split(qk_dim, v_dim)
    return dict(
        GROUP=heads // kv_heads, PAGED=paged, PAGE_SIZE=page_size if paged else 1,
        STORE_LSE=store_lse, QK_DIM=qk_dim, V_DIM=v_dim, QK_HEAD=split.qk_head,
        QK_TAIL=split.qk_tail, V_BLOCK=split.v_block, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, SEG_BLOCK=max(2, triton.next_power_of_2(num_segments)),
        DOT_PRECISION="ieee" if float32 else "tf32", TMA=config.tma, OVERLAP=config.overlap,
        HEADS_FAST=config.heads_fast, WARP_SPEC=config.warp_specialize, EXP_BF16=config.exp_bf16,
        INTERPRET=interpret)


def launch_cp_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    page_table: torch.Tensor | None,
    page_size: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    config: AttnLaunchConfig,
) -> object | None:
    """Launch on checked arguments with an explicit tile config (tests, sweeps).

    Returns Triton's compiled kernel (registers, spills and shared memory for a sweep's
    record); None when nothing was launched or under the interpreter."""
    check_launch_config(config, q, k, v, page_table)
    num_segments = segments.q_len.shape[0]
    if num_segments == 0 or q.shape[0] == 0:
        return None
    num_slots = triton.cdiv(q.shape[0], config.block_m) + num_segments
    if config.heads_fast and num_slots > _MAX_GRID_Y:
        raise ValueError(f"config.heads_fast=True puts the {num_slots} query blocks on the grid's "
                         f"y axis, which holds at most {_MAX_GRID_Y}; use block_m > {config.block_m}")
    seg = [t.contiguous() for t in segments]
    table = page_table if page_table is not None else seg[3]  # unread when not paged
    lse_arg = lse if lse is not None else out  # unread without STORE_LSE
    split = head_dim_split(q.shape[2], v.shape[2])
    k_desc = k_tail_desc = v_desc = k  # unread without TMA
    if config.warp_specialize and not interpreter_enabled():
        _ensure_tma_scratch()
    if config.tma:
        k_width = (k.shape[1] - 1) * k.stride(1) + k.shape[2]
        v_width = (v.shape[1] - 1) * v.stride(1) + v.shape[2]
        k_desc = TensorDescriptor(k, [k.shape[0], k_width], [k.stride(0), 1],
                                  [config.block_n, split.qk_head])
        if split.qk_tail:
            k_tail_desc = TensorDescriptor(k, [k.shape[0], k_width], [k.stride(0), 1],
                                           [config.block_n, split.qk_tail])
        v_desc = TensorDescriptor(v, [v.shape[0], v_width], [v.stride(0), 1],
                                  [config.block_n, split.v_block])
    grid = (q.shape[1], num_slots) if config.heads_fast else (num_slots, q.shape[1])
    with on_device(q.device):
        return _cp_prefill_attention_kernel[grid](
            q, k, v, out, lse_arg, k_desc, k_tail_desc, v_desc, *seg, num_segments, q.shape[0], table,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            lse.stride(0) if lse is not None else 0, lse.stride(1) if lse is not None else 0,
            table.stride(0) if page_table is not None else 0,
            softmax_scale * _LOG2E,
            **kernel_constexprs(config, heads=q.shape[1], kv_heads=k.shape[1], qk_dim=q.shape[2],
                                v_dim=v.shape[2], paged=page_table is not None, page_size=page_size,
                                store_lse=lse is not None, num_segments=num_segments,
                                float32=q.dtype == torch.float32, interpret=interpreter_enabled()),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )


def cp_prefill_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    *,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor | AttnOutput:
    """Triton launcher; see the module docstring for when bounds are checked."""
    check_attention_args(q, k, v, segments, softmax_scale, page_table, page_size, out, return_lse, lse_out)
    if validate or not segments.q_len.is_cuda:
        check_segment_bounds(q, k, segments, page_table, page_size)
    if out is None:
        out = q.new_empty(out_shape(q, v))
    lse = None
    if return_lse:
        lse = lse_out if lse_out is not None else q.new_empty(q.shape[:2], dtype=torch.float32)
    config = runnable_config(default_config(q), q, k, v, page_table)
    launch_cp_prefill_attention(q, k, v, segments, float(softmax_scale), page_table, page_size,
                                out, lse, config)
    return AttnOutput(out, lse) if return_lse else out


def cp_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: AttnSegments,
    softmax_scale: float,
    *,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    lse_out: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor | AttnOutput:
    """Dispatch: Triton for CUDA tensors (or the opted-in interpreter), else the reference."""
    op = cp_prefill_attention_triton if use_triton(q) else cp_prefill_attention_ref
    return op(q, k, v, segments, softmax_scale, page_table=page_table, page_size=page_size,
              out=out, return_lse=return_lse, lse_out=lse_out, validate=validate)
