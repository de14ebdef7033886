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

The CP prefill's ranks hold different tokens: there each MoE layer first
exchanges the rows (``ExchangedExpertShardMoE``; counts, then the rows, then
the all-reduce), and shared experts run on every rank over its own rows.

A rank reads only its experts' tensors from the checkpoint (``local_expert_name``
renames the rank's experts to local indices and skips the rest).
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
from lanekv.kernels.fp8.experts import moe_experts_fp8
from lanekv.kernels.moe.experts import moe_experts
from lanekv.model.deepseek import MoE
from lanekv.model.quant.linear import StackedFp8Experts
from torch import nn

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")


class ExpertShardMoE(MoE):
    """A ``MoE`` block holding experts ``[first, first + len(experts))`` of ``num_experts``."""

    first: int
    keeps_shared: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed(x)
        if self.shared_experts is not None and self.keeps_shared:
            routed = routed + self.shared_experts(x)
        return routed

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the routed output ``[T, hidden]``."""
        weights, ids = self.gate(x)  # [T, k] over every expert
        count = len(self.experts)
        mine = (ids >= self.first) & (ids < self.first + count)
        # Another rank's choices go to local expert 0 with weight 0: the same grid on every step.
        ids = torch.where(mine, ids - self.first, torch.zeros_like(ids))
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        if self.fp8 is not None or self.w13 is None and StackedFp8Experts.stackable(self.experts):
            fp8 = self.fp8 or StackedFp8Experts(self.experts, fuse=False)  # block-FP8 experts as stored
            return moe_experts_fp8(x, fp8.w13, fp8.s13, fp8.w2, fp8.s2, weights, ids, fp8.block,
                                   scale_ue8m0=fp8.scale_ue8m0)
        w13, w2 = (self.w13, self.w2) if self.w13 is not None else self._stacked()
        return moe_experts(x, w13, w2, weights, ids)


class ExchangedExpertShardMoE(ExpertShardMoE):
    """Prefill EP: the CP ranks hold different tokens, so each MoE layer exchanges them.

    Row counts first (an all-gather of one number per rank), then every rank's rows
    (padded to the largest count) are all-gathered; each rank runs its experts' share
    of all of them, one all-reduce sums the shares, and each rank keeps its own rows;
    shared experts run locally on a rank's own rows. This all-reduce combine moves
    every row to every rank: an all-to-all that sends each row only to its experts'
    owners is the next step.
    """

    group: Any

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [torch.empty_like(count) for _ in range(size)]
        dist.all_gather(counts, count, group=self.group)
        counts = [int(c) for c in counts]
        most = max(counts)
        if most == 0:
            return x.clone()
        padded = x.new_zeros((most, x.shape[1]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded, group=self.group)
        rows = torch.cat([part[:n] for part, n in zip(parts, counts)])  # every rank's rows, in rank order
        routed = self.routed(rows)
        dist.all_reduce(routed, group=self.group)
        start = sum(counts[:rank])
        out = routed[start:start + x.shape[0]]
        return out if self.shared_experts is None else out + self.shared_experts(x)


def expert_span(num_experts: int, rank: int, size: int) -> range:
    part = num_experts // size
    return range(rank * part, (rank + 1) * part)


def shard_experts(model: nn.Module, rank: int, size: int, *, shared_everywhere: bool = False) -> int:
    """Cut every MoE block of ``model`` (built on meta, before loading) to this rank's
    experts; the number of blocks cut. Shared experts stay on rank 0 only (the decode
    TP's all-reduce adds them once) unless ``shared_everywhere`` (prefill EP: each rank
    runs them on its own rows)."""
    cut = 0
    for layer in model.model.layers:
        mlp = layer.mlp
        if not isinstance(mlp, MoE):
            continue
        span = expert_span(len(mlp.experts), rank, size)
        mlp.experts = nn.ModuleList(mlp.experts[i] for i in span)
        mlp.__class__ = ExpertShardMoE
        mlp.first, mlp.keeps_shared = span.start, rank == 0 or shared_everywhere
        if not mlp.keeps_shared:
            mlp.shared_experts = None  # rank 0 adds them, once
        cut += 1
    return cut


def attach_expert_exchange(model: nn.Module, group: Any) -> int:
    """Prefill EP: every expert-sharded MoE block of ``model`` exchanges its rows over
    ``group`` (``ExchangedExpertShardMoE``); the number of blocks."""
    count = 0
    for layer in model.model.layers:
        if isinstance(layer.mlp, ExpertShardMoE):
            layer.mlp.__class__ = ExchangedExpertShardMoE
            layer.mlp.group = group
            count += 1
    return count


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


def ep_weight_bytes(config: Any, dtype: torch.dtype, size: int) -> int:
    """One rank's bytes of weights when ``size`` ranks share the routed experts (counted on meta)."""
    from lanekv.model.checkpoint import build_model

    model = build_model(config, dtype=dtype, device="meta")
    total = routed = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        total += nbytes
        routed += nbytes if ".mlp.experts." in name else 0
    return total - routed + routed // size

