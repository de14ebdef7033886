"""N CP ranks as threads of one process, sharing one model.

The runner's only collective is an all-gather of equally sized blocks; this
group provides it with a barrier, so the whole CP path (planning, compute
padding, rerange, owner-lane writes, last-token sampling) runs in one process.
Tests use it to cover many (cp_size, page_size) pairs in seconds; the rank
processes of ``prefill.cp.launcher`` use torch.distributed instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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

    def all_gather(self, rank: int, block: torch.Tensor) -> torch.Tensor:
        self._slots[rank] = block
        self._barrier.wait()  # every rank has published its block
        out = torch.cat(self._slots)  # type: ignore[arg-type]
        self._barrier.wait()  # every rank has read all blocks before any overwrites its slot
        return out

    def run(self, fn: Callable[[int], T]) -> list[T]:
        """Run ``fn(rank)`` on one thread per rank; re-raise the first failure."""
        results: list = [None] * self.world_size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank)
            except BaseException as err:  # surfaced below, after every thread ended
                errors.append(err)
                self._barrier.abort()  # release the other ranks instead of hanging

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
