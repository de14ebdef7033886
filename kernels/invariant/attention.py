"""Causal attention whose every query row is independent of the batch (the CPU references).

``blocked_attention(q, k, v, q_pos, softmax_scale)``: query ``i`` (``q [Tq, Hq, D]``)
attends keys ``[0, q_pos[i]]`` of ``k [Tk, Hkv, D]`` / ``v [Tk, Hkv, Dv]`` (key ``j``
at position ``j``; query head ``h`` reads KV head ``h // (Hq / Hkv)``), in float32,
returning ``(out [Tq, Hq, Dv] in q's dtype, lse [Tq, Hq] float32)``.

Online softmax over blocks of ``KEY_BLOCK`` keys from key 0, each block zero-padded
to full size: a query's scores, its block maxima and sums see the same operands
in the same places whatever the other queries are and wherever the key range
ends (a masked or padded key's probability is an exact 0, a fully masked block
leaves the running sums as they were, multiplied by ``exp(0) = 1``). So a CP
rank's query segment, the whole prompt of the single-process run and any split
between give each query the same bits.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KEY_BLOCK = 16


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                      softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    num_queries, num_heads, _ = q.shape
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2] or num_heads % k.shape[1]:
        raise ValueError(f"expected k [Tk, Hkv, D] and v [Tk, Hkv, Dv] with Hq={num_heads} a "
                         f"multiple of Hkv; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    group = num_heads // k.shape[1]
    pad = -k.shape[0] % KEY_BLOCK
    keys = F.pad(k.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(group, dim=1)  # [Tk', Hq, D]
    values = F.pad(v.float(), (0, 0, 0, 0, 0, pad)).repeat_interleave(group, dim=1)
    queries, pos = q.float(), q_pos.to(q.device)[:, None, None]
    m = torch.full((num_queries, num_heads), -math.inf, device=q.device)
    total = torch.zeros((num_queries, num_heads), device=q.device)
    acc = torch.zeros((num_queries, num_heads, v.shape[2]), device=q.device)
    for start in range(0, keys.shape[0], KEY_BLOCK):
        kb, vb = keys[start : start + KEY_BLOCK], values[start : start + KEY_BLOCK]
        scores = (queries[:, None] * kb[None]).sum(-1) * softmax_scale  # [Tq, block, Hq]
        key_pos = torch.arange(start, start + KEY_BLOCK, device=q.device)[None, :, None]
        scores = scores.masked_fill(key_pos > pos, -math.inf)
        m_new = torch.maximum(m, scores.amax(dim=1))
        probs = torch.exp(scores - m_new[:, None])  # 0 for masked keys
        alpha = torch.exp(m - m_new)  # 1 when the block is fully masked
        total = total * alpha + probs.sum(dim=1)
        acc = acc * alpha[..., None] + (probs[..., None] * vb[None]).sum(dim=1)  # [Tq, Hq, Dv]
        m = m_new
    return (acc / total[..., None]).to(q.dtype), m + torch.log(total)
