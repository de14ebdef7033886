"""moe_route: a MoE router's expert choice from its float32 logits, in one launch.

``logits [T, E]`` float32 (the gate's ``x @ W.T``) -> ``weights [T, k]`` float32 and
``ids [T, k]`` int64, as DeepSeek's routers compute them:

- ``scoring="softmax"`` (V2, Qwen3-MoE): scores are the softmax over the experts; a
  group's rank is its best score;
- ``scoring="sigmoid"`` (V3): scores are the sigmoid of the logits, the choice adds
  ``correction_bias [E]`` to them, a group's rank is the sum of its two best choices;
- with ``n_group > 1`` and ``topk_group < n_group``, only the experts of the
  ``topk_group`` best groups stay candidates;
- the ``k`` best candidates; their scores (not the biased choices) are the weights,
  divided by their sum with ``norm_topk_prob``, then times ``scaling``.

The reference is the torch code of ``model.deepseek.Router``; the Triton kernel runs
one program per token (the softmax, the group limit, ``k`` rounds of arg-max and the
normalisation in registers), where the torch code launches a kernel per op (six for
V2, about fifteen for V3 per MoE layer and step). Softmax selection runs on the
logits (the same order as the scores). Ties go to the lowest expert id in the kernel;
``torch.topk`` leaves their order open. The order of the ``k`` choices may differ
between the two (it does not matter to ``moe_experts``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from lanekv.kernels.backend import check_same_device, use_triton
from lanekv.kernels.pdl import pdl_args, pdl_launch_dependents, pdl_wait

SCORINGS = ("softmax", "sigmoid")


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_lt, scaling,
    GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, NORM: tl.constexpr,
    G_BLOCK: tl.constexpr, S_BLOCK: tl.constexpr, K_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)  # first, before any load or store (kernels.pdl)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_BLOCK)[:, None]
    i = tl.arange(0, S_BLOCK)[None, :]
    ok = (g < GROUPS) & (i < GROUP_SIZE)
    e = g * GROUP_SIZE + i
    s = tl.load(logits_ptr + t * stride_lt + e, mask=ok, other=float("-inf"))
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-s))
        bias = tl.load(bias_ptr + e, mask=ok, other=0.0)
        choice = tl.where(ok, scores + bias, float("-inf"))
    else:
        top = tl.max(tl.max(s, 1), 0)
        ex = tl.where(ok, tl.exp(s - top), 0.0)
        scores = ex / tl.sum(tl.sum(ex, 1), 0)
        choice = s  # the softmax's order; masked slots are -inf
    if TOPK_GROUP < GROUPS:
        if SIGMOID:  # a group's rank: the sum of its two best choices
            best = tl.max(choice, 1)
            first = tl.argmax(choice, 1, tie_break_left=True)
            rank = best + tl.max(tl.where(i == first[:, None], float("-inf"), choice), 1)
        else:
            rank = tl.max(choice, 1)
        gi = tl.arange(0, G_BLOCK)
        rank = tl.where(gi < GROUPS, rank, float("-inf"))
        keep = gi < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.argmax(rank, 0, tie_break_left=True)
            keep = keep | (gi == pick)
            rank = tl.where(gi == pick, float("-inf"), rank)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    j = tl.arange(0, K_BLOCK)
    out_w = tl.zeros([K_BLOCK], tl.float32)
    out_id = tl.zeros([K_BLOCK], tl.int64)
    for r in tl.static_range(TOP_K):
        g_best = tl.argmax(tl.max(choice, 1), 0, tie_break_left=True)
        in_group = tl.where(g == g_best, choice, float("-inf"))
        i_best = tl.argmax(tl.max(in_group, 0), 0, tie_break_left=True)
        hit = (g == g_best) & (i == i_best)
        w = tl.sum(tl.sum(tl.where(hit, scores, 0.0), 1), 0)
        out_w = tl.where(j == r, w, out_w)
        out_id = tl.where(j == r, (g_best * GROUP_SIZE + i_best).to(tl.int64), out_id)
        choice = tl.where(hit, float("-inf"), choice)
    if NORM:
        out_w = out_w / (tl.sum(out_w, 0) + 1e-20)
    out_w = out_w * scaling
    tl.store(weights_ptr + t * TOP_K + j, out_w, mask=j < TOP_K)
    tl.store(ids_ptr + t * TOP_K + j, out_id, mask=j < TOP_K)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check(logits, correction_bias, top_k, n_group, topk_group, scoring, norm_topk_prob,
           scaling) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be a float32 tensor [T, E], got "
                         f"{getattr(logits, 'shape', type(logits))} {getattr(logits, 'dtype', '')}")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must be dense along its last dim, got strides {logits.stride()}")
    experts = logits.shape[1]
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} must be one of {SCORINGS}")
    if not _is_int(n_group) or n_group < 1 or experts % n_group:
        raise ValueError(f"n_group={n_group!r} must be a positive int dividing the {experts} experts")
    if not _is_int(topk_group) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group!r} must be an int in [1, n_group={n_group}]")
    if not _is_int(top_k) or not 1 <= top_k <= topk_group * (experts // n_group):
        raise ValueError(f"top_k={top_k!r} must be an int in [1, "
                         f"{topk_group * (experts // n_group)}] (the experts of topk_group groups)")
    if scoring == "sigmoid" and topk_group < n_group and experts // n_group < 2:
        raise ValueError(f"sigmoid group ranks need two experts per group, got "
                         f"{experts // n_group}")
    if scoring == "sigmoid":
        if not isinstance(correction_bias, torch.Tensor) or tuple(correction_bias.shape) != (
            experts,
        ) or correction_bias.dtype != torch.float32:
            raise ValueError(f"correction_bias must be a float32 tensor [{experts}] with sigmoid "
                             f"scoring, got {correction_bias!r:.80}")
        check_same_device(logits=logits, correction_bias=correction_bias)
    elif correction_bias is not None:
        raise ValueError("correction_bias is only for sigmoid scoring, got one with softmax")
    if not isinstance(norm_topk_prob, bool):
        raise ValueError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
    if (isinstance(scaling, bool) or not isinstance(scaling, (int, float))
            or not math.isfinite(scaling)):
        raise ValueError(f"scaling must be a finite number, got {scaling!r}")


def moe_route_triton(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                     n_group: int, topk_group: int, scoring: str, norm_topk_prob: bool,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    _check(logits, correction_bias, top_k, n_group, topk_group, scoring, norm_topk_prob, scaling)
    tokens, experts = logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    group_size = experts // n_group
    _route_kernel[(tokens,)](
        logits, correction_bias if correction_bias is not None else logits, weights, ids,
        logits.stride(0), float(scaling),
        GROUPS=n_group, GROUP_SIZE=group_size, TOPK_GROUP=topk_group, TOP_K=top_k,
        SIGMOID=scoring == "sigmoid", NORM=norm_topk_prob,
        G_BLOCK=max(2, triton.next_power_of_2(n_group)),
        S_BLOCK=max(2, triton.next_power_of_2(group_size)),
        K_BLOCK=max(2, triton.next_power_of_2(top_k)),
        num_warps=4 if experts >= 128 else 1, **pdl_args(logits),
    )
    return weights, ids


def moe_route_ref(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
                  n_group: int, topk_group: int, scoring: str, norm_topk_prob: bool,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops of transformers' DeepSeek routers, in their order."""
    _check(logits, correction_bias, top_k, n_group, topk_group, scoring, norm_topk_prob, scaling)
    experts = logits.shape[1]
    if scoring == "sigmoid":
        scores = logits.sigmoid()
        choice = scores + correction_bias
        group_rank = choice.view(-1, n_group, experts // n_group).topk(
            2, dim=-1)[0].sum(-1) if n_group > 1 else None
        fill = float("-inf")
    else:
        scores = choice = logits.softmax(dim=-1, dtype=torch.float32)
        group_rank = choice.view(-1, n_group, experts // n_group).amax(-1) if (
            n_group > 1) else None
        fill = 0.0
    if group_rank is not None and topk_group < n_group:
        groups = group_rank.topk(topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, groups, True)
        keep = keep.repeat_interleave(experts // n_group, dim=1)
        choice = choice.masked_fill(~keep, fill)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def moe_route(logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
              n_group: int, topk_group: int, scoring: str, norm_topk_prob: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's weights ``[T, k]`` float32 and expert ids ``[T, k]`` int64 (module doc)."""
    run = moe_route_triton if use_triton(logits) else moe_route_ref
    return run(logits, correction_bias, top_k, n_group, topk_group, scoring, norm_topk_prob,
               scaling)
