"""merge_mla_partials: stage 2 of a split MLA decode, the partials' softmax-weighted merge.

Shared by the dense (``kernels/mla/paged_decode.py``) and the sparse (DSA,
``kernels/dsa/sparse_mla.py``) decode kernels: each split wrote a float32 partial
output and its log2-sum-exp; one program per (head, request, block of latent columns)
merges them into the output. With the dense kernel's ``busy`` lengths it reads only
the busy splits (``kernels/mla/splits.py``), and leaves alone a request whose one
split wrote its output directly, so at short contexts it is a launch that exits.
Small decode batches skip it: the expansion merges as it loads
(``kernels/mla/expand_merge.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.mla.splits import _busy_splits
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait


@triton.jit(do_not_specialize=["num_splits", "max_kv_len", "split_keys"])
def _mla_decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, lens_ptr, num_heads, num_splits, max_kv_len, split_keys,
    stride_ob, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, HAS_LENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    first = (b * num_heads + h) * num_splits
    if HAS_LENS:  # the dense kernel's partials: only its busy splits wrote any
        seq_len = tl.minimum(tl.load(lens_ptr + b), max_kv_len)
        used, _ = _busy_splits(seq_len, num_splits, split_keys, BLOCK_N)
        fewest = 2  # one busy split: stage 1 wrote the output
    else:  # every split wrote its lse (-inf: no keys, its o unwritten)
        used = num_splits
        fewest = 1
    if used >= fewest:
        s = tl.arange(0, BLOCK_S)
        top = tl.full([BLOCK_S], float("-inf"), tl.float32)
        for s0 in range(0, used, BLOCK_S):
            top = tl.maximum(top, tl.load(part_lse_ptr + first + s0 + s, mask=s0 + s < used,
                                          other=float("-inf")))
        top_all = tl.max(top, 0)
        top_all = tl.where(top_all > float("-inf"), top_all, 0.0)  # all empty: weights 0
        r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # this program's latent columns
        r_ok = r < RANK
        acc = tl.zeros([BLOCK_R], tl.float32)
        total = tl.zeros([BLOCK_S], tl.float32)
        for s0 in range(0, used, BLOCK_S):
            lse = tl.load(part_lse_ptr + first + s0 + s, mask=s0 + s < used, other=float("-inf"))
            weight = tl.exp2(lse - top_all)  # 0 past the used splits and for an empty one
            o = tl.load(part_o_ptr + (first + s0 + s)[:, None] * RANK + r[None, :],
                        mask=(weight > 0.0)[:, None] & r_ok[None, :], other=0.0)
            acc += tl.sum(weight[:, None] * o, 0)
            total += weight
        norm = tl.sum(total, 0)
        merged = acc / tl.where(norm > 0.0, norm, 1.0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + r,
                 merged.to(out_ptr.dtype.element_ty), mask=r_ok)


def merge_mla_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, *,
                       busy: tuple[torch.Tensor, int, int, int] | None = None) -> None:
    """Stage 2 of a split decode: ``part_o [B, H, S, R]`` float32 partial outputs and
    ``part_lse [B, H, S]`` their log2-sum-exp (``-inf`` for a split without keys, whose
    ``o`` is never read) -> ``out [B, H, R]`` (any strides but a dense last dim), the
    softmax-weighted merge. Shared by the dense and the sparse (DSA) MLA decode kernels.
    ``busy = (seq_lens, max_kv_len, split_keys, block_n)`` (the dense kernel's): request
    ``b`` wrote only its ``busy_splits`` partials, and none (its output is written
    already) when that is one."""
    batch, heads, splits, rank = part_o.shape
    lens, max_kv_len, split_keys, block_n = busy if busy is not None else (part_lse, 0, 1, 1)
    # Columns of the latent cut over programs too, so that a long context's many partials
    # (264 splits x 2 KiB per head at batch 1) stream through several SMs per head.
    block_r = min(128, max(16, triton.next_power_of_2(rank))) if part_o.is_cuda else 16
    # 32 splits a loop step on the GPU: each step's loads wait on the one before, and the
    # sparse kernel at batch 1 writes 32 ([32, 128] float32 is 32 registers a thread at 4
    # warps). Fixed, not by split count: a warm-up's split count compiles the step's merge.
    block_s = 32 if part_o.is_cuda else 8
    _mla_decode_merge_kernel[(heads, batch, triton.cdiv(rank, block_r))](
        part_o, part_lse, out, lens, heads, splits, max_kv_len, split_keys, out.stride(0),
        out.stride(1), RANK=rank, BLOCK_R=block_r, BLOCK_S=block_s,
        HAS_LENS=busy is not None, BLOCK_N=block_n, **pdl_args(out),
    )
