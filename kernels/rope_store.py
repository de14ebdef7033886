"""rope_store_kv: RoPE on a step's q and k fused with the store of k and v.

``q [T, Hq, D]``, ``k, v [T, Hkv, D]`` (RoPE not yet applied) and ``cos, sin
[T, D]`` (non-interleaved halves, as ``model.llama.apply_rotary`` takes them):
returns the rotated q as a new ``[T, Hq, D]`` tensor and writes the rotated k
and the unchanged v to ``k_cache[locs[t]]`` / ``v_cache[locs[t]]``. A row with
``loc < 0`` writes nothing (compute-padding rows); on CUDA a loc ``>= R`` is
dropped too (no range check without a sync), on CPU it is refused. With
``kv_out [T, 2, Hkv, D]`` (a CP prefill's block of new rows) it also writes
every row's rotated k to ``kv_out[t, 0]`` and its v to ``kv_out[t, 1]``,
whatever its loc.

One program per (token, head) of the Hq + Hkv heads. The kernel rotates in
float32 and rounds once, so its output can differ from the torch reference
(which rounds after each op in the model dtype) by one unit in the last place.

``mla_rope(q_pe, k_pe, cos, sin, interleave)`` is DeepSeek MLA's RoPE, in place
and in one launch: ``q_pe [T, H, P]`` (the RoPE part of the projected queries,
a strided view) and ``k_pe [T, P]`` (the shared key's part of the compressed
KV) rotated in float32 by ``cos, sin [T, P/2]`` float32 (YaRN's scale
included), pairs ``(x[2i], x[2i+1])`` when ``interleave`` else halves, the
result laid out as the rotated first members then the second ones
(``rope_pairs``, transformers' order), rounded once to the model dtype.
``k_pe=None`` rotates the queries only (FP8 latent rows rotate the key as they
store it: ``kernels/fp8/rope_store.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait
from lanekv.kernels.store_kv import store_kv_ref

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit(do_not_specialize=["num_tokens"])
def _rope_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, locs_ptr, qo_ptr, kvo_ptr,
    num_tokens, num_rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kcr, stride_kch, stride_vcr, stride_vch, stride_qot, stride_qoh,
    stride_ot, stride_op, stride_oh,
    NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, WRITE_KV: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    c1 = tl.load(cos_ptr + t * stride_ct + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_st + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_st + HALF + d, mask=ok, other=0.0).to(tl.float32)
    if head < NUM_Q_HEADS:
        src = q_ptr + t * stride_qt + head * stride_qh
        x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
        dst = qo_ptr + t * stride_qot + head * stride_qoh
        tl.store(dst + d, (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty), mask=ok)
    else:
        kv_head = head - NUM_Q_HEADS
        loc = tl.load(locs_ptr + t)
        cached = (loc >= 0) & (loc < num_rows)
        if cached | WRITE_KV:
            src = k_ptr + t * stride_kt + kv_head * stride_kh
            x1 = tl.load(src + d, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + d, mask=ok, other=0.0).to(tl.float32)
            k1 = (x1 * c1 - x2 * s1).to(kc_ptr.dtype.element_ty)
            k2 = (x2 * c2 + x1 * s2).to(kc_ptr.dtype.element_ty)
            v_src = v_ptr + t * stride_vt + kv_head * stride_vh
            v1 = tl.load(v_src + d, mask=ok, other=0.0)
            v2 = tl.load(v_src + HALF + d, mask=ok, other=0.0)
            if cached:
                dst = kc_ptr + loc * stride_kcr + kv_head * stride_kch
                tl.store(dst + d, k1, mask=ok)
                tl.store(dst + HALF + d, k2, mask=ok)
                v_dst = vc_ptr + loc * stride_vcr + kv_head * stride_vch
                tl.store(v_dst + d, v1, mask=ok)
                tl.store(v_dst + HALF + d, v2, mask=ok)
            if WRITE_KV:
                row = kvo_ptr + t * stride_ot + kv_head * stride_oh
                tl.store(row + d, k1, mask=ok)
                tl.store(row + HALF + d, k2, mask=ok)
                tl.store(row + stride_op + d, v1, mask=ok)
                tl.store(row + stride_op + HALF + d, v2, mask=ok)


def _check_args(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out=None) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor, got {getattr(t, 'shape', type(t))}")
        if t.dtype not in _DTYPES or t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype is {t.dtype}; all must be q's dtype {q.dtype} "
                             f"(one of {_DTYPES})")
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(f"{name} must have a dense head_dim, got strides {t.stride()}")
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"[{num_tokens}, Hkv, {head_dim}]")
    if k_cache.shape != v_cache.shape or k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must be "
                         f"[R, {k.shape[1]}, {head_dim}]")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.shape != (num_tokens, head_dim) or (
            t.dtype != q.dtype
        ) or (head_dim > 1 and t.stride(1) != 1):
            raise ValueError(f"{name} must be a dense {q.dtype} [{num_tokens}, {head_dim}] tensor, "
                             f"got {getattr(t, 'shape', type(t))}")
    if not isinstance(locs, torch.Tensor) or locs.shape != (num_tokens,) or (
        locs.dtype != torch.int64
    ):
        raise ValueError(f"locs must be a [{num_tokens}] int64 tensor, got "
                         f"{getattr(locs, 'shape', type(locs))}")
    check_same_device(q=q, k=k, v=v, cos=cos, sin=sin, k_cache=k_cache, v_cache=v_cache, locs=locs)
    if kv_out is not None:
        want = (num_tokens, 2, *k.shape[1:])
        if not isinstance(kv_out, torch.Tensor) or tuple(kv_out.shape) != want or kv_out.dtype != q.dtype \
                or (head_dim > 1 and kv_out.stride(3) != 1):
            raise ValueError(f"kv_out must be a {q.dtype} {list(want)} tensor with a dense head_dim, got "
                             f"{getattr(kv_out, 'shape', type(kv_out))}")
        check_same_device(q=q, kv_out=kv_out)
    if not locs.is_cuda and num_tokens and int(locs.max()) >= k_cache.shape[0]:
        raise ValueError(f"locs holds {int(locs.max())}, beyond the {k_cache.shape[0]} cache rows")


def rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out=None) -> torch.Tensor:
    _check_args(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return out
    half = head_dim // 2
    rows = out if kv_out is None else kv_out  # unread without WRITE_KV
    _rope_store_kv_kernel[(num_tokens, num_q_heads + k.shape[1])](
        q, k, v, cos, sin, k_cache, v_cache, locs, out, rows, num_tokens, k_cache.shape[0],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        *((0, 0, 0) if kv_out is None else (kv_out.stride(0), kv_out.stride(1), kv_out.stride(2))),
        NUM_Q_HEADS=num_q_heads, HALF=half, BLOCK=triton.next_power_of_2(half), WRITE_KV=kv_out is not None,
        num_warps=1, **pdl_args(q),
    )
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]``, ``cos``/``sin`` ``[T, D]`` (non-interleaved halves), in x's dtype
    op by op as transformers does; the model's unfused RoPE."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def rope_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out=None) -> torch.Tensor:
    """The unfused ops: ``apply_rotary`` on q and k, then ``store_kv`` (and the rows into ``kv_out``)."""
    _check_args(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out)
    k = apply_rotary(k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, locs)
    if kv_out is not None:
        kv_out[:, 0] = k
        kv_out[:, 1] = v
    return apply_rotary(q, cos, sin)


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  locs: torch.Tensor, kv_out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotated q; rotated k and v stored at ``locs``, and into ``kv_out`` when given (see the module doc)."""
    run = rope_store_kv_triton if use_triton(q) else rope_store_kv_ref
    return run(q, k, v, cos, sin, k_cache, v_cache, locs, kv_out)


@triton.jit
def rope_lanes(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF: tl.constexpr,
               BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Token ``t``'s RoPE lanes: ``i`` (``BLOCK`` of them, ``ok`` below ``HALF``), its cos
    and sin, and where each rotated pair's two members sit in a row (adjacent when
    ``INTERLEAVE``, else ``HALF`` apart). Shared by every RoPE kernel."""
    i = tl.arange(0, BLOCK)
    ok = i < HALF
    c = tl.load(cos_ptr + t * stride_ct + i, mask=ok, other=0.0)
    s = tl.load(sin_ptr + t * stride_st + i, mask=ok, other=0.0)
    if INTERLEAVE:
        first, second = 2 * i, 2 * i + 1
    else:
        first, second = i, HALF + i
    return i, ok, c, s, first, second


@triton.jit(do_not_specialize=["num_tokens"])
def _mla_rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, num_tokens, num_heads,
    stride_qt, stride_qh, stride_kt, stride_ct, stride_st,
    HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i, ok, c, s, first, second = rope_lanes(cos_ptr, sin_ptr, t, stride_ct, stride_st, HALF,
                                            BLOCK, INTERLEAVE)
    if head < num_heads:
        row = q_ptr + t * stride_qt + head * stride_qh
    else:  # the last program of a token rotates its shared key
        row = k_ptr + t * stride_kt
    x1 = tl.load(row + first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + second, mask=ok, other=0.0).to(tl.float32)
    # Both members are loaded before either store: in place is safe.
    tl.store(row + i, (x1 * c - x2 * s).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(row + HALF + i, (x2 * c + x1 * s).to(q_ptr.dtype.element_ty), mask=ok)


def _check_mla_rope_args(q_pe, k_pe, cos, sin) -> None:
    if not isinstance(q_pe, torch.Tensor) or q_pe.dim() != 3:
        raise ValueError(f"q_pe must be a 3-D tensor [T, H, P], got "
                         f"{getattr(q_pe, 'shape', type(q_pe))}")
    num_tokens, _, rope = q_pe.shape
    if rope % 2:
        raise ValueError(f"q_pe.shape[2] must be even for RoPE, got {rope}")
    if q_pe.dtype not in _DTYPES:
        raise ValueError(f"q_pe.dtype must be one of {_DTYPES}, got {q_pe.dtype}")
    if k_pe is not None and (not isinstance(k_pe, torch.Tensor) or k_pe.shape != (
            num_tokens, rope) or k_pe.dtype != q_pe.dtype):
        raise ValueError(f"k_pe must be None or a {q_pe.dtype} [{num_tokens}, {rope}] tensor, got "
                         f"{getattr(k_pe, 'shape', type(k_pe))} {getattr(k_pe, 'dtype', '')}")
    for name, t in (("q_pe", q_pe), ("k_pe", k_pe)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be dense along its last dim, got strides {t.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.shape != (num_tokens, rope // 2) or (
            t.dtype != torch.float32
        ) or t.stride(-1) != 1:
            raise ValueError(f"{name} must be a dense float32 [{num_tokens}, {rope // 2}] tensor, "
                             f"got {getattr(t, 'shape', type(t))} {getattr(t, 'dtype', '')}")
    check_same_device(q_pe=q_pe, k_pe=k_pe, cos=cos, sin=sin)


def mla_rope_triton(q_pe: torch.Tensor, k_pe: torch.Tensor | None, cos: torch.Tensor,
                    sin: torch.Tensor, interleave: bool) -> None:
    _check_mla_rope_args(q_pe, k_pe, cos, sin)
    num_tokens, num_heads, rope = q_pe.shape
    if num_tokens == 0:
        return
    half = rope // 2
    # without k_pe no program reaches the key's branch (q_pe stands in for its pointer)
    _mla_rope_kernel[(num_tokens, num_heads + (k_pe is not None))](
        q_pe, q_pe if k_pe is None else k_pe, cos, sin, num_tokens, num_heads,
        q_pe.stride(0), q_pe.stride(1), 0 if k_pe is None else k_pe.stride(0), cos.stride(0),
        sin.stride(0),
        HALF=half, BLOCK=max(2, triton.next_power_of_2(half)), INTERLEAVE=bool(interleave),
        num_warps=1, **pdl_args(q_pe),
    )


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleave: bool) -> torch.Tensor:
    """RoPE on ``x [T, H, P]`` in float32 as a new tensor: pairs ``(x[2i], x[2i+1])``
    when ``interleave`` (DeepSeek's layout; the result lists the rotated first members
    then the second ones, the same for q and k), else halves ``(x[i], x[i+P/2])``."""
    x32 = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def mla_rope_ref(q_pe: torch.Tensor, k_pe: torch.Tensor | None, cos: torch.Tensor,
                 sin: torch.Tensor, interleave: bool) -> None:
    """``rope_pairs`` of each, copied back in place."""
    _check_mla_rope_args(q_pe, k_pe, cos, sin)
    q_pe.copy_(rope_pairs(q_pe, cos, sin, interleave))
    if k_pe is not None:
        k_pe.copy_(rope_pairs(k_pe[:, None, :], cos, sin, interleave)[:, 0])


def mla_rope(q_pe: torch.Tensor, k_pe: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             interleave: bool) -> None:
    """MLA's RoPE on ``q_pe`` and ``k_pe``, in place (see the module doc)."""
    run = mla_rope_triton if use_triton(q_pe) else mla_rope_ref
    run(q_pe, k_pe, cos, sin, interleave)
