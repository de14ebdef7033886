"""CP planner, owner-lane layout and allocator: worked examples and properties."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lanekv.prefill.allocator import LaneAllocator, OutOfPagesError
from lanekv.prefill.index import build_rank_index
from lanekv.prefill.layout import NotOwnedError, OwnerLaneLayout
from lanekv.prefill.plan import (
    SplitMode,
    plan_batch,
    plan_request,
    round_robin_lens,
    token_balanced_split,
    zigzag_segments,
)

# --- worked examples -------------------------------------------------------


def test_zigzag_cp4_rank0_gets_blocks_0_and_7():
    assert zigzag_segments(0, 4) == (0, 7)
    assert zigzag_segments(3, 4) == (3, 4)
    req = plan_request(8, 0, cp_size=4, page_size=1, mode=SplitMode.IN_SEQ_TOKENS)
    assert [s.rank for s in req.segments] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_token_balanced_gives_extras_to_first_segments():
    assert token_balanced_split(10, 2) == [3, 3, 2, 2]
    assert token_balanced_split(3, 2) == [1, 1, 1, 0]


def test_round_robin_lens():
    assert round_robin_lens(10, 4) == [3, 3, 2, 2]
    assert round_robin_lens(2, 4) == [1, 1, 0, 0]


def test_page_aligned_split_example():
    # 10 tokens, page 4 -> 3 pages (4, 4, 2 valid) dealt to 4 segments: 1,1,1,0.
    req = plan_request(10, 8, cp_size=2, page_size=4)
    assert [(s.rank, s.start, s.compute_len, s.valid_len) for s in req.segments] == [
        (0, 0, 4, 4),
        (1, 4, 4, 4),
        (1, 8, 4, 2),
        (0, 12, 0, 0),
    ]
    assert req.last_token() == (1, 5)  # rank 1: 4 rows of segment 1, then row 1 of segment 2
    assert req.page_owner_ranks() == [0, 1, 1]


def test_rank_view_names_segments_pages_and_valid_spans():
    req = plan_request(10, 8, cp_size=2, page_size=4)  # pages 4+4+2 valid, dealt 1,1,1,0
    r0, r1 = req.rank_view(0), req.rank_view(1)
    assert (r0.prev.start, r0.prev.compute_len, r0.next.compute_len) == (0, 4, 0)
    assert list(r0.prev_pages) == [0] and list(r0.next_pages) == []
    assert r0.valid_spans == ((0, 4), (4, 4))
    assert list(r1.prev_pages) == [1] and list(r1.next_pages) == [2]
    assert r1.valid_spans == ((0, 4), (4, 6))  # the last page holds 2 real rows
    with pytest.raises(ValueError, match="in-seq"):
        plan_request(10, 0, cp_size=2, page_size=1, mode=SplitMode.ROUND_ROBIN).rank_view(0)


def test_short_request_is_padded_to_one_page_per_rank():
    # 1 token, cp 4: one real page, three dummy pages so every rank computes.
    req = plan_request(1, 0, cp_size=4, page_size=16)
    assert [r for r in range(4) if req.rank_compute_len(r) == 16] == [0, 1, 2, 3]
    assert req.rank_valid_len(0) == 1 and sum(req.rank_valid_len(r) for r in range(4)) == 1
    assert req.compute_len == 64


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(extend_lens=[4], cp_size=0, page_size=1), "cp_size"),
        (dict(extend_lens=[4], cp_size=2, page_size=0), "page_size"),
        (dict(extend_lens=[0], cp_size=2, page_size=1), "extend_len"),
        (dict(extend_lens=[-3], cp_size=2, page_size=1), "extend_len"),
        (dict(extend_lens=[4], prefix_lens=[3], cp_size=2, page_size=4), "prefix_len"),
        (dict(extend_lens=[4], cp_size=2, page_size=1, mode="round_robin"), "owner-lane"),
        (dict(extend_lens=[4], cp_size=2, page_size=1, mode="zigzag"), "split_mode"),
        (dict(extend_lens=[], cp_size=2, page_size=1), "extend_lens"),
    ],
)
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        plan_batch(**kwargs)


def test_one_rank_without_a_cached_prefix_keeps_the_rows_in_order():
    one = build_rank_index(plan_batch([100], cp_size=1, page_size=16), 0)
    assert one.rerange_in_order and torch.equal(one.rerange_index, torch.arange(112))  # 7 pages
    prefixed = build_rank_index(plan_batch([40], [32], cp_size=1, page_size=16), 0,
                                prefix_pages=[[0, 1]], extend_pages=[[2, 3, 4]])
    assert not prefixed.rerange_in_order  # the prefix rows come from the block's end
    split = build_rank_index(plan_batch([100], cp_size=2, page_size=16), 0)
    assert not split.rerange_in_order


def test_rank_out_of_range():
    plan = plan_batch([5], cp_size=2, page_size=1)
    with pytest.raises(ValueError, match="cp_rank"):
        build_rank_index(plan, 2)
    with pytest.raises(ValueError, match="cp_rank"):
        OwnerLaneLayout(2, 4).owned_by(-1, torch.tensor([0]))


# --- layout ----------------------------------------------------------------


def test_owner_lane_layout_roundtrip():
    lay = OwnerLaneLayout(cp_size=3, page_size=4)
    locs = torch.arange(0, 3 * 4 * 5)
    rank, row = lay.loc_to_rank_row(locs)
    assert torch.equal(rank, (locs // 4) % 3)
    assert torch.equal(row, (locs // 12) * 4 + locs % 4)
    for r in range(3):
        mine = locs[rank == r]
        assert torch.equal(lay.rank_row_to_loc(r, row[rank == r]), mine)
        assert bool(lay.owned_by(r, mine).all())
        # each rank's rows are a compact range: 1/N of the bytes, no replica
        assert sorted(row[rank == r].tolist()) == list(range(20))
    with pytest.raises(NotOwnedError, match="rank 1"):
        lay.physical_rows(0, torch.tensor([4]))


# --- properties ------------------------------------------------------------

batches = st.integers(1, 8).flatmap(
    lambda cp: st.integers(1, 128).flatmap(
        lambda ps: st.tuples(
            st.just(cp),
            st.just(ps),
            st.lists(
                st.tuples(st.integers(1, 5000), st.integers(0, 3)), min_size=1, max_size=4
            ),
        )
    )
)


LANE_PAGES = 4 * 5000 + 16  # enough for 4 requests of 5000 one-token pages


def _simulate(cp, ps, reqs, mode=SplitMode.IN_SEQ):
    extend = [e for e, _ in reqs]
    prefix = [k * ps for _, k in reqs]
    plan = plan_batch(extend, prefix, cp_size=cp, page_size=ps, mode=mode, owner_lane=mode is SplitMode.IN_SEQ)
    alloc = LaneAllocator(cp, LANE_PAGES)
    prefix_pages = [alloc.allocate([i % cp for i in range(k)]) for _, k in reqs]
    extend_pages = alloc.allocate_batch(plan) if mode is SplitMode.IN_SEQ else None
    idx = [
        build_rank_index(plan, r, extend_pages=extend_pages, prefix_pages=prefix_pages)
        for r in range(cp)
    ]
    return plan, alloc, prefix_pages, extend_pages, idx


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_page_aligned_plan_properties(case):
    cp, ps, reqs = case
    plan, alloc, prefix_pages, extend_pages, idx = _simulate(cp, ps, reqs)
    lay = OwnerLaneLayout(cp, ps)
    total = sum(e for e, _ in reqs)
    # every valid token is computed by exactly one rank
    seen = torch.cat([ix.input_index[ix.input_index >= 0] for ix in idx])
    assert torch.equal(torch.sort(seen).values, torch.arange(total))
    for req in plan.requests:
        # no segment boundary cuts a page; valid rows are a prefix of compute rows
        for s in req.segments:
            assert s.start % ps == 0 and s.compute_len % ps == 0
            assert 0 <= s.valid_len <= s.compute_len
        # every rank computes at least one whole page of every request
        assert all(req.rank_compute_len(r) >= ps for r in range(cp))
    for r, ix in enumerate(idx):
        # dummy rows never get a cache loc: writes are exactly the valid rows
        assert torch.equal(ix.valid_rows, torch.nonzero(ix.input_index >= 0).flatten())
        assert ix.write_locs.numel() == ix.valid_rows.numel()
        # every valid loc is owned by the rank that computes it
        assert bool(lay.owned_by(r, ix.write_locs).all())
        # positions: real rows sit at prefix + offset, dummy rows continue past the end
        req_of_row = torch.repeat_interleave(
            torch.tensor(ix.seg_request, dtype=torch.int64), torch.tensor(ix.seg_q_len)
        )
        prefix_t = torch.tensor([q.prefix_len for q in plan.requests])
        end_t = torch.tensor([q.seq_len for q in plan.requests])
        start_t = torch.cumsum(torch.tensor([0] + [q.extend_len for q in plan.requests]), 0)
        real = ix.input_index >= 0
        assert torch.equal(
            ix.positions[real],
            prefix_t[req_of_row[real]] + ix.input_index[real] - start_t[req_of_row[real]],
        )
        assert bool((ix.positions[~real] >= end_t[req_of_row[~real]]).all())
        # the rerange is said to keep the rows' order exactly when it does (then a slice replaces it)
        in_order = torch.equal(ix.rerange_index, torch.arange(ix.rerange_index.numel()))
        assert ix.rerange_in_order == in_order
    # the locs written across ranks are the requests' pages, each row once
    all_locs = torch.sort(torch.cat([ix.write_locs for ix in idx])).values
    expect = torch.sort(
        torch.cat(
            [torch.tensor(p, dtype=torch.int64)[:, None] * ps + torch.arange(ps) for p in extend_pages]
        ).flatten()
    ).values
    # the last page of each request may be partial: compare against its valid rows
    valid_expect = []
    for req, pages in zip(plan.requests, extend_pages):
        rows = torch.arange(req.extend_len)
        valid_expect.append(torch.tensor(pages)[rows // ps] * ps + rows % ps)
    assert torch.equal(all_locs, torch.sort(torch.cat(valid_expect)).values)
    assert set(all_locs.tolist()) <= set(expect.tolist())
    # last token owner and row point at the real last token
    offsets = torch.cumsum(torch.tensor([0] + [e for e, _ in reqs]), 0)
    for b, (t, req) in enumerate(zip(plan.last_tokens, plan.requests)):
        assert int(idx[t.rank].input_index[t.local_row]) == int(offsets[b]) + req.extend_len - 1
        assert idx[t.rank].last_rows[b] == t.local_row
    # allocator: no page twice; freeing returns to the start
    used = [p for pages in prefix_pages + extend_pages for p in pages]
    assert len(used) == len(set(used)) == alloc.num_used()
    alloc.free(used)
    assert alloc.free_counts() == [LANE_PAGES] * cp and alloc.num_used() == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches, st.sampled_from(list(SplitMode)))
def test_split_gather_rerange_roundtrip(case, mode):
    cp, ps, reqs = case
    reqs = [(min(e, 600), k) for e, k in reqs]  # round-robin plans a segment per token
    plan, _, prefix_pages, _, idx = _simulate(cp, ps, reqs, mode)
    lay = OwnerLaneLayout(cp, ps)
    # A value per (request, position): what the K/V of that row would be.
    def value(b, pos):
        return (b + 1) * 100000 + pos

    inputs = torch.cat(
        [torch.tensor([value(b, req.prefix_len + i) for i in range(req.extend_len)]) for b, req in enumerate(plan.requests)]
    )
    # rank pools hold the prefix pages they own
    pools = [torch.full((LANE_PAGES * ps,), -7, dtype=torch.int64) for _ in range(cp)]
    for b, pages in enumerate(prefix_pages):
        for k, page in enumerate(pages):
            rows = lay.loc_to_rank_row(page * ps + torch.arange(ps))
            pools[int(rows.rank[0])][rows.row] = torch.tensor([value(b, k * ps + o) for o in range(ps)])
    blocks = []
    for r, ix in enumerate(idx):
        local = torch.where(ix.input_index >= 0, inputs[ix.input_index.clamp(min=0)], -1)
        block = torch.full((ix.block_rows,), -9, dtype=torch.int64)
        block[: local.numel()] = local
        sent = pools[r][ix.prefix_send_rows]
        block[ix.compute_block_rows : ix.compute_block_rows + sent.numel()] = sent
        blocks.append(block)
    gathered = torch.cat(blocks)  # the all-gather, rank-major
    for ix in idx:
        out = gathered[ix.rerange_index]
        for b, req in enumerate(plan.requests):
            start = ix.kv_offsets[b]
            got = out[start : start + req.prefix_len + req.extend_len]
            assert got.tolist() == [value(b, p) for p in range(req.seq_len)]


def test_allocator_out_of_pages_leaves_state_unchanged():
    alloc = LaneAllocator(2, 3)
    first = alloc.allocate([0, 0, 1])
    before = alloc.free_counts()
    with pytest.raises(OutOfPagesError, match="lane 0"):
        alloc.allocate([0, 0, 1])
    assert alloc.free_counts() == before == [1, 2]
    assert all(p % 2 == lane for p, lane in zip(first, [0, 0, 1]))
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([first[0], first[0]])
    assert alloc.free_counts() == before
    alloc.free(first)
    assert alloc.free_counts() == [3, 3]
    with pytest.raises(ValueError, match="lanes"):
        alloc.allocate([2])


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(st.integers(0, 3), max_size=6), max_size=12))
def test_allocator_accounting(cp, ops):
    alloc = LaneAllocator(cp, 8)
    held = []
    for lanes in ops:
        lanes = [x % cp for x in lanes]
        try:
            pages = alloc.allocate(lanes)
        except OutOfPagesError:
            continue
        assert all(p % cp == lane for p, lane in zip(pages, lanes))
        held.append(pages)
        flat = [p for h in held for p in h]
        assert len(flat) == len(set(flat))
        if len(held) > 2:
            alloc.free(held.pop(0))
    for h in held:
        alloc.free(h)
    assert alloc.free_counts() == [8] * cp
