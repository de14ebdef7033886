"""Expert parallelism of a MoE layer over the ranks of a group: rank ``r`` holds the
routed experts ``expert_span(E, r, size)``, ``[r E // size, (r + 1) E // size)`` (an
even split where ``size`` divides ``E``, else the later ranks hold one more).

Decode TP (``ExpertShardMoE``): the router stays whole on every rank (its weights are
small), so every rank picks the same top-k for every token. A rank runs its own
experts' share of the choices (the others weigh 0 on it) and the ranks' partial
outputs are summed by one all-reduce, the hook ``model.parallel.tp.attach_all_reduce``
puts on the MoE block. The share runs the kernels the whole block runs for the batch
(``MoE.routed_experts``), so the sum is one GPU's output (block-FP8 experts: the
decode kernels leave the activations unquantized, the grouped GEMMs quantize them).
The tokens' hidden rows are on every rank already (attention is tensor-parallel and
its o_proj all-reduced) and every rank needs every token's output for the next
layer, so the all-reduce is the whole combine: an all-to-all dispatch would move
rows that are already there (docs/parallelism.md). Shared experts run on rank 0
only (the sum adds them once).

The CP prefill's ranks hold different tokens: there each MoE layer sends each token
once to each rank owning one of its choices and combines one row per (token, rank)
back by all-to-all (``DispatchedExpertShardMoE``, ``model.parallel.dispatch``), and
shared experts run on every rank over its own rows. ``ExpertExchange`` (one per model,
shared by its blocks) picks the exchange: the sized one (split sizes read on the host
once a layer, the default) or the capturable one (``model.parallel.dispatch_capturable``:
shapes fixed by the forward's rows per rank, which the prefill runner sets around each
forward with ``ExpertExchange.rows_per_rank``).

A rank reads only its experts' tensors from the checkpoint (``local_expert_name``
renames the rank's experts to local indices and skips the rest).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from lanekv.kernels.fp8.experts import moe_experts_fp8
from lanekv.model.deepseek import MoE
from lanekv.model.parallel.dispatch import Experts, dispatch_combine
from lanekv.model.parallel.dispatch_capturable import dispatch_combine_capturable
from lanekv.model.quant.linear import StackedFp8Experts
from torch import nn

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)$")


class ExpertShardMoE(MoE):
    """A ``MoE`` block holding experts ``[first, first + len(experts))`` of ``num_experts``."""

    first: int
    keeps_shared: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the block's output ``[T, hidden]``, with the
        shared expert's on the rank that keeps it."""
        weights, ids = self.gate(x)  # [T, k] over every expert
        count = len(self.experts)
        mine = (ids >= self.first) & (ids < self.first + count)
        # Another rank's choices go to local expert 0 with weight 0: the same grid on every step.
        ids = torch.where(mine, ids - self.first, torch.zeros_like(ids))
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        # The whole block's kernels for the batch (decode-sized: the sort-free ones, the
        # shared expert fused in), so the ranks' sum is what one GPU computes.
        return self.experts_out(x, weights, ids,
                                with_shared=self.shared_experts is not None and self.keeps_shared)


@dataclass
class ExpertExchange:
    """How one model's dispatched MoE blocks exchange rows over ``group``: ``capturable``
    takes ``dispatch_combine_capturable`` with ``capacity`` rows per rank, which holds
    only inside ``rows_per_rank`` (one forward; None outside, and a capturable layer
    run outside it fails), else the sized ``dispatch_combine``."""

    group: Any
    capturable: bool = False
    capacity: int | None = None
    blocks: int = 0  # the MoE blocks that share it

    @contextmanager
    def rows_per_rank(self, capacity: int) -> Iterator[None]:
        """The forward inside runs with ``capacity``: the most rows any rank of the
        group holds (the same on every rank: the prefill's ``BatchPlan.max_rank_len``)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got capacity={capacity!r}")
        self.capacity = capacity
        try:
            yield
        finally:
            self.capacity = None

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                 w2: torch.Tensor, bounds: tuple[int, ...], run: Experts | None = None) -> torch.Tensor:
        if not self.capturable:
            return dispatch_combine(x, weights, ids, w13, w2, bounds, self.group, run)
        if self.capacity is None:
            raise ValueError("the capturable EP dispatch runs inside ExpertExchange.rows_per_rank "
                             "(the forward's rows per rank), got capacity=None")
        return dispatch_combine_capturable(x, weights, ids, w13, w2, bounds, self.group, self.capacity, run)


class DispatchedExpertShardMoE(ExpertShardMoE):
    """Prefill EP: the CP ranks hold different tokens, so each MoE layer sends each
    token once to each rank owning one of its choices and combines one partial per
    (token, rank) back (``model.parallel.dispatch.dispatch_combine``: counts, rows,
    experts, partials back; or its capturable twin, as ``exchange`` says); shared
    experts run locally on a rank's own rows."""

    exchange: ExpertExchange
    bounds: tuple[int, ...]  # every rank's first expert, then num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k] over every expert
        if self.fp8 is not None or self.w13 is None and StackedFp8Experts.stackable(self.experts):
            fp8 = self.fp8 or StackedFp8Experts(self.experts, fuse=False)  # block-FP8 experts as stored

            def run(rows: torch.Tensor, row_weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
                return moe_experts_fp8(rows, fp8.w13, fp8.s13, fp8.w2, fp8.s2, row_weights, local_ids,
                                       fp8.block, scale_ue8m0=fp8.scale_ue8m0)

            routed = self.exchange.dispatch(x, weights, ids, fp8.w13, fp8.w2, self.bounds, run)
        else:
            w13, w2 = (self.w13, self.w2) if self.w13 is not None else self._stacked()
            routed = self.exchange.dispatch(x, weights, ids, w13, w2, self.bounds)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)


def expert_span(num_experts: int, rank: int, size: int) -> range:
    """Rank ``rank``'s experts of ``num_experts`` over ``size`` ranks: contiguous, an even
    split where ``size`` divides ``num_experts`` (the later ranks take the remainder)."""
    return range(rank * num_experts // size, (rank + 1) * num_experts // size)


def expert_bounds(num_experts: int, size: int) -> tuple[int, ...]:
    """Every rank's first expert, then ``num_experts``."""
    return tuple(r * num_experts // size for r in range(size + 1))


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


def attach_expert_exchange(model: nn.Module, group: Any, *, capturable: bool = False) -> ExpertExchange:
    """Prefill EP: every expert-sharded MoE block of ``model`` dispatches its rows over
    ``group`` (``DispatchedExpertShardMoE``), by the sized or the capturable exchange;
    the exchange they share (``blocks`` counts them)."""
    exchange = ExpertExchange(group, capturable=capturable)
    size = dist.get_world_size(group)
    for layer in model.model.layers:
        if isinstance(layer.mlp, ExpertShardMoE):
            layer.mlp.__class__ = DispatchedExpertShardMoE
            layer.mlp.exchange = exchange
            layer.mlp.bounds = expert_bounds(layer.mlp.gate.moe.num_experts, size)
            exchange.blocks += 1
    return exchange


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
    most = -(-config.moe.num_experts // size)  # the largest rank's experts
    return total - routed + routed * most // config.moe.num_experts

