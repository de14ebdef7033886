"""Pinned pages of prefilled requests, until the decode side releases them or
their lease expires.

Each owner rank releases its own pages (through its KVTransfer.Release), so a
lease is held per (request, rank): when every rank has released, the request
is gone. An expired lease frees what is left and tells the ranks to forget the
request. Pages return to the allocator exactly once: whichever of release and
expiry comes first frees them, the other finds nothing left.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class PageOwner(Protocol):
    """Where a lease's pages go back: the lane allocator, or the prefix cache's references."""

    cp_size: int

    def free(self, pages: Iterable[int]) -> None: ...


@dataclass
class _Lease:
    pages_by_rank: dict[int, list[int]]
    deadline: float


class LeaseTable:
    def __init__(self, allocator: PageOwner, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got lease_s={lease_s!r}")
        self.allocator = allocator
        self.lease_s = lease_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()

    def pin(self, request_id: str, pages: Sequence[int]) -> None:
        by_rank: dict[int, list[int]] = {}
        for page in pages:
            by_rank.setdefault(page % self.allocator.cp_size, []).append(page)
        with self._lock:
            if request_id in self._leases:
                raise ValueError(f"request_id={request_id!r} already holds pages")
            self._leases[request_id] = _Lease(by_rank, self._clock() + self.lease_s)

    def renew(self, request_id: str) -> None:
        """Start the request's lease again (its prefill just finished)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.deadline = self._clock() + self.lease_s

    def cancel(self, request_id: str) -> int:
        """Free whatever the request still holds (its prefill failed); how many pages."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return 0
            pages = [p for pages in lease.pages_by_rank.values() for p in pages]
            self.allocator.free(pages)
        return len(pages)

    def release(self, request_id: str, rank: int) -> int:
        """Rank ``rank`` released the request: free its pages. Returns how many."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return 0
            pages = lease.pages_by_rank.pop(rank, [])
            if not lease.pages_by_rank:
                del self._leases[request_id]
            self.allocator.free(pages)
        return len(pages)

    def expire(self) -> list[tuple[str, list[int]]]:
        """Free every expired lease; returns (request_id, ranks that still held pages)."""
        now = self._clock()
        out = []
        with self._lock:
            for rid in [r for r, lease in self._leases.items() if lease.deadline <= now]:
                lease = self._leases.pop(rid)
                self.allocator.free([p for pages in lease.pages_by_rank.values() for p in pages])
                out.append((rid, sorted(lease.pages_by_rank)))
        return out

    def while_held(self, request_id: str, use: Callable[[set[int]], Any]) -> Any:
        """``use(pages the request still holds)`` under the table's lock, so no release
        frees them meanwhile; None (``use`` not called) once the request is gone."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return None
            return use({p for pages in lease.pages_by_rank.values() for p in pages})

    def held(self) -> dict[str, int]:
        with self._lock:
            return {rid: sum(map(len, lease.pages_by_rank.values())) for rid, lease in self._leases.items()}

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases
