"""Batch concurrent Prefill calls into CP batches.

One thread takes the first waiting request, waits ``batch_wait_s`` for more
(up to ``max_batch_tokens`` prompt tokens), and runs them as one CP batch. If
the batch does not fit the free pages it runs the requests one by one, so only
a request that cannot fit alone is refused (``OutOfPagesError``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from lanekv.prefill.allocator import OutOfPagesError
from lanekv.prefill.cp.launcher import PrefillInput, PrefillResult

RunBatch = Callable[[Sequence[PrefillInput]], list[PrefillResult]]


class Batcher:
    def __init__(self, run_batch: RunBatch, *, batch_wait_s: float = 0.002,
                 max_batch_tokens: int = 65536, max_batch_size: int = 64) -> None:
        self._run = run_batch
        self._wait = batch_wait_s
        self._max_tokens = max_batch_tokens
        self._max_size = max_batch_size
        self._queue: queue.Queue[tuple[PrefillInput, Future]] = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="lanekv-prefill-batcher", daemon=True)
        self._thread.start()

    def submit(self, inp: PrefillInput) -> Future:
        fut: Future = Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("the prefill daemon is shutting down"))
            return fut
        self._queue.put((inp, fut))
        return fut

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop taking work; what is queued is still run (drain), then the thread ends."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            tokens = len(first[0].token_ids)
            deadline = time.monotonic() + self._wait
            while len(batch) < self._max_size and tokens < self._max_tokens:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                batch.append(item)
                tokens += len(item[0].token_ids)
            self._execute(batch)

    def _execute(self, batch: list[tuple[PrefillInput, Future]]) -> None:
        live = [(inp, fut) for inp, fut in batch if fut.set_running_or_notify_cancel()]
        if not live:
            return
        try:
            results = self._run([inp for inp, _ in live])
        except OutOfPagesError as err:
            if len(live) == 1:
                live[0][1].set_exception(err)
                return
            for inp, fut in live:  # one by one: only what cannot fit alone is refused
                try:
                    fut.set_result(self._run([inp])[0])
                except Exception as one_err:  # handed to the caller's future
                    fut.set_exception(one_err)
            return
        except Exception as err:  # handed to every caller of the batch
            for _, fut in live:
                fut.set_exception(err)
            return
        for (_, fut), res in zip(live, results):
            fut.set_result(res)
