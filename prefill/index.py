"""Index maps for one CP rank, built once per batch (never per layer).

Given a ``BatchPlan`` and the request's logical pages, ``build_rank_index``
returns the tensors the runner needs on rank ``cp_rank``:

(a) ``input_index``/``positions``: pick this rank's compute rows out of the
    request-ordered input (the concatenated extends). Dummy rows get input
    index -1 (fed as token 0) and positions that continue past the last token.
(b) ``rerange_index``: the all-gathered, padded, rank-major buffer back into
    request order. Each rank contributes a block of ``block_rows`` rows: its
    compute rows (padded to the largest rank), then the rows of the cached
    prefix pages it owns (padded likewise). The gathered result per request is
    [prefix rows][compute rows] in position order, which is the K/V the
    attention kernel reads (``kv_offsets``).
(c) ``valid_rows``/``write_locs``: the rank-local rows that are real tokens and
    the logical cache locs they are written to.

Plus ``prefix_send_rows``: the physical pool rows of the prefix pages this rank
owns, in the order they enter its block, and the attention segments.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from lanekv.prefill.layout import OwnerLaneLayout
from lanekv.prefill.plan import BatchPlan, check_rank


class RankIndex(NamedTuple):
    input_index: torch.Tensor  # [n_local] int64, -1 for dummy rows
    positions: torch.Tensor  # [n_local] int64 absolute positions
    valid_rows: torch.Tensor  # [n_valid_local] int64 rank-local rows of real tokens
    write_locs: torch.Tensor  # [n_valid_local] int64 logical locs (empty if no pages given)
    prefix_send_rows: torch.Tensor  # [n_prefix_rows_local] int64 physical rows of owned prefix pages
    block_rows: int  # rows each rank contributes to the all-gather
    compute_block_rows: int  # the compute part of a block (max rank-local rows)
    rerange_index: torch.Tensor  # [sum(prefix + compute)] int64 rows of the gathered buffer
    kv_offsets: list[int]  # per request: first row of its K/V in the reranged buffer
    seg_q_start: list[int]  # attention segments of this rank (rank-local rows)
    seg_q_len: list[int]
    seg_q_pos: list[int]
    seg_request: list[int]
    last_rows: list[int]  # per request: rank-local row of its last token, -1 if not here
    # The rerange keeps the gathered rows in order (one run from row 0: one rank and
    # no cached prefix), so it is their first len(rerange_index) rows.
    rerange_in_order: bool = False


def _expand(starts: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of consecutive runs: (run id per row, offset inside its run)."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    n = int(lens_t.sum())
    run = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int64), lens_t)
    first = torch.cumsum(lens_t, 0) - lens_t
    within = torch.arange(n, dtype=torch.int64) - first[run]
    return run, within


def build_rank_index(
    plan: BatchPlan,
    cp_rank: int,
    *,
    extend_pages: list[list[int]] | None = None,
    prefix_pages: list[list[int]] | None = None,
    device: torch.device | str = "cpu",
) -> RankIndex:
    """Index maps for ``cp_rank``. ``extend_pages[b]``/``prefix_pages[b]`` are the
    logical pages of request b's extend and cached prefix, in position order."""
    check_rank(cp_rank, plan.cp_size)
    n, ps = plan.cp_size, plan.page_size
    reqs = plan.requests
    if prefix_pages is None:
        if any(r.prefix_len for r in reqs):
            raise ValueError("prefix_pages is required when a request has prefix_len > 0")
        prefix_pages = [[] for _ in reqs]
    for b, (req, pages) in enumerate(zip(reqs, prefix_pages)):
        if len(pages) != req.prefix_pages:
            raise ValueError(
                f"prefix_pages[{b}] has {len(pages)} pages, expected {req.prefix_pages} "
                f"for prefix_len={req.prefix_len} page_size={ps}"
            )
    if extend_pages is not None:
        for b, (req, pages) in enumerate(zip(reqs, extend_pages)):
            if len(pages) != req.num_pages:
                raise ValueError(
                    f"extend_pages[{b}] has {len(pages)} pages, expected {req.num_pages} "
                    f"for extend_len={req.extend_len} page_size={ps}"
                )

    # (a) and (c): this rank's rows.
    input_offsets = [0]
    for req in reqs[:-1]:
        input_offsets.append(input_offsets[-1] + req.extend_len)
    starts, lens, valid, pos0, in0, seg_req = [], [], [], [], [], []
    seg_q_start, cursor = [], 0
    for b, req in enumerate(reqs):
        for seg in req.rank_segments(cp_rank):
            starts.append(seg.start)
            lens.append(seg.compute_len)
            valid.append(seg.valid_len)
            pos0.append(req.prefix_len + seg.start)
            in0.append(input_offsets[b] + seg.start)
            seg_req.append(b)
            seg_q_start.append(cursor)
            cursor += seg.compute_len
    run, within = _expand(starts, lens)
    is_valid = within < torch.tensor(valid, dtype=torch.int64)[run]
    positions = torch.tensor(pos0, dtype=torch.int64)[run] + within
    input_index = torch.where(is_valid, torch.tensor(in0, dtype=torch.int64)[run] + within, -1)
    valid_rows = torch.nonzero(is_valid).flatten()
    if extend_pages is not None:
        offset_in_extend = torch.tensor(starts, dtype=torch.int64)[run] + within
        page_base = [0]
        for pages in extend_pages:
            page_base.append(page_base[-1] + len(pages))
        flat_pages = torch.tensor([p for pages in extend_pages for p in pages], dtype=torch.int64)
        page_idx = torch.tensor(page_base[:-1], dtype=torch.int64)[torch.tensor(seg_req, dtype=torch.int64)[run]]
        page_idx = page_idx + offset_in_extend // ps
        sel = valid_rows
        write_locs = flat_pages[page_idx[sel]] * ps + offset_in_extend[sel] % ps
    else:
        write_locs = torch.empty(0, dtype=torch.int64)

    # Prefix pages: each rank sends the ones it owns, in request/page order.
    layout = OwnerLaneLayout(n, ps)
    owned_lists: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # rank -> [(b, k)]
    for b, pages in enumerate(prefix_pages):
        for k, page in enumerate(pages):
            owned_lists[page % n].append((b, k))
    prefix_slot = {}
    for rank in range(n):
        for i, bk in enumerate(owned_lists[rank]):
            prefix_slot[bk] = (rank, i)
    max_prefix_rows = max(len(lst) for lst in owned_lists) * ps
    compute_block = plan.max_rank_len
    block_rows = compute_block + max_prefix_rows
    own_pages = [prefix_pages[b][k] for b, k in owned_lists[cp_rank]]
    if own_pages:
        phys = layout.physical_pages(torch.tensor(own_pages, dtype=torch.int64))
        prefix_send_rows = (phys[:, None] * ps + torch.arange(ps)).flatten()
    else:
        prefix_send_rows = torch.empty(0, dtype=torch.int64)

    # (b) rerange: runs of consecutive gathered rows, in request/position order.
    run_src, run_len, kv_offsets, cursor = [], [], [], 0
    for b, req in enumerate(reqs):
        kv_offsets.append(cursor)
        for k in range(req.prefix_pages):
            rank, i = prefix_slot[(b, k)]
            run_src.append(rank * block_rows + compute_block + i * ps)
            run_len.append(ps)
        local = {rank: plan.request_offsets[rank][b] for rank in range(n)}
        for seg in req.segments:
            run_src.append(seg.rank * block_rows + local[seg.rank])
            run_len.append(seg.compute_len)
            local[seg.rank] += seg.compute_len
        cursor += req.prefix_len + req.compute_len
    run, within = _expand(run_src, run_len)
    rerange_index = torch.tensor(run_src, dtype=torch.int64)[run] + within
    starts = itertools.accumulate(run_len, initial=0)  # where each run lands
    in_order = all(src == start for src, start, n in zip(run_src, starts, run_len) if n)

    last_rows = [t.local_row if t.rank == cp_rank else -1 for t in plan.last_tokens]
    to = dict(device=device)
    return RankIndex(
        input_index=input_index.to(**to),
        positions=positions.to(**to),
        valid_rows=valid_rows.to(**to),
        write_locs=write_locs.to(**to),
        prefix_send_rows=prefix_send_rows.to(**to),
        block_rows=block_rows,
        compute_block_rows=compute_block,
        rerange_index=rerange_index.to(**to),
        kv_offsets=kv_offsets,
        seg_q_start=seg_q_start,
        seg_q_len=lens,
        seg_q_pos=pos0,
        seg_request=seg_req,
        last_rows=last_rows,
        rerange_in_order=in_order,
    )
