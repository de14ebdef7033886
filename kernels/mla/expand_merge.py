"""mla_expand_partials: the split decode's merge folded into the output's expansion.

The absorbed MLA decode ends in two steps: the split partials merged into the
latent output ``[B, H, R]`` (``merge_mla_partials``), then that output through
kv_b_proj's V part ``w_v [H, V, R]`` (``mla_expand_output``). Here the expansion
reads stage 1's ``MLAPartials`` directly: each program (head, block of V columns)
merges the latent columns it multiplies as it loads them, softmax-weighted by the
busy splits' log2-sum-exps, so the merge is no launch (nor graph node) of its own.
A request whose keys
fit one split reads stage 1's direct output instead. Without partials (one split)
the plain expansion runs, reading ``out`` as before.

A program (head, 16 V columns) reads its columns of ``w_v`` once, then for each
token loads a chunk of busy splits across the whole latent row in one go (32 splits
x 512 float32 over 8 warps: a 1k-token request at batch 1 is two chunks), merges
them with a running maximum and multiplies the merged row by its columns: a few
memory round trips per token, where a loop over splits and column blocks would
wait on one per (split, block). Tokens run one after another, so only batches of up
to ``FUSED_MERGE_MAX_TOKENS`` take it (shape-only, as a CUDA graph needs); larger
ones merge with the standalone kernel, then expand. Every program of a head merges
the head's whole latent: the partials are reread once per block of V columns, from
L2 (they were just written). The merged row is rounded to the model dtype before the
product, as the standalone merge rounds its output, so the two paths differ only in
the float32 sums' order. Lengths are read on the device: capturable at any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.mla.absorb import (
    mla_expand_output,
    mla_expand_output_ref,
    mla_expand_output_triton,
)
from lanekv.kernels.mla.merge import merge_mla_partials
from lanekv.kernels.mla.paged_decode import MLAPartials
from lanekv.kernels.mla.splits import _busy_splits, busy_splits_ref
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

# Tokens run one after another in a program (each a few memory round trips: its length,
# its partials, the product), so larger decode batches take the standalone merge, whose
# grid spreads (head, request, columns) over the SMs, then the tiled expansion.
FUSED_MERGE_MAX_TOKENS = 8


@triton.jit(do_not_specialize=["num_tokens", "num_splits", "max_kv_len", "split_keys"])
def _expand_partials_kernel(
    direct_ptr, part_o_ptr, part_lse_ptr, lens_ptr, w_ptr, out_ptr,
    num_tokens, num_heads, num_splits, max_kv_len, split_keys,
    stride_dt, stride_dh, stride_wh, stride_wv, stride_yt, stride_yh,
    RANK: tl.constexpr, V_DIM: tl.constexpr, KEY_BLOCK: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v < V_DIM
    r = tl.arange(0, BLOCK_R)  # the whole latent row: one load per chunk of splits
    r_ok = r < RANK
    s = tl.arange(0, BLOCK_S)
    # [BLOCK_R, BLOCK_V]: this program's columns of the head's V part, read once
    w = tl.load(w_ptr + h * stride_wh + v[None, :] * stride_wv + r[:, None],
                mask=r_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
    for t in range(0, num_tokens):
        seq_len = tl.minimum(tl.load(lens_ptr + t), max_kv_len)
        used, _ = _busy_splits(seq_len, num_splits, split_keys, KEY_BLOCK)
        if used > 1:
            # The busy splits merged chunk by chunk with a running maximum (every busy
            # split has keys, so each chunk's maximum is finite).
            first = (t * num_heads + h) * num_splits
            top = tl.full([], float("-inf"), tl.float32)
            total = tl.zeros([], tl.float32)
            a = tl.zeros([BLOCK_R], tl.float32)
            for s0 in range(0, used, BLOCK_S):
                s_ok = s0 + s < used
                lse = tl.load(part_lse_ptr + first + s0 + s, mask=s_ok, other=float("-inf"))
                o = tl.load(part_o_ptr + (first + s0 + s)[:, None] * RANK + r[None, :],
                            mask=s_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_R]
                new_top = tl.maximum(top, tl.max(lse, 0))
                keep = tl.exp2(top - new_top)
                weight = tl.exp2(lse - new_top)  # 0 past the busy splits
                a = a * keep + tl.sum(weight[:, None] * o, 0)
                total = total * keep + tl.sum(weight, 0)
                top = new_top
            a = a / total
        else:  # stage 1 wrote this request's output (zeros for an empty one)
            a = tl.load(direct_ptr + t * stride_dt + h * stride_dh + r, mask=r_ok,
                        other=0.0).to(tl.float32)
        # rounded to the model dtype as the standalone merge's output is
        a = a.to(w_ptr.dtype.element_ty).to(tl.float32)
        y = tl.sum(a[:, None] * w, 0)  # [BLOCK_V]
        tl.store(out_ptr + t * stride_yt + h * stride_yh + v, y.to(out_ptr.dtype.element_ty),
                 mask=v_ok)


def _check_args(parts: MLAPartials, w_v: torch.Tensor) -> None:
    """ValueError naming the field; ``mla_expand_output``'s checks cover ``out`` and ``w_v``."""
    if not isinstance(parts, MLAPartials):
        raise ValueError(f"parts must be MLAPartials, got {type(parts).__name__}")
    out = parts.out
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise ValueError(f"parts.out must be a 3-D tensor [B, H, R], got "
                         f"{getattr(out, 'shape', type(out))}")
    if not isinstance(w_v, torch.Tensor) or w_v.dim() != 3 or w_v.shape[0] != out.shape[1] \
            or w_v.shape[2] != out.shape[2] or w_v.dtype != out.dtype or w_v.stride(2) != 1:
        raise ValueError(f"w_v must be a {out.dtype} [H={out.shape[1]}, V, R={out.shape[2]}] "
                         f"tensor with a dense last dim, got {getattr(w_v, 'dtype', type(w_v))} "
                         f"{tuple(getattr(w_v, 'shape', ()))}")
    if out.shape[2] > 1 and out.stride(2) != 1:
        raise ValueError(f"parts.out must have a dense last dim, got strides {out.stride()}")
    if parts.part_o is None:
        if parts.part_lse is not None or parts.busy is not None:
            raise ValueError("parts.part_lse and parts.busy must be None without parts.part_o")
        return
    batch, heads, rank = out.shape
    part_o, part_lse = parts.part_o, parts.part_lse
    if not isinstance(part_o, torch.Tensor) or part_o.dtype != torch.float32 or part_o.dim() != 4 \
            or part_o.shape[:2] != (batch, heads) or part_o.shape[3] != rank \
            or not part_o.is_contiguous():
        raise ValueError(f"parts.part_o must be a contiguous float32 [{batch}, {heads}, S, {rank}] "
                         f"tensor, got {getattr(part_o, 'dtype', type(part_o))} "
                         f"{tuple(getattr(part_o, 'shape', ()))}")
    if not isinstance(part_lse, torch.Tensor) or part_lse.dtype != torch.float32 \
            or tuple(part_lse.shape) != tuple(part_o.shape[:3]) or not part_lse.is_contiguous():
        raise ValueError(f"parts.part_lse must be a contiguous float32 {list(part_o.shape[:3])} "
                         f"tensor, got {tuple(getattr(part_lse, 'shape', ()))}")
    busy = parts.busy
    if not isinstance(busy, tuple) or len(busy) != 4 or not isinstance(busy[0], torch.Tensor) \
            or busy[0].shape != (batch,) or busy[0].dtype != torch.int32 \
            or not all(isinstance(x, int) and x >= low for x, low in zip(busy[1:], (0, 1, 1))):
        raise ValueError(f"parts.busy must be (seq_lens [{batch}] int32, max_kv_len >= 0, "
                         f"split_keys > 0, block_n > 0), got {busy!r:.120}")
    check_same_device(out=out, w_v=w_v, part_o=part_o, part_lse=part_lse, seq_lens=busy[0])


def mla_expand_partials_triton(parts: MLAPartials, w_v: torch.Tensor) -> torch.Tensor:
    _check_args(parts, w_v)
    if parts.part_o is None:  # one split: stage 1 wrote every output
        return mla_expand_output_triton(parts.out, w_v)
    direct, (lens, max_kv_len, split_keys, key_block) = parts.out, parts.busy
    tokens, heads, rank = direct.shape
    v_dim = w_v.shape[1]
    out = direct.new_empty((tokens, heads, v_dim))
    if out.numel() == 0:
        return out
    block_r = max(16, triton.next_power_of_2(rank))
    _expand_partials_kernel[(heads, triton.cdiv(v_dim, 16))](
        direct, parts.part_o, parts.part_lse, lens, w_v, out,
        tokens, heads, parts.part_o.shape[2], max_kv_len, split_keys,
        direct.stride(0), direct.stride(1), w_v.stride(0), w_v.stride(1),
        out.stride(0), out.stride(1),
        RANK=rank, V_DIM=v_dim, KEY_BLOCK=key_block,
        # a chunk of splits x the whole row in one load: 16k float32 over 8 warps
        BLOCK_S=max(2, min(32, 16384 // block_r)), BLOCK_R=block_r, BLOCK_V=16,
        num_warps=8, **pdl_args(w_v),
    )
    return out


def merged_latent_ref(parts: MLAPartials) -> torch.Tensor:
    """``[B, H, R]`` in the model dtype: each request's busy splits merged in float32 (its
    direct output where it has at most one), as ``merge_mla_partials`` writes it."""
    if parts.part_o is None:
        return parts.out
    lens, max_kv_len, split_keys, block_n = parts.busy
    merged = parts.out.clone()
    for b, seq_len in enumerate(lens.tolist()):
        used = busy_splits_ref(min(seq_len, max_kv_len), parts.part_o.shape[2], split_keys,
                               block_n)[0]
        if used > 1:
            lse = parts.part_lse[b, :, :used]  # [H, used]
            weight = torch.exp2(lse - lse.amax(-1, keepdim=True))
            o = (weight[..., None] * parts.part_o[b, :, :used]).sum(1) / weight.sum(-1)[:, None]
            merged[b] = o.to(merged.dtype)
    return merged


def mla_expand_partials_ref(parts: MLAPartials, w_v: torch.Tensor) -> torch.Tensor:
    """The merge in plain torch (``merged_latent_ref``), then ``mla_expand_output_ref``."""
    _check_args(parts, w_v)
    return mla_expand_output_ref(merged_latent_ref(parts), w_v)


def mla_expand_partials(parts: MLAPartials, w_v: torch.Tensor) -> torch.Tensor:
    """Stage 1's ``parts`` merged and through kv_b_proj's V part ``w_v [H, V, R]`` ->
    ``[B, H, V]``, contiguous: one launch for a decode batch of up to
    ``FUSED_MERGE_MAX_TOKENS``; larger ones merge (``merge_mla_partials``), then expand."""
    if not use_triton(parts.out):
        return mla_expand_partials_ref(parts, w_v)
    if parts.part_o is not None and parts.out.shape[0] > FUSED_MERGE_MAX_TOKENS:
        merge_mla_partials(parts.part_o, parts.part_lse, parts.out, busy=parts.busy)
        return mla_expand_output(parts.out, w_v)
    return mla_expand_partials_triton(parts, w_v)
