"""``KVFetcher``: the decode side's one call to fetch a request's KV into its pool.

``fetch(job)`` offers the job's owner ranks to the fast path first (ranks on
this host that share their pool), the rest to gRPC; it starts the fast path's
copies, runs the gRPC streams meanwhile, then fetches over gRPC again every
rank whose copied bytes did not match its digest. It returns once every layer
of every page is in the pool, and raises only ``KVFetchError`` (its ``code``
is the status the caller answers with): DATA_LOSS for damaged or missing KV,
UNAVAILABLE for a rank or path that is down, DEADLINE_EXCEEDED once the job's
time is up, ABORTED when a rank refused. When it raises, no write into the
pool is still under way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import NamedTuple

from lanekv.transfer.connector.base import Code, Coverage, FetchJob, KVFetchError
from lanekv.transfer.connector.fastpath import FastPathTransport
from lanekv.transfer.connector.grpc import GrpcTransport
from lanekv.transfer.protocol.stats import FetchStats, RankStats

__all__ = ["FetchStats", "Fetched", "KVFetcher"]  # FetchStats: what a fetch cost, as the callers see it

class Fetched(NamedTuple):
    stats: FetchStats
    paths: dict[int, str]  # how each owner rank's KV came: "grpc", "shm" or "cuda_ipc"


class KVFetcher:
    """Picks the transport per owner rank: ``fast`` where it reaches (None: gRPC for all)."""

    def __init__(self, grpc: GrpcTransport, fast: FastPathTransport | None = None) -> None:
        self._grpc = grpc
        self._fast = fast

    def fetch(self, job: FetchJob) -> Fetched:
        """Every layer of every page of ``job`` into ``job.pool``, verified."""
        owners = sorted(job.pages)
        coverage = Coverage(job.pages, job.num_layers)
        fast_routes = self._fast.claim(job, owners) if self._fast is not None else {}
        over_grpc = [rank for rank in owners if rank not in fast_routes]
        paths = {rank: fast_routes[rank].path if rank in fast_routes else "grpc" for rank in owners}
        start = time.perf_counter()
        fast = self._fast.start(job, fast_routes, coverage) if fast_routes else None
        per_rank: dict[int, RankStats] = {}
        retries, again = 0, ()
        try:
            if over_grpc:
                outcome = self._grpc.start(job, self._grpc.claim(job, over_grpc), coverage).wait()
                per_rank.update(outcome.per_rank)
                retries += outcome.retries
            if fast is not None:
                fast_outcome = fast.wait()
                again = fast_outcome.again
        finally:
            if fast is not None:
                fast.stop()
        if again:  # a digest that did not match: fetch those ranks again, over gRPC
            paths.update(dict.fromkeys(again, "grpc"))
            retries += len(again)
            outcome = self._grpc.start(job, self._grpc.claim(job, again), coverage).wait()
            per_rank.update(outcome.per_rank)
        if fast is not None:
            per_rank.update(fast_outcome.per_rank)
        missing = coverage.missing()
        if missing:
            raise KVFetchError(Code.DATA_LOSS, f"KV transfer ended without every layer of pages {missing[:16]}")
        stats = FetchStats(sum(s.bytes for s in per_rank.values()), sum(s.chunks for s in per_rank.values()),
                           time.perf_counter() - start, per_rank, retries)
        return Fetched(stats, paths)

    def release(self, endpoints: Mapping[int, str], request_id: str, fingerprint: str, *, timeout: float,
                epoch: str | None) -> int:
        """Release the request's pages at the ranks of ``endpoints`` (Release goes over gRPC
        whatever path the pages took); the pages freed. Raises ``KVFetchError``."""
        return self._grpc.release(endpoints, request_id, fingerprint, timeout=timeout, epoch=epoch)
