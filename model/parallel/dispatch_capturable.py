"""The capturable dispatch and combine of prefill EP (``--ep-dispatch capturable``):
``model.parallel.dispatch``'s exchange with every shape fixed before the call, so a
MoE layer runs without a host sync and can be captured in a CUDA graph.

Shapes come from ``capacity``, the most tokens any rank of the group holds for this
forward (the prefill's ``BatchPlan.max_rank_len``, the same on every rank). A rank sends
each rank at most its ``T <= capacity`` tokens, each at most once (the dedup is kept),
so each exchange is an ``all_to_all_single`` with equal splits of a padded
``[size, capacity, ...]`` buffer:

1. counts first, as the sized dispatch: ``[size, k]`` int64 (``route``'s ``per_slot``),
   on the device; here they are never read on the host: ``recv[s, 0]`` says how many of
   the rows from rank ``s`` are real (the rest is padding);
2. dispatch: rank ``r``'s block holds, in token order, the tokens with a choice on ``r``
   (the sized path's order), then zero rows; beside them the ``k`` slots (local id or
   -1, the weights' bits), -1 and zero for a padding row;
3. the received ``size * capacity`` rows' ``k`` slots become ``size * capacity * k``
   (row, choice) pairs ordered as the sized path orders its pairs (every row's first
   choice, then its second, ...), the padding pairs last with id -1 and weight 0.
   ``moe_experts`` (and the block-FP8 kernels) skip id -1: no GEMM row computes it and
   the real pairs fall in the blocks they fall in without it
   (``kernels.moe.experts``). Each row's outputs are added in float32 in choice order
   and rounded once, selected by ``torch.where`` (a padding pair's row is never read
   into a sum, so an unwritten row cannot change a real one);
4. combine: the partials come back with the same fixed shapes and are placed at each
   token's first choice on their rank, then ``.sum(1)`` over ``[T, k, H]``.

Numerics: the same as the sized dispatch, bit for bit: the same (row, choice) pairs in
the same order per expert, the same float32 additions in the same order, the same
zeros and ``.sum(1)`` in the combine. On CUDA the grouped GEMMs pick their tiles by the
pairs' count (``default_moe_tiles``), fixed here at ``size * capacity * k``: where the
sized path's real pairs are few enough to take the decode tiles and this count is not,
the GEMMs' sums run in other k-steps (the bits of a pair's output may differ, as between
any two batch sizes); at prefill sizes both take the prefill tiles.

What padding costs (docs/parallelism.md): each rank sends and receives ``size *
capacity`` rows of ``H`` each way (plus ``8 k`` bytes of slots a row), against the
distinct (token, rank) pairs of the sized path, ``D`` a token for ``D`` ranks reached:
``size / D`` times the bytes at full chunks, more where ranks hold fewer tokens than
``capacity``; the experts' buffers (the pairs' rows, ``h``, their outputs) hold ``size *
capacity * k`` pairs, every rank's worst case (all tokens routed to it), against the
pairs it received. So the sized path stays the default and is the one for large
prefill chunks, where the GEMMs and the bytes outweigh one host sync a layer; this one
is for the shapes a CUDA graph pays for (short chunks, where launches and the sync
bound the layer).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lanekv.kernels.moe.experts import moe_experts
from lanekv.model.parallel.dispatch import Experts, check_layer_args, route


def dispatch_combine_capturable(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
                                w2: torch.Tensor, bounds: tuple[int, ...], group: Any, capacity: int,
                                run: Experts | None = None) -> torch.Tensor:
    """``dispatch_combine``'s output (bit for bit) with shapes fixed by ``capacity``
    (module doc): this rank's ``x [T, H]``, ``weights [T, k]`` float32, ``ids [T, k]``
    int64, ``T <= capacity``; every rank of ``group`` calls it for the layer with the
    same ``capacity``. Only tensors and ints fixed before the call decide the work:
    no host read, no data-dependent shape. ``run`` as ``dispatch_combine``'s, and it
    must skip pairs of id -1 (``moe_experts`` and the block-FP8 kernels do)."""
    size, rank = check_layer_args(weights, ids, w13, bounds, group)
    tokens, top_k = ids.shape
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < tokens:
        raise ValueError(f"capacity must be an int >= this rank's {tokens} tokens, got capacity={capacity!r}")
    hidden, dev = x.shape[1], x.device
    routes = route(ids, bounds)
    recv_counts = torch.empty_like(routes.per_slot)
    dist.all_to_all_single(recv_counts, routes.per_slot, group=group)  # [size, k]: never read on the host

    # token t's row in rank r's block: its place among the tokens with a choice on r
    ranks = torch.arange(size, device=dev)
    mine = routes.owner[:, None, :] == ranks[None, :, None]  # [T, size, k]: choice j is on rank r
    reaches = mine.any(2)  # [T, size]
    place = reaches.long().cumsum(0) - 1
    # rank r's block: the tokens reaching it in order, then the sentinel T (a zero row)
    token_ids = torch.arange(tokens, device=dev)[:, None]
    src = torch.sort(torch.where(reaches, token_ids, tokens), 0)[0].T  # [size, T]
    src = torch.cat((src, src.new_full((size, capacity - tokens), tokens)), 1)  # [size, capacity]
    send_rows = torch.cat((x, x.new_zeros((1, hidden))))[src.reshape(-1)]  # [size * capacity, H]
    local = torch.where(mine, routes.local[:, None, :], -1).to(torch.int32)  # [T, size, k]
    bits = weights.view(torch.int32)[:, None, :].expand(tokens, size, top_k)
    table = torch.cat((torch.cat((local, bits), 2),
                       torch.cat((local.new_full((1, size, top_k), -1), local.new_zeros((1, size, top_k))), 2)))
    send_slots = table[src, ranks[:, None]].reshape(size * capacity, 2 * top_k)  # [rows, 2k]

    rows = torch.empty_like(send_rows)
    dist.all_to_all_single(rows, send_rows, group=group)
    got = torch.empty_like(send_slots)
    dist.all_to_all_single(got, send_slots, group=group)
    real = (torch.arange(capacity, device=dev)[None, :] < recv_counts[:, :1]).reshape(-1)  # [size * capacity]

    def experts(pair_rows: torch.Tensor, pair_weights: torch.Tensor, pair_ids: torch.Tensor) -> torch.Tensor:
        return moe_experts(pair_rows, w13, w2, pair_weights, pair_ids)

    partials = run_received_capturable(rows, got, real, run or experts)

    back = torch.empty_like(partials)
    dist.all_to_all_single(back, partials, group=group)
    # each (token, rank) partial at the token's first choice there, zeros elsewhere (the sentinel row)
    first = routes.nth == 0
    at = torch.where(first, routes.owner * capacity + place.gather(1, routes.owner), size * capacity)
    placed = torch.cat((back, back.new_zeros((1, hidden))))[at]  # [T, k, H]
    return placed.sum(1)


def run_received_capturable(rows: torch.Tensor, slots: torch.Tensor, real: torch.Tensor, run: Experts,
                            ) -> torch.Tensor:
    """``dispatch.run_received`` over a padded block: the partial ``[rows, H]`` of each
    received row (``slots [rows, 2k]`` int32: local ids or -1, then the weights' bits;
    ``real [rows]`` bool: the rows the counts say were sent), zero for a padding row.
    ``run`` sees every (row, choice) slot as a pair, real ones first in the sized
    path's order, the others with id -1 and weight 0."""
    count, top_k = rows.shape[0], slots.shape[1] // 2
    local = torch.where(real[:, None], slots[:, :top_k].to(torch.int64), -1)
    valid = local >= 0  # [rows, k]
    pair_weights = torch.where(valid, slots[:, top_k:].contiguous().view(torch.float32), 0.0)
    nth = valid.cumsum(1) - 1  # the choice's place among the row's choices here
    row_of = torch.arange(count, device=rows.device)[:, None]
    key = torch.where(valid, nth * count + row_of, top_k * count + row_of)
    order = torch.sort(key.reshape(-1))[1]  # unique keys: every row's 1st choice, then 2nd, ..., padding
    out = run(rows[order // top_k], pair_weights.reshape(-1)[order, None], local.reshape(-1)[order, None])
    at = torch.empty_like(order)
    at[order] = torch.arange(order.shape[0], device=rows.device)  # each (row, slot)'s pair
    at = at.view(count, top_k)
    total = torch.zeros((count, rows.shape[1]), dtype=torch.float32, device=rows.device)
    for slot in range(top_k):  # choice order: a row's first output, then each later one added in float32
        y = out[at[:, slot]].float()
        total = torch.where((valid[:, slot] & (nth[:, slot] == 0))[:, None], y,
                            torch.where(valid[:, slot, None], total + y, total))
    return total.to(rows.dtype)
