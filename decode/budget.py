"""Admission by pages: what a decode daemon has promised to the requests it admitted."""

from __future__ import annotations

import threading
from collections import deque


class PageBudget:
    """Pages promised to admitted requests, each counted at its longest possible length.

    A request is admitted only when every page it may ever hold (prompt plus
    ``max_new_tokens``) fits beside the promises already made, so the pool never
    runs dry under a running request and ``DecodeEngine`` admits it at once.
    Waiters are served in arrival order: a large request is not overtaken forever.
    """

    def __init__(self, total_pages: int) -> None:
        self.total_pages = total_pages
        self._used = 0
        self._waiters: deque[object] = deque()
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        with self._cond:
            return self._used

    def acquire(self, pages: int, timeout_s: float, abandoned: threading.Event) -> bool:
        """Promise ``pages``; False when ``timeout_s`` passes or ``abandoned`` is set first."""
        if pages > self.total_pages:
            raise ValueError(f"{pages} pages can never fit a pool of {self.total_pages}")
        ticket = object()
        with self._cond:
            self._waiters.append(ticket)
            try:
                self._cond.wait_for(
                    lambda: abandoned.is_set()
                    or (self._waiters[0] is ticket and self._used + pages <= self.total_pages),
                    timeout=timeout_s,
                )
                if abandoned.is_set() or self._waiters[0] is not ticket or self._used + pages > self.total_pages:
                    return False
                self._used += pages
                return True
            finally:
                self._waiters.remove(ticket)
                self._cond.notify_all()

    def release(self, pages: int) -> None:
        with self._cond:
            self._used -= pages
            self._cond.notify_all()

    def wake(self) -> None:
        """Let waiters re-check (one of them was abandoned)."""
        with self._cond:
            self._cond.notify_all()
