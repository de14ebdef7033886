"""A request's KV into a tensor-parallel decode group: each rank pulls its KV heads.

Design: every decode rank runs its own FetchKV of the request's pages with a
head range (``FetchRequest.head_start/head_count``: rank r of T asks for KV heads
``[r * H/T, (r + 1) * H/T)``), so each prefill rank streams each decode rank
exactly the bytes it keeps, checksummed over those bytes, and no rank relays
another's KV. An MLA rank keeps whole latent rows (shared by every head), so it
fetches whole rows. (Rank 0 fetching every head and scattering slices would move each
byte twice and make rank 0's link the group's bottleneck.) The pages are the
same physical pages on every rank (one page table, rank 0's), so a rank needs
only the logical -> physical map of the request's pages.

``TPFetcher`` stands where the daemon's ``KVFetcher`` stands (``fetch``,
``release``, ``transport``): rank 0 fetches its heads through the daemon's
fetcher, the other ranks run ``FetchHeads`` with a fetcher of their own over the
same transports, at once. Over the same-host fast path each rank maps the
prefill ranks' pools and copies its heads of each row (a strided copy), checked
against the rank's digest of exactly those bytes; over gRPC the prefill rank
sends only those heads; over NIXL the prefill rank stages those heads of each
range in a registered region and each rank reads them in one block per layer and
plane (``transfer.connector.nixl``), MLA ranks whole rows in place. Each rank's
transports are its own (a NIXL agent per rank process).
A failure on a rank keeps its status code and names the rank; a rank that died
is UNAVAILABLE. ``Fetched.paths`` shows each prefill rank's path to every decode
rank (``grpc+shm`` when one decode rank fell back to gRPC).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch
from lanekv.decode.tp.group import RankFailed, TPGroup
from lanekv.decode.tp.rank import RankState
from lanekv.runtime.security import SecurityConfig
from lanekv.transfer.connector.base import FetchJob, KVFetchError, TransportContext
from lanekv.transfer.connector.fetcher import Fetched, KVFetcher
from lanekv.transfer.connector.registry import make_fetcher
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.grpcfetch.fetch import RetryPolicy
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.stats import FetchStats, RankStats

Code = grpc.StatusCode
_SLACK_S = 5.0  # past the job's deadline, how long rank 0 waits for the others' answers


@dataclass(frozen=True)
class FetchSetup:
    """What a rank builds its gRPC fetcher from, once (picklable)."""

    security: SecurityConfig
    retry: RetryPolicy
    agreement: Agreement
    max_inflight_bytes: int
    max_chunk_bytes: int
    streams_per_rank: int
    transports: tuple[str, ...] = ("grpc",)  # the daemon's (``DecodeConfig.transports``)


@dataclass(frozen=True)
class FetchHeads:
    """One request's fetch on a rank other than 0 (``RankTask``)."""

    setup: FetchSetup
    request_id: str
    fingerprint: str
    epoch: str | None
    endpoints: tuple[str, ...]
    pages: dict[int, list[int]]
    num_layers: int
    page_size: int
    physical: dict[int, int]  # logical page -> pool page, the same on every rank
    seconds: float  # left until the job's deadline when rank 0 sent it

    def run(self, state: RankState) -> tuple[str, Any]:
        fetcher = state.extras.get("fetcher")
        if fetcher is None:
            s = self.setup
            fetcher = make_fetcher(s.transports, TransportContext(
                KVClient(s.security, retry=s.retry), s.agreement, None, s.max_inflight_bytes, s.max_chunk_bytes,
                s.streams_per_rank))
            state.extras["fetcher"] = fetcher
        job = FetchJob(self.request_id, self.fingerprint, self.epoch, self.endpoints, self.pages, self.num_layers,
                       self.page_size, state.pool.tensor, lambda pages: [self.physical[p] for p in pages],
                       time.monotonic() + self.seconds, heads=rank_heads(state.pool.tensor, self.setup.agreement,
                                                                          state.tp.rank))
        try:
            fetched = fetcher.fetch(job)
            return "ok", (fetched.stats, fetched.paths)
        except KVFetchError as err:
            return "error", (err.code.name, str(err))


class TPFetcher:
    """The daemon's fetcher for a TP group (see the module docstring)."""

    def __init__(self, fetcher: KVFetcher, group: TPGroup, setup: FetchSetup) -> None:
        self._fetcher, self._group, self._setup = fetcher, group, setup

    def transport(self, name: str) -> Any:
        return self._fetcher.transport(name)

    def release(self, *args: Any, **kwargs: Any) -> int:
        return self._fetcher.release(*args, **kwargs)

    def fetch(self, job: FetchJob) -> Fetched:
        heads = rank_heads(self._group.state.pool.tensor, self._setup.agreement, 0)
        seconds = job.deadline - time.monotonic()
        pages = {rank: list(p) for rank, p in job.pages.items()}
        logical = [page for p in pages.values() for page in p]
        task = FetchHeads(self._setup, job.request_id, job.fingerprint, job.epoch, tuple(job.endpoints), pages,
                          job.num_layers, job.page_size, dict(zip(logical, job.pages_for(logical))), seconds)
        try:
            own, *others = self._group.run_task(
                task, max(0.0, seconds) + _SLACK_S, local=lambda: self._fetcher.fetch(replace(job, heads=heads)))
        except RankFailed as err:
            raise KVFetchError(Code.UNAVAILABLE, str(err)) from err
        stats, paths = [own.stats], [own.paths]
        for rank, (status, value) in enumerate(others, start=1):
            if status != "ok":
                code, message = value
                raise KVFetchError(Code[code], f"decode rank {rank}: {message}")
            stats.append(value[0])
            paths.append(value[1])
        return Fetched(_sum(stats), _paths(paths))


def rank_heads(pool: torch.Tensor, agreement: Agreement, rank: int) -> tuple[int, int] | None:
    """Rank ``rank``'s KV heads of each row, (first, count); None when every rank holds
    whole rows (MLA: the latent row is shared by every query head)."""
    heads = pool.shape[3]
    return None if heads == agreement.num_kv_heads else (rank * heads, heads)


def _paths(paths: list[dict[int, str]]) -> dict[int, str]:
    """How each prefill rank's KV came to the decode ranks: one path when every decode rank
    took the same, else each path taken, joined by '+' (a rank that fell back shows)."""
    ranks = sorted({rank for p in paths for rank in p})
    return {rank: "+".join(sorted({p[rank] for p in paths if rank in p})) for rank in ranks}


def _sum(stats: list[FetchStats]) -> FetchStats:
    """Every decode rank's bytes of the fetch, per prefill rank."""
    per_rank: dict[int, RankStats] = {}
    for s in stats:
        for rank, r in s.per_rank.items():
            old = per_rank.get(rank)
            per_rank[rank] = r if old is None else RankStats(old.bytes + r.bytes, old.chunks + r.chunks,
                                                           max(old.seconds, r.seconds), old.retries + r.retries)
    return FetchStats(sum(s.bytes for s in stats), sum(s.chunks for s in stats), max(s.seconds for s in stats),
                      dict(sorted(per_rank.items())), sum(s.retries for s in stats))
