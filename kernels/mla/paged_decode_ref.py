"""The paged MLA decode's argument checks and its plain-torch reference.

``paged_mla_decode_attention_ref`` has the launcher's signature
(``kernels/mla/paged_decode.py``) and runs one request at a time in float32; both
validate every argument here first (``ValueError`` naming it). On CPU the lengths and
the page ids they reach are range-checked; on CUDA the kernel clamps lengths to the
page table's width and trusts the page ids (a check would wait on the device).
"""

from __future__ import annotations

import math

import torch
from lanekv.kernels.backend import check_same_device
from lanekv.kernels.kv_layout import check_page_table
from lanekv.kernels.mla.latent_rows import (
    MAX_KV_LORA_RANK,
    MAX_ROPE_DIM,
    check_latent_cache,
    dequantized_latent,
    latent_out,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_paged_decode_args(q, latent_cache, page_table, seq_lens, page_size, softmax_scale,
                            kv_lora_rank, out, num_splits) -> torch.Tensor:
    """Validate every argument (ValueError naming it); returns ``out``, allocated if None."""
    for name, t, dims in (("q", q, "[B, H, R+P]"), ("latent_cache", latent_cache, "[rows, R+P]")):
        want_dim = 3 if name == "q" else 2
        if not isinstance(t, torch.Tensor) or t.dim() != want_dim:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a {want_dim}-D tensor {dims}, got {shape}")
        fp8_rows = name == "latent_cache" and t.dtype == torch.uint8  # FP8 latent rows
        if t.dtype not in _DTYPES and not fp8_rows:
            raise ValueError(f"{name}.dtype must be one of {_DTYPES} (or uint8 FP8 rows for "
                             f"latent_cache), got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a dense last dim, got strides {t.stride()}")
    batch, heads, width = q.shape
    check_latent_cache(latent_cache, q, kv_lora_rank)
    # A latent row is R values and then P >= 1 RoPE values (DESIGN.md, MLA pages).
    if not _is_int(kv_lora_rank) or not 1 <= kv_lora_rank <= min(width - 1, MAX_KV_LORA_RANK):
        raise ValueError(f"kv_lora_rank must be an int in [1, {min(width - 1, MAX_KV_LORA_RANK)}] "
                         f"(q.shape[2] = {width}), got {kv_lora_rank!r}")
    if width - kv_lora_rank > MAX_ROPE_DIM:
        raise ValueError(f"q.shape[2] - kv_lora_rank = {width - kv_lora_rank} RoPE dims, "
                         f"more than {MAX_ROPE_DIM}")
    if not isinstance(page_table, torch.Tensor) or page_table.dim() != 2 or (
        page_table.dtype != torch.int32
    ):
        raise ValueError(f"page_table must be a 2-D int32 tensor, got {page_table!r:.80}")
    if page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must have a dense last dim, got strides {page_table.stride()}")
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.dim() != 1 or (
        seq_lens.dtype != torch.int32
    ):
        raise ValueError(f"seq_lens must be a 1-D int32 tensor, got {seq_lens!r:.80}")
    if not _is_int(page_size) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if (isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float))
            or not math.isfinite(softmax_scale) or softmax_scale <= 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    if num_splits is not None and (not _is_int(num_splits) or num_splits < 1):
        raise ValueError(f"num_splits must be None or a positive int, got {num_splits!r}")
    check_same_device(q=q, latent_cache=latent_cache, page_table=page_table, seq_lens=seq_lens,
                      out=out)
    rows = latent_cache.shape[0]
    if rows % page_size != 0:
        raise ValueError(f"latent_cache has {rows} rows, not a multiple of page_size {page_size}")
    if seq_lens.shape[0] != batch or page_table.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries and page_table "
                         f"{page_table.shape[0]} rows, but q has batch {batch}")
    out = latent_out(q, out, (batch, heads, kv_lora_rank))
    if not seq_lens.is_cuda and batch > 0:
        check_page_table(page_table, seq_lens, page_size, rows // page_size, "latent_cache")
    return out


def paged_mla_decode_attention_ref(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    softmax_scale: float,
    kv_lora_rank: int,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain torch, one request at a time in float32; ``num_splits`` has no effect here."""
    out = check_paged_decode_args(q, latent_cache, page_table, seq_lens, page_size, softmax_scale,
                                  kv_lora_rank, out, num_splits)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            out[b] = 0
            continue
        t = torch.arange(seq_len, device=q.device)
        rows = page_table[b, t // page_size].to(torch.int64) * page_size + t % page_size
        latent = dequantized_latent(latent_cache, rows, kv_lora_rank, q.shape[2] - kv_lora_rank,
                                    q.dtype).float()  # [seq_len, R+P]
        probs = (q[b].float() @ latent.T * softmax_scale).softmax(dim=-1)  # [H, seq_len]
        out[b] = (probs @ latent[:, :kv_lora_rank]).to(out.dtype)
    return out
