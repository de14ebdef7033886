"""Prefill attention through cuDNN's fused attention (torch SDPA), segment by segment.

Measured on one H200 (BENCHMARKS.md), cuDNN's causal attention ran faster than
``cp_prefill_attention``'s Triton kernel on long prompts: 0.75x its time at 32 heads
of d128 and 16k tokens for ours, 0.82-0.83x on MLA's decompressed heads (qk 192, v
128) at 8k and 32k. ``sdpa_prefill_attention`` hands each query segment of a rank to
it, on contiguous K/V rows. A grouped-query model's KV heads are repeated to the query
heads for each call (a copy of the segment's keys and values: at 16k tokens of 8 KV
heads of d128, 0.27 GB a layer against a few ms of attention); MLA's decompressed
heads are the queries' already.

A segment is the rank's query rows ``[q_start, q_start + q_len)`` at positions
``q_pos ..`` of a request whose position 0 is K/V row ``kv_start`` (``AttnSegments``,
here as host integers: the prefill runner has them, so nothing is read back from the
device). A query at position ``p`` sees keys ``[0, p]``:

- a segment that starts at position 0 (a whole prompt; CP rank 0's first chunk) is one
  causal call;
- one that starts later (every other CP chunk; a prompt after a cached prefix) is two:
  its queries against the keys before them, unmasked, and against its own keys,
  causal. The second is a square block, so SDPA's top-left causal mask is the
  right one. The two are merged by their log-sum-exps (natural log, float32), as the
  decode's split partials are.

CUDA runs cuDNN's kernel: torch's public SDPA with the cuDNN backend where no
log-sum-exp is needed, ``aten._scaled_dot_product_cudnn_attention`` (which returns it)
where one is. Elsewhere (the CPU) ``attend_ref`` runs the same calls in float32 torch,
so the split and the merge are tested without a GPU. A rank's CP prefill takes it with
``LANEKV_PREFILL_ATTENTION=cudnn`` (``PREFILL_ATTENTION_ENV``;
``model.attention.base.segment_attention``, GQA and MLA), the Triton kernel otherwise.

Why Triton stays the default (one H200, 2026-12-04, BENCHMARKS.md "Sixteenth session"):
torch builds a cuDNN graph for every new shape, in a cache of the calling thread, and
the build takes about 70 ms (``bench/cudnn_sdpa_host.py``). A prompt of a new length is
a new shape for each of its calls, so a serving daemon would pay that on most requests;
torch's ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` keys the cache by power-of-two lengths
but ran the kernels 12-52% slower. With its graphs built (one engine, the same prompt
again: ``bench/prefill_attention.py``), the path ran DeepSeek-V2-Lite's prefill 0.99x /
1.04x the Triton kernel's at 8k / 32k and Llama-3-8B's 0.95x / 1.06x. It suits a
workload of few, fixed lengths; bounding the shapes (padding each call to a bucket)
would be the next step, not taken.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from lanekv.kernels.backend import env_choice
from lanekv.kernels.prefill.reference import AttnOutput, check_qkv, out_shape

PREFILL_ATTENTION_ENV = "LANEKV_PREFILL_ATTENTION"  # triton (the default) or cudnn


def prefill_attention_backend() -> str:
    """``LANEKV_PREFILL_ATTENTION``: ``"triton"`` (unset) or ``"cudnn"``; else a one-line error."""
    return env_choice(PREFILL_ATTENTION_ENV, ("triton", "cudnn"), "triton")


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, H, L, D]`` q against ``[1, H, S, D]`` k/v in float32 (the causal mask top-left,
    as SDPA's): the output in q's dtype and the natural-log log-sum-exp ``[1, H, L]``."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def attend_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                 with_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same call through cuDNN: the output, and the log-sum-exp when ``with_lse``."""
    if not with_lse:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale), None
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                             scale=scale)
    return res[0], res[1].reshape(q.shape[:3]).float()


def _attend(q, k, v, causal: bool, scale: float, with_lse: bool):
    if q.is_cuda:
        return attend_cudnn(q, k, v, causal, scale, with_lse)
    out, lse = attend_ref(q, k, v, causal, scale)
    return out, lse if with_lse else None


def merge_by_lse(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                 lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two softmax-normalized outputs over disjoint keys ``[1, H, L, Dv]`` with their
    log-sum-exps ``[1, H, L]`` -> the output over both keys (o1's dtype) and its log-sum-exp."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    out = o1.float() * (w1 / total)[..., None] + o2.float() * (w2 / total)[..., None]
    return out.to(o1.dtype), top + torch.log(total)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """``[rows, H, D]`` -> SDPA's ``[1, H, rows, D]`` (a view)."""
    return t.transpose(0, 1).unsqueeze(0)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """SDPA's ``[1, H, rows, D]`` -> ``[rows, H, D]`` (a view)."""
    return t[0].transpose(0, 1)


def _check_segments(q: torch.Tensor, k: torch.Tensor,
                    segments: Sequence[tuple[int, int, int, int]]) -> list[tuple[int, int, int, int]]:
    """Host segments as int tuples; ValueError naming the first bad one."""
    out, rows = [], []
    for i, seg in enumerate(segments):
        try:
            if len(seg) != 4 or any(isinstance(x, bool) for x in seg):
                raise TypeError
            seg = tuple(operator.index(x) for x in seg)
        except TypeError:
            raise ValueError(f"segments[{i}] must be 4 ints (q_start, q_len, q_pos, kv_start), "
                             f"got {seg!r:.80}") from None
        q_start, q_len, q_pos, kv_start = seg
        if min(seg) < 0:
            raise ValueError(f"segments[{i}] = {tuple(seg)} has a negative entry")
        if q_start + q_len > q.shape[0]:
            raise ValueError(f"segments[{i}]: q_start + q_len = {q_start + q_len} passes q's "
                             f"{q.shape[0]} rows")
        if q_len and kv_start + q_pos + q_len > k.shape[0]:
            raise ValueError(f"segments[{i}]: its keys reach row {kv_start + q_pos + q_len} of k's "
                             f"{k.shape[0]}")
        if q_len:
            rows.append((q_start, q_start + q_len))
        out.append((q_start, q_len, q_pos, kv_start))
    rows.sort()
    if any(a[1] > b[0] for a, b in zip(rows, rows[1:])):
        raise ValueError("segments: query rows of two segments overlap")
    return out


def sdpa_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           segments: Sequence[tuple[int, int, int, int]], softmax_scale: float, *,
                           return_lse: bool = False) -> torch.Tensor | AttnOutput:
    """``cp_prefill_attention`` of ``q [Tq, Hq, D]``, contiguous K/V rows ``k [Tk, Hkv, D]`` and
    ``v [Tk, Hkv, Dv]`` over host ``segments`` (q_start, q_len, q_pos, kv_start) -> ``[Tq, Hq, Dv]``
    in q's dtype (and the float32 log-sum-exp ``[Tq, H]`` with ``return_lse``); rows no
    segment names are left as they were allocated."""
    check_qkv(q, k, v, softmax_scale)
    segs = _check_segments(q, k, segments)
    scale = float(softmax_scale)
    group = q.shape[1] // k.shape[1]  # query heads a KV head serves (check_qkv: a whole number)

    def kv(t: torch.Tensor, rows: slice) -> torch.Tensor:
        """``t``'s rows as SDPA's ``[1, Hq, rows, D]``: KV head ``h // group`` for query head ``h``."""
        return _heads(t[rows] if group == 1 else t[rows].repeat_interleave(group, dim=1))

    if (len(segs) == 1 and not return_lse and segs[0][0] == 0 and segs[0][1] == q.shape[0]
            and segs[0][2] == 0):  # one whole prompt: the call's own output, no copy
        _, q_len, _, kv_start = segs[0]
        own = slice(kv_start, kv_start + q_len)
        o, _ = _attend(_heads(q), kv(k, own), kv(v, own), True, scale, False)
        return _rows(o).contiguous()
    out = q.new_empty(out_shape(q, v))
    lse = q.new_empty(q.shape[:2], dtype=torch.float32) if return_lse else None
    for q_start, q_len, q_pos, kv_start in segs:
        if q_len == 0:
            continue
        qs = _heads(q[q_start:q_start + q_len])
        own = slice(kv_start + q_pos, kv_start + q_pos + q_len)
        o, s = _attend(qs, kv(k, own), kv(v, own), True, scale, q_pos > 0 or return_lse)
        if q_pos > 0:
            before = slice(kv_start, kv_start + q_pos)
            o0, s0 = _attend(qs, kv(k, before), kv(v, before), False, scale, True)
            o, s = merge_by_lse(o0, s0, o, s)
        out[q_start:q_start + q_len] = _rows(o)
        if lse is not None:
            lse[q_start:q_start + q_len] = s[0].transpose(0, 1)
    return AttnOutput(out, lse) if return_lse else out
