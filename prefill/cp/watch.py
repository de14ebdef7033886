"""Notice a CP rank's death at once: a thread waiting on the rank processes' sentinels.

A rank process that exits on its own after start-up (SIGKILL, the OOM
killer, a crash) is noticed within milliseconds, not when the next command
waits on it: the watcher calls ``on_death(rank, reason)`` once, with a line
naming the rank, its pid and how it ended, and stops. ``stop`` (the engine
closing, whose Shutdown ends the ranks) silences it first.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess

from lanekv.runtime.daemon import how_it_ended

# How often the watcher looks whether it was stopped (a death wakes it at once).
_POLL_S = 0.2


def exit_reason(rank: int, proc: BaseProcess) -> str:
    """One line naming a rank process that is gone and how it ended."""
    return f"rank {rank} ({proc.name}, pid {proc.pid}) {how_it_ended(proc.exitcode)}"


class RankWatcher:
    """Calls ``on_death(rank, reason)`` once, when the first of ``procs`` (started) exits."""

    def __init__(self, procs: Sequence[BaseProcess], on_death: Callable[[int, str], None]) -> None:
        self._procs = tuple(procs)
        self._on_death = on_death
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lanekv-cp-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No call from now on (a death already being reported finishes)."""
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(2 * _POLL_S + 1.0)

    def _run(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while not self._stopped.is_set():
            gone = wait(list(sentinels), timeout=_POLL_S)
            if not gone or self._stopped.is_set():
                continue
            rank = min(sentinels[s] for s in gone)
            proc = self._procs[rank]
            proc.join(1.0)  # reaped: its exit code is known
            self._on_death(rank, exit_reason(rank, proc))
            return
