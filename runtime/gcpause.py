"""Garbage-collector pauses of a serving process: timed, and kept out of the hot path.

A daemon imports torch, Triton and gRPC and compiles its kernels before it
serves: a few hundred thousand tracked objects that live as long as the
process. A full collection walks all of them while the thread that runs the
model waits (tens of milliseconds on one request's path). ``freeze_start_up``
collects once and moves every object alive at that moment into the permanent
generation, so later collections walk only what serving made; it is called
once the daemon is warm, before it reports SERVING, and undone (``thaw``)
before the process exits, so the interpreter's last collections free it
(Triton's nanobind bindings report at exit every object nobody freed).
A worker process (a prefill CP rank, a decode TP rank) skips those last
collections altogether: ``exit_at_once`` ends it once its work is cleaned up,
since freeing a torch process's heap object by object is most of its stop.
``frozen`` does both around a daemon's serving; ``paused`` keeps the collector
out of a block (CUDA graph capture). ``GcClock`` adds up the
time spent in collections (``gc.callbacks``), for the timings a daemon reports.
Both are process-wide by nature, as the collector is.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn


def freeze_start_up() -> int:
    """Collect, then freeze what is left (``gc.freeze``); the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Undo ``freeze_start_up``: everything frozen is collected as usual again."""
    gc.unfreeze()


def exit_at_once(*queues: Any) -> NoReturn:
    """End this worker process now, without the interpreter's finalization: what it put on
    ``queues`` (every multiprocessing queue it put to: one left mid-write keeps the queue's
    write lock, and the other side's next put waits for ever) handed over first, then
    logging and the standard streams flushed, then ``os._exit(0)``. For a process whose cleanup is done (servers
    stopped, files removed): finalization would only free, one object at a time, memory
    the OS takes back anyway (and, for a heap left frozen, have nanobind report leaks)."""
    for q in queues:
        q.close()
        q.join_thread()  # the feeder thread has written everything put
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


@contextlib.contextmanager
def frozen() -> Iterator[int]:
    """``freeze_start_up`` for the body (which serves), ``thaw`` after it; yields the count frozen."""
    count = freeze_start_up()
    try:
        yield count
    finally:
        thaw()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Collect once, then no automatic collection inside the block. CUDA graphs are
    captured inside one: an object of an earlier engine freed mid-capture (its pinned
    buffers, its events) makes CUDA calls that end the capture (seen: "operation
    failed due to a previous error during capture")."""
    gc.collect()
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


class GcClock:
    """Seconds this process has spent in the garbage collector since ``install``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = 0.0
        self._collections = 0
        self._began: float | None = None
        self._installed = False

    def install(self) -> GcClock:
        if not self._installed:
            gc.callbacks.append(self._on_gc)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._on_gc)
            self._installed = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[GcClock]:
        """Counts the collections inside the block."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    @property
    def seconds(self) -> float:
        with self._lock:
            return self._seconds

    @property
    def collections(self) -> int:
        with self._lock:
            return self._collections

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # The collector runs in whichever thread triggered it, holding the GIL: one at a time.
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began is not None:
            with self._lock:
                self._seconds += now - self._began
                self._collections += 1
            self._began = None
