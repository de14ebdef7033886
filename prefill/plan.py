"""The context-parallel planner: which rank computes which rows of a batch.

A request's extend (the tokens after its cached prefix) is cut into segments;
each segment is computed by one CP rank. Three split modes:

- ``IN_SEQ`` (page-aligned zigzag, the mode owner-lane KV needs): the extend's
  pages are dealt to 2N segments, rank r computes segments r and 2N-1-r. No
  segment boundary cuts a page. Every page of the compute view is a full
  ``page_size`` rows and every request has at least N compute pages, so each
  rank computes at least one whole page of every request; the extra rows are
  dummy rows that never reach the cache.
- ``IN_SEQ_TOKENS`` (token-balanced zigzag): the same 2N segments cut by
  tokens, without padding. For attention only.
- ``ROUND_ROBIN``: token i goes to rank i % N. For attention only.

A segment's valid rows are always a prefix of its compute rows, and the dummy
rows of a request all sit after its real last token, so causal attention of a
real query never sees a dummy key.

The batch plan is request-first: each request is split on its own, then the
segments of each rank are concatenated in request order ("rank-local rows").
The index maps the runner needs are built once per batch in ``prefill.index``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple


class SplitMode(str, enum.Enum):
    IN_SEQ = "in_seq"
    IN_SEQ_TOKENS = "in_seq_tokens"
    ROUND_ROBIN = "round_robin"


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")


def check_rank(cp_rank: int, cp_size: int) -> None:
    _check_positive("cp_size", cp_size)
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, {cp_size}), got cp_rank={cp_rank!r}")


def deal(units: int, parts: int) -> list[int]:
    """Deal ``units`` to ``parts`` as evenly as possible, extras to the first parts."""
    base, extra = divmod(units, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def token_balanced_split(extend_len: int, cp_size: int) -> list[int]:
    """Lengths of the 2N zigzag segments of a token-balanced split."""
    _check_positive("cp_size", cp_size)
    if extend_len < 0:
        raise ValueError(f"extend_len must be >= 0, got extend_len={extend_len}")
    return deal(extend_len, 2 * cp_size)


def round_robin_lens(extend_len: int, cp_size: int) -> list[int]:
    """Query rows per rank when token i goes to rank i % cp_size."""
    _check_positive("cp_size", cp_size)
    if extend_len < 0:
        raise ValueError(f"extend_len must be >= 0, got extend_len={extend_len}")
    return [max(0, (extend_len - r + cp_size - 1) // cp_size) for r in range(cp_size)]


def zigzag_segments(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The (prev, next) segment indices that rank ``cp_rank`` computes."""
    check_rank(cp_rank, cp_size)
    return cp_rank, 2 * cp_size - 1 - cp_rank


class Segment(NamedTuple):
    """Consecutive rows of one request computed by one rank.

    ``start`` is the offset of the first row from the start of the extend
    (absolute position = prefix_len + start). The first ``valid_len`` rows are
    real tokens; the remaining ``compute_len - valid_len`` are dummy rows.
    """

    rank: int
    start: int
    compute_len: int
    valid_len: int


class RankView(NamedTuple):
    """One rank's share of one request (in-seq split). Page ranges count extend
    pages (compute view); ``valid_spans`` are [start, end) rows of real tokens
    inside the rank's compute rows of this request (prev rows, then next rows)."""

    prev: Segment
    next: Segment
    prev_pages: range
    next_pages: range
    valid_spans: tuple[tuple[int, int], tuple[int, int]]


class LastToken(NamedTuple):
    rank: int
    local_row: int  # row inside that rank's rows of the batch


@dataclass(frozen=True)
class RequestPlan:
    prefix_len: int
    extend_len: int
    page_size: int
    cp_size: int
    segments: tuple[Segment, ...]  # position order

    @property
    def compute_len(self) -> int:
        return sum(s.compute_len for s in self.segments)

    @property
    def seq_len(self) -> int:
        return self.prefix_len + self.extend_len

    @property
    def prefix_pages(self) -> int:
        return self.prefix_len // self.page_size

    @property
    def num_pages(self) -> int:
        """Pages the extend's real tokens occupy (the last may be partial)."""
        return -(-self.extend_len // self.page_size)

    def rank_segments(self, cp_rank: int) -> tuple[Segment, ...]:
        return tuple(s for s in self.segments if s.rank == cp_rank)

    def rank_compute_len(self, cp_rank: int) -> int:
        return sum(s.compute_len for s in self.segments if s.rank == cp_rank)

    def rank_valid_len(self, cp_rank: int) -> int:
        return sum(s.valid_len for s in self.segments if s.rank == cp_rank)

    def rank_view(self, cp_rank: int) -> RankView:
        """What ``cp_rank`` computes of this request (in-seq modes): its (prev, next)
        segments, their extend page ranges, and where its valid rows sit inside its
        compute rows."""
        if self.segments and len(self.segments) != 2 * self.cp_size:
            raise ValueError("rank_view needs an in-seq plan (2 * cp_size segments)")
        prev_seg, next_seg = (self.segments[i] for i in zigzag_segments(cp_rank, self.cp_size))
        ps = self.page_size
        return RankView(
            prev=prev_seg,
            next=next_seg,
            prev_pages=range(prev_seg.start // ps, (prev_seg.start + prev_seg.compute_len) // ps),
            next_pages=range(next_seg.start // ps, (next_seg.start + next_seg.compute_len) // ps),
            valid_spans=((0, prev_seg.valid_len), (prev_seg.compute_len, prev_seg.compute_len + next_seg.valid_len)),
        )

    def page_owner_ranks(self) -> list[int]:
        """For each extend page (in order), the rank that computes it (IN_SEQ only)."""
        owners = [-1] * self.num_pages
        for s in self.segments:
            first = s.start // self.page_size
            for k in range(first, first + -(-s.valid_len // self.page_size)):
                owners[k] = s.rank
        return owners

    def last_token(self) -> tuple[int, int]:
        """(rank, row inside this request's rows on that rank) of the real last token."""
        last = self.extend_len - 1
        for seg in self.segments:
            if seg.start <= last < seg.start + seg.valid_len:
                row = last - seg.start
                for other in self.segments:
                    if other is seg:
                        break
                    if other.rank == seg.rank:
                        row += other.compute_len
                return seg.rank, row
        raise RuntimeError(f"last token {last} is in no segment of {self.segments}")


def plan_request(
    extend_len: int,
    prefix_len: int,
    *,
    cp_size: int,
    page_size: int,
    mode: SplitMode = SplitMode.IN_SEQ,
) -> RequestPlan:
    _check_positive("cp_size", cp_size)
    _check_positive("page_size", page_size)
    if not isinstance(extend_len, int) or extend_len <= 0:
        raise ValueError(f"extend_len must be a positive integer, got extend_len={extend_len!r}")
    if not isinstance(prefix_len, int) or prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got prefix_len={prefix_len!r}")
    if prefix_len % page_size:
        raise ValueError(
            f"prefix_len must be a multiple of page_size={page_size}, got prefix_len={prefix_len}"
        )
    mode = SplitMode(mode)
    n_seg = 2 * cp_size
    segments: list[Segment] = []
    if mode is SplitMode.ROUND_ROBIN:
        segments = [Segment(i % cp_size, i, 1, 1) for i in range(extend_len)]
    elif mode is SplitMode.IN_SEQ_TOKENS:
        start = 0
        for i, length in enumerate(token_balanced_split(extend_len, cp_size)):
            rank = i if i < cp_size else n_seg - 1 - i
            segments.append(Segment(rank, start, length, length))
            start += length
    else:
        num_pages = -(-extend_len // page_size)
        # Compute padding: at least cp_size page units, so every rank computes
        # at least one whole page; with num_pages >= cp_size both views deal
        # the same pages, otherwise the first num_pages segments are the real
        # ones and the rest of the first cp_size hold one dummy page each.
        compute_pages = deal(max(num_pages, cp_size), n_seg)
        start = 0
        for i, pages in enumerate(compute_pages):
            rank = i if i < cp_size else n_seg - 1 - i
            compute_len = pages * page_size
            valid_len = min(compute_len, max(0, extend_len - start))
            segments.append(Segment(rank, start, compute_len, valid_len))
            start += compute_len
    return RequestPlan(prefix_len, extend_len, page_size, cp_size, tuple(segments))


@dataclass(frozen=True)
class BatchPlan:
    """A batch of requests planned for ``cp_size`` ranks, request-first."""

    cp_size: int
    page_size: int
    mode: SplitMode
    requests: tuple[RequestPlan, ...]

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    @property
    def owner_lane(self) -> bool:
        return self.mode is SplitMode.IN_SEQ

    @cached_property
    def rank_lens(self) -> tuple[int, ...]:
        """Rank-local compute rows of the whole batch, per rank."""
        return tuple(
            sum(r.rank_compute_len(rank) for r in self.requests) for rank in range(self.cp_size)
        )

    @property
    def max_rank_len(self) -> int:
        return max(self.rank_lens)

    @cached_property
    def request_offsets(self) -> tuple[tuple[int, ...], ...]:
        """[rank][request] -> first rank-local row of that request on that rank."""
        out = []
        for rank in range(self.cp_size):
            offsets, cursor = [], 0
            for req in self.requests:
                offsets.append(cursor)
                cursor += req.rank_compute_len(rank)
            out.append(tuple(offsets))
        return tuple(out)

    @cached_property
    def last_tokens(self) -> tuple[LastToken, ...]:
        """Per request: the rank holding its real last token and the rank-local row."""
        out = []
        for b, req in enumerate(self.requests):
            rank, row = req.last_token()
            out.append(LastToken(rank, self.request_offsets[rank][b] + row))
        return tuple(out)


def plan_batch(
    extend_lens: list[int],
    prefix_lens: list[int] | None = None,
    *,
    cp_size: int,
    page_size: int,
    mode: SplitMode | str = SplitMode.IN_SEQ,
    owner_lane: bool = True,
) -> BatchPlan:
    """Plan a batch. ``owner_lane`` (the KV layout of DESIGN.md) needs IN_SEQ."""
    _check_positive("cp_size", cp_size)
    _check_positive("page_size", page_size)
    try:
        mode = SplitMode(mode)
    except ValueError:
        raise ValueError(
            f"split_mode must be one of {[m.value for m in SplitMode]}, got split_mode={mode!r}"
        ) from None
    if owner_lane and mode is not SplitMode.IN_SEQ:
        raise ValueError(
            f"owner-lane KV needs the page-aligned in-seq split, got split_mode={mode.value!r} "
            "with owner_lane=True"
        )
    if prefix_lens is None:
        prefix_lens = [0] * len(extend_lens)
    if len(extend_lens) != len(prefix_lens):
        raise ValueError(
            f"extend_lens and prefix_lens differ in length: {len(extend_lens)} != {len(prefix_lens)}"
        )
    if not extend_lens:
        raise ValueError("extend_lens is empty: a batch needs at least one request")
    requests = []
    for b, (extend_len, prefix_len) in enumerate(zip(extend_lens, prefix_lens)):
        try:
            requests.append(
                plan_request(extend_len, prefix_len, cp_size=cp_size, page_size=page_size, mode=mode)
            )
        except ValueError as err:
            raise ValueError(f"request {b}: {err}") from None
    return BatchPlan(cp_size, page_size, mode, tuple(requests))
