"""Rank 0's side of a tensor-parallel decode group: the other ranks' processes.

``TPGroup(spec)`` checks that the model splits over ``spec.tp_size`` ranks
(before any process starts: ``model.parallel.tp.check_tp``, one line naming both values),
starts ranks 1..T-1 (``decode.tp.rank.follower_main``; ``runtime.workers.start``), joins the group as rank
0, loads rank 0's shard and pool, and waits until every rank said ``Ready``.
Then a thread waits on the ranks' sentinels: a rank that exits is reported once
to ``on_death(rank, reason)`` (the daemon fails: health NOT_SERVING, open
streams UNAVAILABLE naming the rank, ``lanekv decode`` exits 1), and every task
waiting on it fails with that reason. ``run_task`` runs a ``RankTask`` on every
rank at once and returns their results in rank order. ``close`` sends STOP
(call it once the decode loop is over: steps and STOP share the group) and ends
the processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import torch.distributed as dist
from lanekv.decode.tp.rank import (
    Failed,
    RankTask,
    Ready,
    TaskDone,
    TPSpec,
    build_rank,
    follower_main,
    join_group,
    run_task,
)
from lanekv.decode.tp.steps import send_stop
from lanekv.model.config import ModelConfig
from lanekv.model.parallel.rendezvous import host_store
from lanekv.model.parallel.tp import check_tp
from lanekv.runtime.daemon import how_it_ended
from lanekv.runtime.workers.start import worker_context, worker_process

log = logging.getLogger("lanekv.decode.tp")
START_TIMEOUT_S = 300.0  # every rank joined, loaded and built its pool
_POLL_S = 0.2


class RankFailed(RuntimeError):
    """A rank of the group died, or a task failed on it; the message names the rank."""


def exit_reason(rank: int, proc: mp.process.BaseProcess) -> str:
    """One line naming a rank process that is gone and how it ended."""
    return f"decode rank {rank} (pid {proc.pid}) {how_it_ended(proc.exitcode)}"


class TPGroup:
    """Rank 0 of a decode group of ``spec.tp_size`` ranks (this process) and the others'."""

    def __init__(self, spec: TPSpec, on_death: Callable[[int, str], None] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        check_tp(ModelConfig.from_dir(spec.model_path), spec.tp_size)
        # Rank 0 holds the rendezvous before any follower starts (model/parallel/rendezvous.py).
        self._store = host_store(spec.port, start_timeout_s)
        spec = dataclasses.replace(spec, port=self._store.port)
        self.spec = spec
        self._on_death = on_death
        # CPU followers fork from a server that imported their module once (runtime/workers/start.py).
        ctx = worker_context("cpu" if spec.device == "cpu" else "cuda", follower_main.__module__)
        self._results: Any = ctx.Queue()
        self._tasks = {rank: ctx.Queue() for rank in range(1, spec.tp_size)}
        self._procs = {rank: worker_process(ctx, follower_main, (rank, spec, self._tasks[rank], self._results),
                                            name=f"lanekv-tp-rank{rank}")
                       for rank in range(1, spec.tp_size)}
        self._lock = threading.Lock()
        self._answers: dict[int, dict[int, TaskDone]] = {}
        self._answered = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._dead: str | None = None
        self._closed = threading.Event()
        for proc in self._procs.values():
            proc.start()
        try:
            device = join_group(spec, 0, self._store)
            self.state, ready = build_rank(spec, 0, device)
            self.ready = [ready, *self._wait_ready(start_timeout_s)]
        except BaseException:
            self._kill()
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        self.device = device
        self._reader = threading.Thread(target=self._read, daemon=True, name="lanekv-tp-reader")
        self._reader.start()
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="lanekv-tp-watch")
        self._watcher.start()
        log.info("decode TP group started: %s", ", ".join(
            f"rank {r.rank} pid {r.pid}: {r.weight_bytes} weight bytes, {r.pool_bytes} pool bytes"
            for r in self.ready))

    @property
    def group(self) -> Any:
        return dist.group.WORLD

    @property
    def failure(self) -> str | None:
        """The line naming the rank that died, once one has."""
        return self._dead

    def wait_failure(self, timeout_s: float) -> str | None:
        """The dead rank's line, waiting up to ``timeout_s`` for the watcher to see a death."""
        with self._answered:
            self._answered.wait_for(lambda: self._dead is not None, timeout=timeout_s)
            return self._dead

    def _wait_ready(self, timeout_s: float) -> list[Ready]:
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + timeout_s
        while len(ready) < len(self._procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"decode ranks {sorted(set(self._procs) - set(ready))} did not start "
                                   f"within {timeout_s:.0f} s")
            try:
                message = self._results.get(timeout=min(left, _POLL_S))
            except Exception:  # noqa: BLE001 - queue.Empty: look at the processes
                gone = [r for r, p in self._procs.items() if r not in ready and not p.is_alive()]
                if gone:
                    raise RankFailed(exit_reason(gone[0], self._procs[gone[0]]) + " during start-up") from None
                continue
            if isinstance(message, Failed):
                raise RankFailed(f"decode rank {message.rank} could not start: {message.reason}")
            ready[message.rank] = message
        return [ready[r] for r in sorted(ready)]

    def run_task(self, task: RankTask, timeout_s: float, local: Callable[[], Any] | None = None) -> list[Any]:
        """``task.run`` on every rank (rank 0 in this thread, or ``local()`` there, which
        may raise its own errors); results in rank order. Raises ``RankFailed`` naming
        the rank when the task failed on one, or a rank died."""
        seq = next(self._seq)
        with self._lock:
            if self._dead is not None:
                raise RankFailed(self._dead)
            self._answers[seq] = {}
        for queue in self._tasks.values():
            queue.put((seq, task))
        try:
            own = run_task(self.state, seq, task) if local is None else TaskDone(0, seq, local())
        except BaseException:
            self._forget(seq, timeout_s)
            raise
        deadline = time.monotonic() + timeout_s
        with self._answered:
            done = self._answered.wait_for(
                lambda: self._dead is not None or len(self._answers[seq]) == len(self._tasks),
                timeout=max(0.0, deadline - time.monotonic()))
            answers = self._answers.pop(seq)
            if self._dead is not None:
                raise RankFailed(self._dead)
        if not done:
            raise RankFailed(f"decode ranks {sorted(set(self._tasks) - set(answers))} did not answer "
                             f"task {seq} within {timeout_s:.0f} s")
        results = []
        for done_task in [own, *(answers[r] for r in sorted(answers))]:
            if done_task.error is not None:
                raise RankFailed(f"decode rank {done_task.rank}: {done_task.error}")
            results.append(done_task.result)
        return results

    def _forget(self, seq: int, timeout_s: float) -> None:
        """Rank 0's part raised: wait (up to ``timeout_s``) for the others' answers, then drop
        them. (A fetch task writes into pages its caller frees once this returns: no rank
        may still be writing then.)"""
        with self._answered:
            self._answered.wait_for(
                lambda: self._dead is not None or len(self._answers[seq]) == len(self._tasks), timeout=timeout_s)
            self._answers.pop(seq, None)

    def _read(self) -> None:
        while not self._closed.is_set():
            try:
                message = self._results.get(timeout=_POLL_S)
            except Exception:  # noqa: BLE001 - queue.Empty (or closed at exit)
                continue
            if isinstance(message, TaskDone):
                with self._answered:
                    if message.seq in self._answers:
                        self._answers[message.seq][message.rank] = message
                    self._answered.notify_all()

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in self._procs.items()}
        while not self._closed.is_set():
            gone = wait(list(sentinels), timeout=_POLL_S)
            if not gone or self._closed.is_set():
                continue
            rank = min(sentinels[s] for s in gone)
            self._procs[rank].join(1.0)
            reason = exit_reason(rank, self._procs[rank])
            log.error("%s: the decode group cannot run another step", reason)
            with self._answered:
                self._dead = reason
                self._answered.notify_all()
            if self._on_death is not None:
                self._on_death(rank, reason)
            return

    def close(self, timeout_s: float = 10.0, graceful: bool = True) -> None:
        """STOP to the ranks (no step may run any more), then end their processes;
        ``graceful=False`` (a step may still be in a collective): kill them at once."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._dead is None and graceful:
            try:
                send_stop(self.group, self.device)
            except Exception:  # noqa: BLE001 - a rank gone meanwhile: killed below
                log.warning("decode ranks did not take STOP; ending them")
        for queue in self._tasks.values():
            queue.put(None)
        deadline = time.monotonic() + (timeout_s if graceful else 0.0)
        for proc in self._procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill(self) -> None:
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
