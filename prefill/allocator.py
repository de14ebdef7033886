"""Logical page allocator with one free list per owner lane.

Lane r hands out the logical pages that rank r owns (``P mod N == r``), so a
page given to the segment that rank r computes is one rank r can write into
its own pool. Allocation is all-or-nothing: running out raises and leaves the
free lists as they were. ``reclaim`` (set by a prefix cache) is asked for the
pages a lane is short of before an allocation gives up.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from lanekv.prefill.plan import BatchPlan


class OutOfPagesError(RuntimeError):
    """Not enough free pages in a lane; nothing was allocated."""


class LaneAllocator:
    def __init__(self, cp_size: int, pages_per_lane: int) -> None:
        for name, value in (("cp_size", cp_size), ("pages_per_lane", pages_per_lane)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {name}={value!r}")
        self.cp_size = cp_size
        self.pages_per_lane = pages_per_lane
        # Free physical pages per lane; logical page = physical * cp_size + lane.
        self._free = [deque(range(pages_per_lane)) for _ in range(cp_size)]
        self._used: set[int] = set()
        self._lock = threading.Lock()
        # Called (outside the lock) with the pages each lane is short of; it frees what it can.
        self.reclaim: Callable[[list[int]], int] | None = None
        # Pages per lane that ``reclaim`` could give back now (cached, held by nobody).
        self.reclaimable: Callable[[], list[int]] | None = None

    @property
    def num_pages(self) -> int:
        return self.cp_size * self.pages_per_lane

    def free_counts(self) -> list[int]:
        """Pages per lane an allocation can take now: the free list, plus cached pages
        nobody holds (``reclaimable``), which an allocation evicts when it needs them."""
        extra = self.reclaimable() if self.reclaimable is not None else [0] * self.cp_size
        return [free + more for free, more in zip(self.free_list_counts(), extra)]

    def free_list_counts(self) -> list[int]:
        """Pages per lane on the free list (neither in use nor cached)."""
        with self._lock:
            return [len(lane) for lane in self._free]

    def num_used(self) -> int:
        with self._lock:
            return len(self._used)

    def allocate(self, lanes: Sequence[int]) -> list[int]:
        """One logical page from each of ``lanes`` (in that order)."""
        need = [0] * self.cp_size
        for i, lane in enumerate(lanes):
            if not isinstance(lane, int) or not 0 <= lane < self.cp_size:
                raise ValueError(f"lanes[{i}] must be in [0, {self.cp_size}), got {lane!r}")
            need[lane] += 1
        for attempt in range(2):
            with self._lock:
                missing = [max(0, need[r] - len(self._free[r])) for r in range(self.cp_size)]
                if not any(missing):
                    pages = [self._free[lane].popleft() * self.cp_size + lane for lane in lanes]
                    self._used.update(pages)
                    return pages
                short = [f"lane {r}: need {need[r]}, free {len(self._free[r])}"
                         for r in range(self.cp_size) if missing[r]]
            if attempt or self.reclaim is None or not self.reclaim(missing):
                break
        raise OutOfPagesError("out of KV pages (" + "; ".join(short) + ")")

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to their lanes. Freeing a page that is not in use is a bug."""
        pages = list(pages)
        with self._lock:
            seen = set()
            for page in pages:
                if page not in self._used or page in seen:
                    raise ValueError(f"page {page} is not allocated (double free or foreign page)")
                seen.add(page)
            for page in pages:
                self._used.discard(page)
                self._free[page % self.cp_size].append(page // self.cp_size)

    def allocate_batch(self, plan: BatchPlan) -> list[list[int]]:
        """The extend pages of every request of ``plan``, each from the lane of the
        rank that computes it; all-or-nothing across the batch."""
        if plan.cp_size != self.cp_size:
            raise ValueError(f"plan.cp_size={plan.cp_size} but the allocator has cp_size={self.cp_size}")
        if not plan.owner_lane:
            raise ValueError(f"owner-lane pages need the in-seq split, got split_mode={plan.mode.value!r}")
        lanes = [req.page_owner_ranks() for req in plan.requests]
        flat = self.allocate([lane for req_lanes in lanes for lane in req_lanes])
        out, cursor = [], 0
        for req_lanes in lanes:
            out.append(flat[cursor : cursor + len(req_lanes)])
            cursor += len(req_lanes)
        return out
