"""The same-host fast path as a transport (``transfer.fastpath.client.FastPath``).

A rank on this host that shares its pool is claimed once its pool is mapped
here (``FastPath.pool``: a rank that refuses, or a handle this process cannot
open, is left to gRPC). Its pages are copied in place, one thread per rank,
every copied range checked against the rank's digest; a range that does not
match sends the rank back to the fetcher (``FetchOutcome.again``) to be
fetched over gRPC. The ranks' copies are queued in a ``CopyOrder``. A job
with a head range (``FetchJob.heads``: a tensor-parallel decode rank's) copies
only those heads of each row, checked against the rank's digest of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lanekv.runtime.metrics import Counter
from lanekv.runtime.status import Refusal
from lanekv.transfer.connector.base import (
    Code,
    Coverage,
    FetchJob,
    FetchOutcome,
    KVFetchError,
    KVTransport,
    Route,
    TransportContext,
    TransportFetch,
    fetch_error,
    time_left,
)
from lanekv.transfer.errors import TransferError
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.fastpath.copyorder import CopyOrder
from lanekv.transfer.fastpath.rankfetch import DigestMismatch, FastRequest, RankPages
from lanekv.transfer.protocol.stats import RankStats

log = logging.getLogger("lanekv.decode")
# How long a fast-path attach to one rank may take before that rank goes over gRPC.
ATTACH_TIMEOUT_S = 5.0
# How often a fetch waiting for the prefill's answer looks whether it was stopped.
ANSWER_POLL_S = 0.05
# How long a stopped fast-path fetch waits for its ranks' threads (each syncs its copies as it fails).
STOP_WAIT_S = 10.0


class FastPathTransport(KVTransport):
    """Ranks whose pools ``fastpath`` maps here; ``failures`` (labelled by cause) counts the
    ranks sent back to gRPC because a digest did not match."""

    @classmethod
    def from_context(cls, ctx: TransportContext) -> FastPathTransport:
        return cls(FastPath(ctx.kv, ctx.agreement), ctx.failures)

    def __init__(self, fastpath: FastPath, failures: Counter | None = None) -> None:
        self._fastpath = fastpath
        self._failures = failures

    @property
    def fastpath(self) -> FastPath:
        """The pools it maps and how it copies (benchmarks and tests look, or tune ``copy_at_end``)."""
        return self._fastpath

    def claim(self, job: FetchJob, ranks: Sequence[int]) -> dict[int, Route]:
        routes = {}
        for rank in ranks:
            endpoint = job.endpoints[rank]
            pool = self._fastpath.pool(endpoint, job.epoch, min(ATTACH_TIMEOUT_S, time_left(job.deadline)))
            if pool is not None:
                routes[rank] = Route(self._fastpath.transport(endpoint), pool)
        return routes

    def start(self, job: FetchJob, routes: Mapping[int, Route], coverage: Coverage) -> TransportFetch:
        return _FastFetch(self._fastpath, self._failures, job, routes, coverage)


class _FastFetch(TransportFetch):
    """The fast-path fetches of one job, one thread per rank.

    With ``job.physical_of`` and every layer written (``job.written``), each
    rank's pages are copied from where the owner-lane rule puts them without
    waiting for the rank's announcement (``RankPages.expect``). A
    fast path that copies at the end (``FastPath.copy_at_end`` and its tuning's
    ``wait_for_answer``) waits for the prefill's answer before it calls the
    ranks, so a rank does no transfer work while its prefill runs.
    """

    def __init__(self, fastpath: FastPath, failures: Counter | None, job: FetchJob,
                 routes: Mapping[int, Route], coverage: Coverage) -> None:
        self._fastpath, self._failures, self._job, self._coverage = fastpath, failures, job, coverage
        self._stats: dict[int, RankStats] = {}
        self._errors: dict[int, BaseException] = {}
        self._calls: list[Any] = []
        self._stopped = False
        self._lock = threading.Lock()
        # What every rank's fetch shares; each rank adds its pool, pages and places.
        self._request = FastRequest(job.request_id, job.fingerprint, job.pool, job.pages_for, coverage.placed,
                                    job.epoch, job.deadline, job.heads)
        pools = {rank: route.source for rank, route in routes.items()}
        self._order = CopyOrder.for_pools(pools, job.pool.device)
        self._threads = [
            threading.Thread(target=self._run, args=(rank, pool), name=f"fast-rank{rank}", daemon=True)
            for rank, pool in pools.items()
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, rank: int, pool: torch.Tensor) -> None:
        job = self._job
        pages = tuple(job.pages[rank])
        try:
            written = job.physical_of is not None and self._written()
            expect = tuple(job.physical_of(p) for p in pages) if written else None
            got = self._fastpath.fetch(self._request, RankPages(rank, job.endpoints[rank], pool, pages, expect),
                                       on_call=self._on_call, order=self._order)
            self._stats[rank] = RankStats(got.bytes, got.chunks, got.seconds)
        except BaseException as err:  # noqa: BLE001 - reported by wait
            self._errors[rank] = err
            self._order.done(rank)  # also when it failed before its fetch began

    def _written(self) -> bool:
        """Whether every layer is written, waiting for the prefill's answer where this fast
        path copies at the end (until it comes, the prefill fails, ``stop`` or the deadline)."""
        written = self._job.written
        if written is None:
            return True
        wait = self._fastpath.copy_at_end and self._fastpath.tuning.wait_for_answer
        while True:
            answered = written(ANSWER_POLL_S if wait else 0.0)
            if answered is not None:
                return answered
            if not wait or self._stopped or time.monotonic() >= self._job.deadline:
                return False  # the rank's stream then says how far it has written

    def _on_call(self, call: Any) -> None:
        with self._lock:
            self._calls.append(call)
            stopped = self._stopped
        if stopped:  # a rank that called after stop()
            call.cancel()

    def wait(self) -> FetchOutcome:
        deadline = self._job.deadline
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 5.0)
            if thread.is_alive():
                raise KVFetchError(Code.DEADLINE_EXCEEDED, "fast-path KV copy did not finish in time")
        again = []
        for rank, err in sorted(self._errors.items()):
            if isinstance(err, DigestMismatch):
                log.warning("fast path: %s; fetching rank %d again over gRPC", err, rank,
                            extra={"request_id": self._job.request_id})
                if self._failures is not None:
                    self._failures.labels(cause="fastpath_digest").inc()
                again.append(rank)
            elif isinstance(err, TransferError):
                raise fetch_error(err, deadline) from err
            elif isinstance(err, Refusal):
                raise KVFetchError(err.code, err.message) from err
            else:
                raise KVFetchError(Code.INTERNAL, f"fast-path KV copy from rank {rank}: {type(err).__name__}: {err}")
        return FetchOutcome(dict(self._stats), 0, tuple(again))

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Cancel the streams still open and wait up to ``wait_s`` for the ranks' threads:
        a rank's copies, made before its first message, may still be running."""
        with self._lock:
            self._stopped = True
            calls = list(self._calls)
        for stream in calls:
            stream.cancel()
        until = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, until - time.monotonic()))
