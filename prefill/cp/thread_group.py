"""N CP ranks as threads of one process, sharing one model.

The runner's only collective is an all-gather of equally sized blocks; this
group provides it with a barrier, so the whole CP path (planning, compute
padding, rerange, owner-lane writes, last-token sampling) runs in one process.
Tests use it to cover many (cp_size, page_size) pairs in seconds; the rank
processes of ``prefill.cp.launcher`` use torch.distributed instead.

Each rank keeps one thread for the group's life, as a rank process keeps its
main thread: state that libraries hold per thread (cuDNN's attention graphs,
which take tens of milliseconds to build, ``kernels/prefill/sdpa.py``) is built
once, not on every call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class ThreadGroup:
    def __init__(self, world_size: int, timeout_s: float = 60.0) -> None:
        if not isinstance(world_size, int) or world_size <= 0:
            raise ValueError(f"world_size must be a positive integer, got world_size={world_size!r}")
        self.world_size = world_size
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._ranks = [ThreadPoolExecutor(1, thread_name_prefix=f"lanekv-cp-rank{r}")
                       for r in range(world_size)]
        self._run_lock = threading.Lock()  # one run at a time: the barrier is the group's

    def all_gather(self, rank: int, block: torch.Tensor) -> torch.Tensor:
        self._slots[rank] = block
        self._barrier.wait()  # every rank has published its block
        out = torch.cat(self._slots)  # type: ignore[arg-type]
        self._barrier.wait()  # every rank has read all blocks before any overwrites its slot
        return out

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(rank)`` on each rank's thread; re-raise the first failure once every
        rank has ended (the group stays usable)."""
        errors: list[BaseException] = []

        def body(rank: int) -> T | None:
            try:
                return fn(rank)
            except BaseException as err:  # surfaced below, after every rank ended
                errors.append(err)
                self._barrier.abort()  # release the other ranks instead of hanging
                return None

        with self._run_lock:
            futures = [pool.submit(body, r) for r, pool in enumerate(self._ranks)]
            results = [f.result() for f in futures]
            if errors:
                self._barrier.reset()  # the next run starts with a whole barrier
                self._slots = [None] * self.world_size
                raise errors[0]
        return results

    def close(self) -> None:
        """End the rank threads (a run in progress finishes first)."""
        for pool in self._ranks:
            pool.shutdown(wait=True)
