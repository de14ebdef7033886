"""All-to-all dispatch and combine of a MoE layer's routed experts over the ranks of a
group whose ranks hold different tokens (the CP prefill's ranks, ``--ep``). A token's
hidden row crosses once to each rank that owns at least one of its ``k`` choices, not
once per choice (DeepEP's dedup), and one row per (token, rank) comes back.

Rank ``r`` owns experts ``[bounds[r], bounds[r + 1])`` (``model.parallel.ep.expert_bounds``).
Per layer, each rank routes its own tokens, then:

1. counts: each rank sends every rank ``k`` counts, how many of its tokens have more
   than ``s`` choices on that rank for ``s < k`` (``[0]`` is the rows it sends there,
   the sum its (token, choice) pairs); one ``all_to_all_single`` of ``[size, k]`` int64
   on the device, then what was sent and received read to the host: the layer's one
   host sync;
2. dispatch: the rows, grouped by destination rank then token, each with its ``k``
   slots for that rank (the choice's local expert id, or -1 where another rank owns
   it, and the router weight: ``int32 [rows, 2k]``), two ``all_to_all_single``;
3. the owner runs its experts on each received row's choices (``moe_experts``, one
   (row, choice) pair per GEMM row with its weight, so each pair's output is weighed
   and rounded to the model dtype as the one-process kernel rounds it), then adds a
   row's outputs in float32 in choice order and rounds once: the (token, rank) partial;
4. combine: the partials come back by the reverse ``all_to_all_single``; the source puts
   each rank's partial at the slot of the token's first choice on that rank, zeros in the
   token's other slots, and sums the ``k`` slots as ``moe_experts`` sums its per-choice
   outputs (``.sum(1)`` over ``[T, k, H]``).

Numerics: where no rank holds two choices of a token, the slots hold exactly the
per-choice outputs, so the sum is bit for bit the per-choice dispatch's, which adds
them as the Triton ``moe_experts`` does. Where a rank holds several, their float32 sum is rounded once
to the model dtype before it crosses (the bf16 bytes are what the dedup saves); the
difference is within one rounding of that partial (docs/parallelism.md). Every
order is fixed: the sort keys are unique and each scatter writes distinct rows, so the
result does not depend on scheduling.

The same ops run on gloo (CPU) and NCCL. Capture: the counts' exchange has a fixed
shape and captures; the rows' exchange takes split sizes read on the host, so a layer
does not capture as a whole. ``model.parallel.dispatch_capturable`` is its twin with
fixed padded shapes and no host read, the same bits for more bytes (docs/parallelism.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from lanekv.kernels.moe.experts import moe_experts

Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Routes(NamedTuple):
    """Where this rank's tokens' choices go, on the device (``[T, k]`` each, then the counts)."""

    owner: torch.Tensor  # the rank owning the choice's expert
    local: torch.Tensor  # the expert's index among its owner's experts
    nth: torch.Tensor  # the token's earlier choices on the same owner (0: its first there)
    per_slot: torch.Tensor  # [size, k] int64: tokens with more than s choices on each rank


class Splits(NamedTuple):
    """One layer's exchange sizes, read on the host once."""

    send: list[int]  # [size] rows this rank sends each rank (distinct (token, rank) pairs)
    recv: list[int]  # [size] rows it receives from each rank
    recv_per_slot: list[int]  # [k] received rows with more than s choices here; sums to the pairs


def route(ids: torch.Tensor, bounds: tuple[int, ...]) -> Routes:
    """Each choice's owner rank and local expert, its place among the token's choices on
    that owner, and the per-rank counts, from ``ids [T, k]`` int64 (device ops only:
    ``bounds`` are compared as Python ints, so nothing is copied to the device)."""
    size, top_k = len(bounds) - 1, ids.shape[1]
    owner = torch.zeros_like(ids)
    start = torch.zeros_like(ids)
    for r in range(1, size):
        above = ids >= bounds[r]
        owner += above
        start = torch.where(above, bounds[r], start)
    earlier = torch.ones((top_k, top_k), dtype=torch.bool, device=ids.device).tril(-1)  # [j, i]: i < j
    nth = ((owner[:, :, None] == owner[:, None, :]) & earlier).sum(-1)  # [T, k]
    per_slot = torch.zeros(size * top_k, dtype=torch.int64, device=ids.device)
    per_slot.scatter_add_(0, (owner * top_k + nth).reshape(-1), torch.ones_like(ids).reshape(-1))
    return Routes(owner, ids - start, nth, per_slot.view(size, top_k))


def exchange_counts(per_slot: torch.Tensor, group: Any) -> Splits:
    """Counts first: ``per_slot [size, k]`` int64 (``Routes.per_slot``), row ``r`` to rank
    ``r``, then the split sizes read on the host (the layer's one sync)."""
    recv = torch.empty_like(per_slot)
    dist.all_to_all_single(recv, per_slot, group=group)
    host = torch.cat((per_slot, recv)).tolist()
    size = per_slot.shape[0]
    sent, got = host[:size], host[size:]
    return Splits([row[0] for row in sent], [row[0] for row in got], [sum(col) for col in zip(*got)])


def check_layer_args(weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                     bounds: tuple[int, ...], group: Any) -> tuple[int, int]:
    """The group's size and this rank, once ``bounds`` give this rank its ``w13`` experts and
    ``weights`` are float32 of ``ids``' shape (one-line ValueErrors otherwise)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(bounds) != size + 1 or w13.shape[0] != bounds[rank + 1] - bounds[rank]:
        raise ValueError(f"bounds={bounds} do not give rank {rank} of {size} its {w13.shape[0]} experts")
    if weights.dtype != torch.float32 or weights.shape != ids.shape:
        raise ValueError(f"weights must be float32 of ids' shape {tuple(ids.shape)}, got "
                         f"{weights.dtype} {tuple(weights.shape)}")
    return size, rank


def dispatch_combine(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, bounds: tuple[int, ...], group: Any, run: Experts | None = None,
                     ) -> torch.Tensor:
    """The routed experts' output for this rank's tokens ``x [T, H]`` with router
    ``weights [T, k]`` float32 and ``ids [T, k]`` int64 (global expert ids), this rank's
    experts stacked in ``w13 [E_r, 2I, H]`` and ``w2 [E_r, H, I]``, over ``group``
    (module doc). Every rank of ``group`` must call it for the layer, with no tokens too.
    ``run(rows, weights, local_ids)``, if given, runs this rank's experts on the (row,
    choice) pairs it received instead of ``moe_experts`` over ``w13``/``w2`` (block-FP8
    experts as stored; ``w13`` then only gives the count of local experts)."""
    size, rank = check_layer_args(weights, ids, w13, bounds, group)
    tokens, top_k = ids.shape
    hidden = x.shape[1]
    routes = route(ids, bounds)
    splits = exchange_counts(routes.per_slot, group)

    # one row per (rank, token) pair, marked by the token's first choice on that rank
    token_of = torch.arange(tokens, device=x.device)[:, None]
    key = torch.where(routes.nth == 0, routes.owner * tokens + token_of, size * tokens)
    firsts = torch.sort(key.reshape(-1), stable=True)[1][:sum(splits.send)]  # flat (token, choice)
    token = firsts // top_k
    here = routes.owner[token] == routes.owner.reshape(-1)[firsts, None]  # [rows, k]
    slots = torch.cat((torch.where(here, routes.local[token], -1).to(torch.int32),
                       weights[token].view(torch.int32)), 1)  # [rows, 2k]: local ids, weights' bits
    rows = x.new_empty((sum(splits.recv), hidden))
    dist.all_to_all_single(rows, x[token], splits.recv, splits.send, group=group)
    got = slots.new_empty((rows.shape[0], 2 * top_k))
    dist.all_to_all_single(got, slots, splits.recv, splits.send, group=group)

    def experts(pair_rows: torch.Tensor, pair_weights: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
        return moe_experts(pair_rows, w13, w2, pair_weights, pair_ids)

    partials = run_received(rows, got, splits.recv_per_slot, run or experts)

    back = x.new_empty((firsts.shape[0], hidden))
    dist.all_to_all_single(back, partials, splits.send, splits.recv, group=group)
    placed = x.new_zeros((tokens * top_k, hidden))
    placed[firsts] = back  # each (token, rank) partial at the token's first choice there
    return placed.view(tokens, top_k, hidden).sum(1)


def run_received(rows: torch.Tensor, slots: torch.Tensor, per_slot: list[int], run: Experts) -> torch.Tensor:
    """The partial ``[rows, H]`` of each received row: ``run`` on its (row, choice)
    pairs here (``slots [rows, 2k]`` int32, local ids or -1 then the weights' bits), the
    weighted outputs added in float32 in choice order, rounded once to the rows' dtype.
    ``per_slot[s]``: the rows with more than ``s`` choices here (from the counts)."""
    count, top_k = rows.shape[0], slots.shape[1] // 2
    pairs = sum(per_slot)
    if pairs == 0:
        return rows.new_empty((0, rows.shape[1]))
    local = slots[:, :top_k].to(torch.int64)
    pair_weights = slots[:, top_k:].contiguous().view(torch.float32)
    valid = local >= 0
    nth = valid.cumsum(1) - 1  # [rows, k]: the choice's place among the row's choices here
    row_of = torch.arange(count, device=rows.device)[:, None]
    key = torch.where(valid, nth * count + row_of, top_k * count)
    order = torch.sort(key.reshape(-1), stable=True)[1][:pairs]  # every row's 1st choice, then 2nd, ...
    row = order // top_k
    out = run(rows[row], pair_weights.reshape(-1)[order, None], local.reshape(-1)[order, None])  # [pairs, H]
    if pairs == count:  # one choice per row: its output is the partial
        return out
    total = out[:count].float()  # block s holds the rows with an (s+1)-th choice, each once
    start = count
    for width in per_slot[1:]:
        part = slice(start, start + width)
        total[row[part]] += out[part]
        start += width
    return total.to(rows.dtype)
