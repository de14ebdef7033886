"""The gRPC transport: FetchKV streams from each owner rank (``transfer.grpcfetch``).

Every rank is reachable this way. The fetch runs in the caller's thread
(``KVClient.fetch`` receives each rank's stream in a thread or a receiver
process of its own); each verified chunk is placed straight into the pool
from one thread per rank (``transfer.connector.placement``). A chunk naming a
page its rank does not own, or one that does not fit, is DATA_LOSS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
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
from lanekv.transfer.connector.placement import place_chunk
from lanekv.transfer.errors import TransferError
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.grpcfetch.layerwise import check_streams
from lanekv.transfer.protocol.wire import ChunkHeader

GRPC = "grpc"


class GrpcTransport(KVTransport):
    """FetchKV over ``kv``'s channels; ``max_inflight_bytes`` received but not yet placed per
    request, chunks of up to ``max_chunk_bytes`` (0: the rank's default), ``streams_per_rank``
    streams from each owner rank (``transfer.grpcfetch.layerwise``)."""

    reaches_every_rank = True

    @classmethod
    def from_context(cls, ctx: TransportContext) -> GrpcTransport:
        return cls(ctx.kv, max_inflight_bytes=ctx.max_inflight_bytes, max_chunk_bytes=ctx.max_chunk_bytes,
                   streams_per_rank=ctx.streams_per_rank)

    def __init__(self, kv: KVClient, *, max_inflight_bytes: int = 256 << 20, max_chunk_bytes: int = 0,
                 streams_per_rank: int = 1) -> None:
        if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be a positive integer, got {max_inflight_bytes!r}")
        if isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int) or max_chunk_bytes < 0:
            raise ValueError(f"max_chunk_bytes must be an integer >= 0, got {max_chunk_bytes!r}")
        self._kv = kv
        self._limits = {"max_inflight_bytes": max_inflight_bytes, "max_chunk_bytes": max_chunk_bytes,
                        "streams_per_rank": check_streams(streams_per_rank)}
        # Whether streams go to the ranks' sender relays where a job names some.
        self.use_relays = True

    @property
    def streams_per_rank(self) -> int:
        return self._limits["streams_per_rank"]

    @streams_per_rank.setter
    def streams_per_rank(self, streams: int) -> None:
        """Streams per owner rank of the fetches started from now on (benchmarks sweep it)."""
        self._limits = {**self._limits, "streams_per_rank": check_streams(streams)}

    def claim(self, job: FetchJob, ranks: Sequence[int]) -> dict[int, Route]:
        return {rank: Route(GRPC) for rank in ranks}

    def start(self, job: FetchJob, routes: Mapping[int, Route], coverage: Coverage) -> TransportFetch:
        return _GrpcFetch(self._kv, self._limits, job, sorted(routes), coverage, self.use_relays)

    def release(self, endpoints: Mapping[int, str], request_id: str, fingerprint: str, *, timeout: float,
                epoch: str | None) -> int:
        """Release the request's pages at every rank of ``endpoints``; the pages freed in all.

        Raises ``KVFetchError`` (ABORTED, or UNAVAILABLE for a rank that is down).
        """
        try:
            return self._kv.release(endpoints, request_id, fingerprint, timeout=timeout, epoch=epoch)
        except TransferError as err:
            raise fetch_error(err, float("inf")) from err


class _GrpcFetch(TransportFetch):
    """The ranks' streams of one job, run by ``wait``."""

    def __init__(self, kv: KVClient, limits: dict[str, int], job: FetchJob, ranks: list[int],
                 coverage: Coverage, use_relays: bool = True) -> None:
        self._kv, self._limits, self._job, self._ranks, self._coverage = kv, limits, job, ranks, coverage
        self._relays = {rank: tuple(job.relays[rank]) for rank in ranks
                        if use_relays and rank < len(job.relays) and job.relays[rank]}
        self._owner_of = {page: rank for rank, pages in job.pages.items() for page in pages}

    def _place(self, header: ChunkHeader, payload: torch.Tensor) -> None:
        job = self._job
        for page in header.pages:
            if self._owner_of.get(page) != header.rank:
                raise KVFetchError(Code.DATA_LOSS, f"rank {header.rank} sent page {page}, not one of its pages")
        try:
            place_chunk(job.pool, job.pages_for(header.pages), payload, job.page_size, header.layer_start,
                        header.layer_end)
        except ValueError as err:
            raise KVFetchError(Code.DATA_LOSS, f"rank {header.rank} sent a chunk that does not fit: {err}") from err
        self._coverage.placed(header.pages, header.layer_start, header.layer_end)

    def wait(self) -> FetchOutcome:
        job = self._job
        endpoints = {rank: job.endpoints[rank] for rank in self._ranks}
        try:
            stats = self._kv.fetch(
                endpoints, job.request_id, job.fingerprint, self._place, **self._limits,
                timeout=time_left(job.deadline), layer_end=job.num_layers, epoch=job.epoch,
                pages={rank: job.pages[rank] for rank in endpoints}, heads=job.heads, relays=self._relays,
            )
        except TransferError as err:
            raise fetch_error(err, job.deadline) from err
        return FetchOutcome(dict(stats.per_rank), stats.retries)

    def stop(self) -> None:
        """Nothing runs outside ``wait``: ``KVClient.fetch`` ends every stream before it returns."""
