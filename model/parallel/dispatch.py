"""All-to-all dispatch and combine of a MoE layer's routed experts over the ranks of a
group whose ranks hold different tokens (the CP prefill's ranks, ``--ep``).

Rank ``r`` owns experts ``[bounds[r], bounds[r + 1])`` (``model.parallel.ep.expert_bounds``).
Per layer, each rank routes its own tokens, then:

1. counts: each rank sends every owner the number of its (token, choice) pairs per
   expert of that owner (``all_to_all_single`` of ``[E]`` int64 on the device, split by
   the owners' expert counts); this and the split sizes' read to the host that follows
   are the one host sync;
2. dispatch: the pairs, grouped by expert (so by owner), go each to its expert's owner
   only: the token's hidden row, ``all_to_all_single`` with those split sizes;
3. each owner runs its experts on what it received (``kernels.moe.moe_experts``, one
   choice per row, weight 1: the received rows' local expert ids come from the counts);
4. combine: the expert outputs go back by the reverse ``all_to_all_single``; the source
   weighs each pair by its router weight, rounds to the model dtype (where
   ``moe_experts`` rounds the weighted output) and sums each token's ``k`` pairs.

A row crosses once each way per (token, choice) whose expert another rank owns; a
rank computes only the pairs routed to its experts. The same ops run on gloo (CPU)
and NCCL. Capture: the counts' exchange has a fixed shape and captures; the rows'
exchange takes split sizes read on the host, so a layer does not capture as a whole
(a capturable variant would send a fixed capacity of ``T * k`` rows to every owner,
``size`` times the bytes; docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lanekv.kernels.moe.experts import moe_experts


class Splits(NamedTuple):
    """One layer's exchange sizes, read on the host once: rows this rank sends each
    rank and receives from each, and the received rows' counts per (source, local expert)."""

    send: list[int]  # [size]
    recv: list[int]  # [size]
    recv_per_expert: torch.Tensor  # [size * local experts] int64, on the device


def exchange_counts(per_expert: torch.Tensor, bounds: tuple[int, ...], rank: int, group: Any) -> Splits:
    """Counts first: ``per_expert [E]`` int64 (this rank's pairs per expert) to every
    owner, then the split sizes read on the host (the layer's one sync)."""
    size = len(bounds) - 1
    widths = [bounds[r + 1] - bounds[r] for r in range(size)]
    mine = widths[rank]
    recv_per_expert = per_expert.new_empty(size * mine)
    dist.all_to_all_single(recv_per_expert, per_expert, [mine] * size, widths, group=group)
    host = torch.cat((per_expert, recv_per_expert)).tolist()
    sent, got = host[:bounds[-1]], host[bounds[-1]:]
    return Splits([sum(sent[bounds[r]:bounds[r + 1]]) for r in range(size)],
                  [sum(got[s * mine:(s + 1) * mine]) for s in range(size)], recv_per_expert)


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, bounds: tuple[int, ...], group: Any,
                     run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                     ) -> torch.Tensor:
    """The routed experts' output for this rank's tokens ``x [T, H]`` with router
    ``weights [T, k]`` float32 and ``ids [T, k]`` int64 (global expert ids), this rank's
    experts stacked in ``w13 [E_r, 2I, H]`` and ``w2 [E_r, H, I]``, over ``group``
    (module doc). Every rank of ``group`` must call it for the layer, with no tokens too.
    ``run(rows, weights, local_ids)``, if given, runs this rank's experts on the rows it
    received instead of ``moe_experts`` over ``w13``/``w2`` (block-FP8 experts as stored;
    ``w13`` then only gives the count of local experts)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(bounds) != size + 1 or w13.shape[0] != bounds[rank + 1] - bounds[rank]:
        raise ValueError(f"bounds={bounds} do not give rank {rank} of {size} its {w13.shape[0]} experts")
    tokens, top_k = ids.shape
    hidden = x.shape[1]
    num_experts = bounds[-1]
    flat = ids.reshape(-1)  # [T * k] pairs, token-major
    order = torch.sort(flat, stable=True)[1]  # pairs grouped by expert, so by owner rank
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    per_expert.scatter_add_(0, flat, torch.ones_like(flat))
    splits = exchange_counts(per_expert, bounds, rank, group)

    sent = x[order // top_k]  # [T * k, H]
    received = x.new_empty((sum(splits.recv), hidden))
    dist.all_to_all_single(received, sent, splits.recv, splits.send, group=group)
    # rows arrive by source, then by local expert within a source
    mine = w13.shape[0]
    local = torch.arange(mine, device=x.device).repeat(size)
    local_ids = torch.repeat_interleave(local, splits.recv_per_expert, output_size=received.shape[0])
    ones = torch.ones((received.shape[0], 1), dtype=torch.float32, device=x.device)
    if run is None:
        outputs = moe_experts(received, w13, w2, ones, local_ids[:, None])  # [received, H]
    else:
        outputs = run(received, ones, local_ids[:, None])

    back = x.new_empty((tokens * top_k, hidden))
    dist.all_to_all_single(back, outputs, splits.send, splits.recv, group=group)
    pairs = torch.empty_like(back)
    pairs[order] = back  # token-major again
    weighted = (pairs * weights.reshape(-1, 1)).to(x.dtype)
    return weighted.view(tokens, top_k, hidden).sum(1)
