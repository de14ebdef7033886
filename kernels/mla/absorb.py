"""The absorbed MLA form's projections: q_nope into the latent space, the output out of it.

The paged MLA decode (``kernels/mla/paged_decode.py``) scores queries in the latent
space: ``mla_absorb_query`` multiplies q_nope by kv_b_proj's K part and appends q_pe,
and ``mla_expand_output`` takes the latent output back through kv_b_proj's V part.
Decode batches up to ``MAX_PROJECTION_TOKENS`` take one Triton launch each; larger
ones (DSA's sparse prefill) the batched GEMMs of the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.mla.latent_rows import MAX_KV_LORA_RANK, MAX_ROPE_DIM
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Decode batches up to this many tokens take the Triton projections below; larger ones
# (DSA's sparse prefill) the batched GEMMs of the references.
MAX_PROJECTION_TOKENS = 64


@triton.jit(do_not_specialize=["num_tokens"])
def _absorb_query_kernel(
    q_ptr, w_ptr, out_ptr, num_tokens,
    stride_qt, stride_qh, stride_wh, stride_wd, stride_ot, stride_oh,
    NOPE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    q_head = q_ptr + h * stride_qh
    o_head = out_ptr + h * stride_oh
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        acc = tl.zeros([BLOCK_T, BLOCK_R], tl.float32)
        for d0 in range(0, NOPE, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            d_ok = d < NOPE
            a = tl.load(q_head + t[:, None].to(tl.int64) * stride_qt + d[None, :],
                        mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.load(w_ptr + h * stride_wh + d[:, None] * stride_wd + r[None, :],
                        mask=d_ok[:, None] & r_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        tl.store(o_head + t[:, None].to(tl.int64) * stride_ot + r[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & r_ok[None, :])
        if tl.program_id(1) == 0:  # q_pe goes after the latent part as it is
            p = tl.arange(0, BLOCK_P)
            p_ok = p < ROPE
            pe = tl.load(q_head + t[:, None].to(tl.int64) * stride_qt + NOPE + p[None, :],
                         mask=t_ok[:, None] & p_ok[None, :], other=0.0)
            tl.store(o_head + t[:, None].to(tl.int64) * stride_ot + RANK + p[None, :], pe,
                     mask=t_ok[:, None] & p_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens"])
def _expand_output_kernel(
    o_ptr, w_ptr, out_ptr, num_tokens,
    stride_ot, stride_oh, stride_wh, stride_wv, stride_yt, stride_yh,
    RANK: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V_DIM
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < num_tokens
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for r0 in range(0, RANK, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            r_ok = r < RANK
            a = tl.load(o_ptr + t[:, None].to(tl.int64) * stride_ot + h * stride_oh + r[None, :],
                        mask=t_ok[:, None] & r_ok[None, :], other=0.0)
            w = tl.load(w_ptr + h * stride_wh + v[None, :] * stride_wv + r[:, None],
                        mask=r_ok[:, None] & v_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        tl.store(out_ptr + t[:, None].to(tl.int64) * stride_yt + h * stride_yh + v[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])


def _check_projection(name: str, x: torch.Tensor, w: torch.Tensor, w_name: str, x_dim: int,
                      w_shape: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be a 3-D tensor [T, H, {x_dim}] of {_DTYPES}, got "
                         f"{getattr(x, 'shape', type(x))} {getattr(x, 'dtype', '')}")
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.shape[0] != x.shape[1]:
        raise ValueError(f"{w_name} must be a 3-D tensor {w_shape} with {name}'s "
                         f"{x.shape[1]} heads, got {getattr(w, 'shape', type(w))}")
    if w.dtype != x.dtype:
        raise ValueError(f"{w_name}.dtype is {w.dtype} but {name}.dtype is {x.dtype}")
    for n, t in ((name, x), (w_name, w)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{n} must have a dense last dim, got strides {t.stride()}")
    check_same_device(**{name: x, w_name: w})


def _check_absorb(q, w_k) -> None:
    _check_projection("q", q, w_k, "w_k", "D + P", "[H, D, R]")
    if not 1 <= w_k.shape[1] <= q.shape[2]:
        raise ValueError(f"w_k has {w_k.shape[1]} rows per head (qk_nope), more than q's "
                         f"{q.shape[2]} values")
    if q.shape[2] - w_k.shape[1] > MAX_ROPE_DIM or w_k.shape[2] > MAX_KV_LORA_RANK:
        raise ValueError(f"w_k {tuple(w_k.shape)} and q {tuple(q.shape)}: at most "
                         f"{MAX_KV_LORA_RANK} latent and {MAX_ROPE_DIM} RoPE values")


def _check_expand(o_latent, w_v) -> None:
    _check_projection("o_latent", o_latent, w_v, "w_v", "R", "[H, V, R]")
    if w_v.shape[2] != o_latent.shape[2]:
        raise ValueError(f"w_v rows have {w_v.shape[2]} values but o_latent has "
                         f"{o_latent.shape[2]}")


def mla_absorb_query_triton(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    _check_absorb(q, w_k)
    tokens, heads, width = q.shape
    nope, rank = w_k.shape[1], w_k.shape[2]
    rope = width - nope
    out = q.new_empty((tokens, heads, rank + rope))
    if out.numel() == 0:
        return out
    block_r = 64 if q.is_cuda else 16
    _absorb_query_kernel[(heads, triton.cdiv(rank, block_r))](
        q, w_k, out, tokens,
        q.stride(0), q.stride(1), w_k.stride(0), w_k.stride(1), out.stride(0), out.stride(1),
        NOPE=nope, RANK=rank, ROPE=rope, BLOCK_T=16, BLOCK_D=64 if q.is_cuda else 16,
        BLOCK_R=block_r, BLOCK_P=max(16, triton.next_power_of_2(max(rope, 1))),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
        num_stages=2, **pdl_args(q),
    )
    return out


def mla_absorb_query_ref(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    _check_absorb(q, w_k)
    q_nope, q_pe = q.split([w_k.shape[1], q.shape[2] - w_k.shape[1]], dim=-1)
    return torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_k), q_pe), dim=-1)


def mla_absorb_query(q: torch.Tensor, w_k: torch.Tensor) -> torch.Tensor:
    """``q [T, H, D + P]`` (q_nope, then q_pe) and kv_b_proj's K part ``w_k [H, D, R]`` ->
    ``[T, H, R + P]``: q_nope through ``w_k`` into the latent space, then q_pe. One launch
    for a decode batch (the batched GEMM, transposes and concatenation otherwise)."""
    small = q.shape[0] <= MAX_PROJECTION_TOKENS if isinstance(q, torch.Tensor) else False
    return (mla_absorb_query_triton if small and use_triton(q) else mla_absorb_query_ref)(q, w_k)


def mla_expand_output_triton(o_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    _check_expand(o_latent, w_v)
    tokens, heads, rank = o_latent.shape
    v_dim = w_v.shape[1]
    out = o_latent.new_empty((tokens, heads, v_dim))
    if out.numel() == 0:
        return out
    # On the GPU: 32 columns per program, 16 where that leaves SMs idle (few heads).
    block_v = 32 if o_latent.is_cuda and heads * triton.cdiv(v_dim, 32) >= 128 else 16
    _expand_output_kernel[(heads, triton.cdiv(v_dim, block_v))](
        o_latent, w_v, out, tokens,
        o_latent.stride(0), o_latent.stride(1), w_v.stride(0), w_v.stride(1),
        out.stride(0), out.stride(1),
        RANK=rank, V_DIM=v_dim, BLOCK_T=16, BLOCK_R=128 if o_latent.is_cuda else 16,
        BLOCK_V=block_v, DOT_PRECISION="ieee" if o_latent.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2, **pdl_args(o_latent),
    )
    return out


def mla_expand_output_ref(o_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    _check_expand(o_latent, w_v)
    return torch.einsum("thr,hvr->thv", o_latent, w_v)


def mla_expand_output(o_latent: torch.Tensor, w_v: torch.Tensor) -> torch.Tensor:
    """Attention output in the latent space ``o_latent [T, H, R]`` through kv_b_proj's V
    part ``w_v [H, V, R]`` -> ``[T, H, V]``, contiguous (o_proj reads it as ``[T, H*V]``
    without a copy). One launch for a decode batch."""
    small = o_latent.shape[0] <= MAX_PROJECTION_TOKENS if isinstance(o_latent, torch.Tensor) else False
    run = mla_expand_output_triton if small and use_triton(o_latent) else mla_expand_output_ref
    return run(o_latent, w_v)
