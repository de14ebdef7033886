"""The order in which the ranks of one fast-path fetch queue their copies (``CopyOrder``).

Each rank of a fetch runs in a thread of its own (``transfer.connector.fastpath``),
and the threads take turns at the GIL and at the GPU's queues; left to
chance, a rank whose copies take 1 ms could queue them before one whose
copies take 5 ms, or wait for its copies while another still had to queue
its own.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch


class CopyOrder:
    """The order in which the ranks of one fetch make what they make while their call
    goes out, queue their copies of the last range, and may wait for them.

    Ranks in ``first`` (pools on another device than ours, whose copies take
    longest) go first twice. Every rank sends its call at once; the ranks in
    ``first`` then make what they make before the first message (and queue
    the copies made before it: ``FastPath.fetch``'s ``expect``), and only
    then the others: the threads share one GIL, and the other ranks' Python
    work delayed the copies of the rank whose copies take longest. And they
    queue their copies of the last range first; the
    others wait until each of those has done so or ended. No rank waits for
    its copies to finish (the digests' trip to the host) before every rank of
    ``ranks`` has queued its own or ended: a thread waiting on the GPU there
    kept another rank's thread from queuing its copies until the first rank's
    were done (BENCHMARKS.md, the fifth session).
    """

    def __init__(self, first: Sequence[int], ranks: Sequence[int] = ()) -> None:
        self._first = frozenset(first)
        self._first_left = set(first)  # ranks of ``first`` that have not queued their copies
        self._preparing = set(first)  # ranks of ``first`` that have not prepared yet
        self._left = set(ranks) | self._first_left  # every rank that has not
        self._cond = threading.Condition()

    @classmethod
    def for_pools(cls, pools: Mapping[int, torch.Tensor], here: torch.device, *,
                  away_first: bool = True) -> CopyOrder:
        """Ranks whose pool is not on ``here`` first (``away_first``), else those whose pool is."""
        first = [rank for rank, pool in pools.items() if (pool.device != here) == away_first]
        return cls(first if len(first) < len(pools) else (), list(pools))

    def may_prepare(self, rank: int, timeout: float) -> None:
        """Return when ``rank`` may make what it makes before its first message (at once
        for the ranks that go first)."""
        if rank not in self._first:
            self._until_empty(self._preparing, timeout)

    def prepared(self, rank: int) -> None:
        """``rank`` made what it makes before its first message."""
        self._leave(rank, self._preparing)

    def turn(self, rank: int, timeout: float) -> None:
        """Return when ``rank`` may queue its copies (at once for the ranks that go first)."""
        if rank not in self._first:
            self._until_empty(self._first_left, timeout)

    def done(self, rank: int) -> None:
        """``rank`` queued its copies, or its fetch ended without them."""
        self._leave(rank, self._preparing, self._first_left, self._left)

    def all_queued(self, timeout: float) -> None:
        """Return once every rank has queued its copies or ended (or at ``timeout``)."""
        self._until_empty(self._left, timeout)

    def _until_empty(self, ranks: set[int], timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not ranks, max(0.0, timeout))

    def _leave(self, rank: int, *sets: set[int]) -> None:
        with self._cond:
            for ranks in sets:
                ranks.discard(rank)
            self._cond.notify_all()
