"""Expert parallelism of a MoE layer over the ranks of a group: each rank holds
``num_experts / size`` routed experts, ``[rank * E/size, (rank + 1) * E/size)``.

The router stays whole on every rank (its weights are small), so every rank
picks the same top-k for every token. A rank runs its own experts' share of the
choices (the others weigh 0 on it) and the ranks' partial outputs are summed by
one all-reduce, the hook ``model.parallel.tp.attach_all_reduce`` puts on the MoE
block. This all-reduce combine is the first EP: the tokens' hidden rows are on
every rank already (attention is tensor-parallel and its o_proj all-reduced),
so no dispatch is needed; an all-to-all dispatch of each token to its experts'
owners only (counts exchanged first) would cut the combine's bytes for large
batches. Shared experts run on rank 0 only (the sum adds them once).

A rank reads only its experts' tensors from the checkpoint (``local_expert_name``
renames the rank's experts to local indices and skips the rest).
"""

from __future__ import annotations

import re

import torch
from lanekv.kernels.moe.experts import moe_experts
from lanekv.model.deepseek import MoE
from torch import nn

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")


class ExpertShardMoE(MoE):
    """A ``MoE`` block holding experts ``[first, first + len(experts))`` of ``num_experts``."""

    first: int
    keeps_shared: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] over every expert
        count = len(self.experts)
        mine = (ids >= self.first) & (ids < self.first + count)
        # Another rank's choices go to local expert 0 with weight 0: the same grid on every step.
        ids = torch.where(mine, ids - self.first, torch.zeros_like(ids))
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        w13, w2 = (self.w13, self.w2) if self.w13 is not None else self._stacked()
        routed = moe_experts(x, w13, w2, weights, ids)
        if self.shared_experts is not None and self.keeps_shared:
            routed = routed + self.shared_experts(x)
        return routed


def expert_span(num_experts: int, rank: int, size: int) -> range:
    part = num_experts // size
    return range(rank * part, (rank + 1) * part)


def shard_experts(model: nn.Module, rank: int, size: int) -> int:
    """Cut every MoE block of ``model`` (built on meta, before loading) to this rank's
    experts; the number of blocks cut."""
    cut = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, MoE):
            continue
        span = expert_span(len(mlp.experts), rank, size)
        mlp.experts = nn.ModuleList(mlp.experts[i] for i in span)
        mlp.__class__ = ExpertShardMoE
        mlp.first, mlp.keeps_shared = span.start, rank == 0
        if rank != 0:
            mlp.shared_experts = None  # rank 0 adds them, once
        cut += 1
    return cut


def local_expert_name(name: str, rank: int, size: int, num_experts: int) -> str | None:
    """``name`` as this rank's model calls it: a routed expert's tensor renamed to its
    local index, None for another rank's expert (never read); any other name as is."""
    match = _EXPERT.match(name)
    if match is None:
        return name
    span = expert_span(num_experts, rank, size)
    expert = int(match.group(2))
    return f"{match.group(1)}{expert - span.start}{match.group(3)}" if expert in span else None


def shared_expert(name: str) -> bool:
    return ".mlp.shared_experts." in name
