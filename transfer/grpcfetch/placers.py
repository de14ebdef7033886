"""The threads that place a fetch's verified chunks, one per owner rank (up to ``MAX_PLACERS``).

Placing a chunk (on a GPU: a host copy and a host-to-device copy) takes about
as long as receiving one, and chunks come from every owner rank at once; one
placing thread for all of them became the limit of a fetch over gRPC once the
ranks' streams got faster. With one rank, chunks are placed in the fetch's own
thread as before.

``place`` is called from several threads at once, each time with cells
(layer, page) no other call has: it must be safe to call concurrently. A
placement that raises ends the fetch with that exception (the fetch's loop
is woken by ``WAKE``); chunks not yet placed are dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

from lanekv.transfer.grpcfetch.fetch import Item, Job

MAX_PLACERS = 4
WAKE = Item(-1, None, None, None)  # what a failed placement puts on the fetch's queue


class Placers:
    def __init__(self, job: Job, place: Callable[[Any, Any], None], release: Callable[[int], None],
                 placed: Callable[[Item], None], count: int) -> None:
        self._job, self._place, self._release, self._placed = job, place, release, placed
        self._pool = futures.ThreadPoolExecutor(max_workers=count, thread_name_prefix="fetch-place") \
            if count > 1 else None
        self._pending: set[futures.Future] = set()
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, item: Item) -> None:
        """Place a chunk (in this thread when there is one placer); raises a failed placement's error."""
        self.check()
        if self._pool is None:
            self._run(item)
            self.check()
            return
        future = self._pool.submit(self._run, item)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)

    def check(self) -> None:
        with self._lock:
            error = self._error
        if error is not None:
            raise error

    def drain(self) -> None:
        """Wait until every submitted chunk is placed; raises a failed placement's error."""
        with self._lock:
            pending = list(self._pending)
        futures.wait(pending)
        self.check()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _done(self, future: futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _run(self, item: Item) -> None:
        try:
            if self._error is None and not self._job.stopping.is_set():
                self._place(item.header, item.tensor)
                self._placed(item)
        except BaseException as err:  # noqa: BLE001 - raised by check() in the fetch's thread
            with self._lock:
                if self._error is None:
                    self._error = err
            self._job.ready.put(WAKE)
        finally:
            if item.done is not None:
                item.done()
            self._release(item.header.nbytes)
