"""``KVFetcher``: the decode side's one call to fetch a request's KV into its pool.

A fetcher holds a list of transports, most preferred first; the last one
reaches every rank (gRPC). ``fetch(job)`` offers the job's owner ranks to each
transport in turn (the fast path takes the ranks on this host that share
their pool), starts every transport that took some, waits for them (the last
first: its work may run in the caller's thread), then fetches again, by the
last transport, every rank whose bytes did not verify. It returns once every
layer of every page is in the pool, and raises only ``KVFetchError`` (its
``code`` is the status the caller answers with): DATA_LOSS for damaged or
missing KV, UNAVAILABLE for a rank or path that is down, DEADLINE_EXCEEDED
once the job's time is up, ABORTED when a rank refused. When it raises, no
write into the pool is still under way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from lanekv.transfer.connector.base import (
    Code,
    Coverage,
    FetchJob,
    KVFetchError,
    KVTransport,
    Release,
    Route,
    TransportFetch,
)
from lanekv.transfer.protocol.stats import FetchStats, RankStats

__all__ = ["FetchStats", "Fetched", "KVFetcher"]  # FetchStats: what a fetch cost, as the callers see it


class Fetched(NamedTuple):
    stats: FetchStats
    paths: dict[int, str]  # how each owner rank's KV came: "grpc", "shm" or "cuda_ipc"


class KVFetcher:
    """Picks the transport per owner rank among ``transports`` (most preferred first; the
    last must reach every rank); ``release`` frees a request's pages at its ranks.
    ``names``: the transports' names, in the same order (``transport`` looks them up)."""

    def __init__(self, transports: Sequence[KVTransport], release: Release,
                 names: Sequence[str] | None = None) -> None:
        if not transports:
            raise ValueError("transports must name at least one transport")
        if not transports[-1].reaches_every_rank:
            raise ValueError(f"the last transport must reach every rank, got {type(transports[-1]).__name__}")
        names = [type(t).__name__ for t in transports] if names is None else list(names)
        if len(names) != len(transports):
            raise ValueError(f"names has {len(names)} names for {len(transports)} transports")
        self._transports = tuple(transports)
        self._by_name = dict(zip(names, transports))
        self._release = release

    def transport(self, name: str) -> KVTransport | None:
        """The transport registered as ``name``, or None when this fetcher has none."""
        return self._by_name.get(name)

    def fetch(self, job: FetchJob) -> Fetched:
        """Every layer of every page of ``job`` into ``job.pool``, verified."""
        owners = sorted(job.pages)
        coverage = Coverage(job.pages, job.num_layers)
        claims = self._claim(job, owners)
        taken = {rank: route.path for _, routes in claims for rank, route in routes.items()}
        paths = {rank: taken[rank] for rank in owners}
        start = time.perf_counter()
        per_rank: dict[int, RankStats] = {}
        retries, again = 0, []
        started: list[tuple[KVTransport, TransportFetch]] = []
        try:
            for transport, routes in claims:
                started.append((transport, transport.start(job, routes, coverage)))
            for transport, fetch in reversed(started):
                outcome = fetch.wait()
                per_rank.update(outcome.per_rank)
                retries += outcome.retries
                if outcome.again and transport is self._transports[-1]:
                    raise KVFetchError(Code.DATA_LOSS, f"KV of ranks {list(outcome.again)} did not verify")
                again += outcome.again
        finally:
            for _, fetch in started:
                fetch.stop()
        if again:  # bytes that did not verify: fetch those ranks again, by the transport that reaches all
            last = self._transports[-1]
            routes = last.claim(job, sorted(again))
            paths.update({rank: route.path for rank, route in routes.items()})
            retries += len(again)
            per_rank.update(last.start(job, routes, coverage).wait().per_rank)
        missing = coverage.missing()
        if missing:
            raise KVFetchError(Code.DATA_LOSS, f"KV transfer ended without every layer of pages {missing[:16]}")
        stats = FetchStats(sum(s.bytes for s in per_rank.values()), sum(s.chunks for s in per_rank.values()),
                           time.perf_counter() - start, dict(sorted(per_rank.items())), retries)
        return Fetched(stats, paths)

    def _claim(self, job: FetchJob, owners: list[int]) -> list[tuple[KVTransport, dict[int, Route]]]:
        """Each transport's routes, in order of preference; every rank in exactly one."""
        claims, left = [], owners
        for transport in self._transports:
            if not left:
                break
            routes = transport.claim(job, left)
            if routes:
                claims.append((transport, routes))
                left = [rank for rank in left if rank not in routes]
        if left:  # the last transport reaches every rank: only a broken one leaves any
            raise KVFetchError(Code.INTERNAL, f"no transport took ranks {left}")
        return claims

    def release(self, endpoints: Mapping[int, str], request_id: str, fingerprint: str, *, timeout: float,
                epoch: str | None) -> int:
        """Release the request's pages at the ranks of ``endpoints`` (Release goes over gRPC
        whatever path the pages took); the pages freed. Raises ``KVFetchError``."""
        return self._release(endpoints, request_id, fingerprint, timeout=timeout, epoch=epoch)
