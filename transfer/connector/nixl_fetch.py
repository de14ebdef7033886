"""One request's NIXL fetch of some ranks (``NixlTransport.start``): a thread per rank.

Each rank's descriptor stream (FetchKV with ``descriptors`` and ``nixl``)
announces every range of layers once written and seals it with the rank's
digest; at the seal this side reads the range through NIXL straight into the
decode pool and compares ``page_digest`` of the destination pages with it.

Whole rows (tensor parallelism 1, or MLA's latent rows on any rank) are read
where they lie in the rank's pool (``runs.read_pairs``). A head range (a
tensor-parallel GQA rank's KV heads, ``FetchJob.heads``) is read from where
the rank staged it (``KVChunk.nixl_staged``, ``runs.staged_pairs``), in
windows of layers that each hold at most ``1 / (STAGING_SHARE * T)`` of the
rank's staging region (T decode ranks, one head range each, read from it at
once): one FetchKV call per window, ended once its last range is read (the
rank frees the call's lease then). A rank whose staging is full
(RESOURCE_EXHAUSTED) goes to gRPC, counted as ``failures{cause="nixl_staging"}``.

Nothing is marked placed until every range of the rank verified; a rank
whose bytes do not verify, or whose read NIXL ended in failure, is sent back
to gRPC (``FetchOutcome.again``), as the transport's docstring says.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple, Protocol

import grpc
import torch
from lanekv.kernels.page_digest import page_digest
from lanekv.proto import lanekv_pb2
from lanekv.transfer.connector.base import (
    Code,
    Coverage,
    FetchJob,
    FetchOutcome,
    KVFetchError,
    TransportFetch,
    fetch_error,
)
from lanekv.transfer.errors import CorruptChunk, RemoteError, TransferError
from lanekv.transfer.grpcfetch.client import FETCH_METHOD, KVClient
from lanekv.transfer.nixl.agent import NixlReadFailed, NixlTransferError
from lanekv.transfer.nixl.runs import PoolRegion, read_pairs, staged_bytes, staged_pairs
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY
from lanekv.transfer.protocol.descriptors import Descriptor, as_u64
from lanekv.transfer.protocol.stats import RankStats

log = logging.getLogger("lanekv.transfer")
# A staged window of layers takes at most 1 / (STAGING_SHARE * T) of a rank's staging
# region: the T ranks of this many decode groups (or requests) read from it at once.
STAGING_SHARE = 2


class NixlPeer(NamedTuple):
    """A prefill rank's agent as loaded here, and its registered regions."""

    start: str  # the prefill daemon start the agent belongs to
    agent: str  # its name, as loaded here
    region: PoolRegion
    memory: str
    device: int
    staging_addr: int = 0
    staging_bytes: int = 0  # 0: the rank stages no head ranges


class NixlLink(Protocol):
    """What a fetch needs of its transport."""

    kv: KVClient
    read_timeout_s: float

    def read(self, peer: NixlPeer, pairs: list[tuple[int, int, int]], pool: torch.Tensor, deadline: float) -> None: ...

    def forget_peer(self, endpoint: str, peer: NixlPeer) -> None: ...

    def count(self, cause: str) -> None: ...


class _SentBack(Exception):
    """The rank goes to gRPC (``cause`` counted); nothing of it is marked placed."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def window_layers(peer: NixlPeer, local: PoolRegion, pages: int, page_size: int, num_layers: int) -> int:
    """Layers per staged FetchKV call of ``pages`` pages into ``local`` (a pool of one head range
    of the rank's rows); 0 when one layer does not fit the region."""
    per_layer = staged_bytes(local, pages, page_size, 1)
    if per_layer > peer.staging_bytes:
        return 0
    ranks = max(1, peer.region.row_bytes // local.row_bytes)  # the decode ranks sharing each row: T
    return max(1, min(num_layers, peer.staging_bytes // (STAGING_SHARE * ranks) // per_layer))


class NixlFetch(TransportFetch):
    """One thread per rank: its descriptor streams, a NIXL read per sealed range, the digest check."""

    def __init__(self, link: NixlLink, job: FetchJob, peers: dict[int, NixlPeer], local: PoolRegion,
                 coverage: Coverage) -> None:
        self._t, self._job, self._peers, self._local, self._coverage = link, job, peers, local, coverage
        self._stop = threading.Event()
        self._calls: list[Any] = []
        self._lock = threading.Lock()
        self._stats: dict[int, RankStats] = {}
        self._again: set[int] = set()
        self._errors: list[KVFetchError] = []
        self._threads = [threading.Thread(target=self._run, args=(rank,), name=f"nixl-rank{rank}", daemon=True)
                         for rank in peers]
        for thread in self._threads:
            thread.start()

    def wait(self) -> FetchOutcome:
        for thread in self._threads:
            thread.join()
        if self._errors:
            raise self._errors[0]
        return FetchOutcome(dict(self._stats), 0, tuple(sorted(self._again)))

    def stop(self) -> None:
        self._stop_calls()
        for thread in self._threads:
            thread.join()  # a read under way ends within its deadline

    def _run(self, rank: int) -> None:
        job = self._job
        endpoint = job.endpoints[rank]
        try:
            self._fetch(rank, endpoint)
        except _SentBack as err:
            self._t.count(err.cause)
            with self._lock:
                self._again.add(rank)
        except KVFetchError as err:
            self._fail(err)
        except NixlTransferError as err:
            self._t.forget_peer(endpoint, self._peers[rank])  # a dead peer's agent is not kept
            self._fail(KVFetchError(Code.UNAVAILABLE, f"KV transfer: rank {rank} at {endpoint}: {err}"))
        except TransferError as err:
            if isinstance(err, RemoteError) and err.code == grpc.StatusCode.UNAVAILABLE:
                self._t.forget_peer(endpoint, self._peers[rank])  # down: attached again if it comes back
            self._fail(fetch_error(err, job.deadline))
        except Exception as err:  # a fault of ours ends the fetch now, with its cause
            log.exception("NIXL fetch of rank %d failed", rank)
            self._fail(KVFetchError(Code.INTERNAL, f"KV transfer: rank {rank} at {endpoint}: NIXL fetch failed: {err}"))

    def _fail(self, err: KVFetchError) -> None:
        with self._lock:
            self._errors.append(err)
        self._stop_calls()

    def _stop_calls(self) -> None:
        self._stop.set()
        with self._lock:
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def _fetch(self, rank: int, endpoint: str) -> None:
        """Every window of the rank's layers, then (all verified) their pages marked placed."""
        job = self._job
        begin = time.perf_counter()
        window = job.num_layers
        if job.heads is not None:
            window = window_layers(self._peers[rank], self._local, len(job.pages[rank]), job.page_size,
                                   job.num_layers)
            if not window:  # the claim saw room for a layer: the rank was attached again since
                raise _SentBack("nixl_staging")
        placed: list[Descriptor] = []
        nbytes = 0
        for first in range(0, job.num_layers, window):
            got = self._window(rank, endpoint, first, min(job.num_layers, first + window), placed)
            if got is None:
                return  # stopped
            nbytes += got
        for d in placed:  # verified: only now marked placed
            self._coverage.placed(d.pages, d.layer_start, d.layer_end)
        with self._lock:
            self._stats[rank] = RankStats(nbytes, len(placed), time.perf_counter() - begin)

    def _window(self, rank: int, endpoint: str, first: int, end: int, placed: list[Descriptor]) -> int | None:
        """Layers ``[first, end)`` of the rank, read and verified (added to ``placed``); the
        bytes read, or None when the fetch was stopped. ``_SentBack`` for gRPC."""
        job, peer = self._job, self._peers[rank]
        pages = list(job.pages[rank])
        asked = set(pages)
        request = lanekv_pb2.FetchRequest(request_id=job.request_id, fingerprint=job.fingerprint, layer_start=first,
                                          layer_end=end, pages=pages, descriptors=True, nixl=True)
        if job.heads is not None:
            request.head_start, request.head_count = job.heads
        metadata = ((EPOCH_METADATA_KEY, job.epoch),) if job.epoch else None
        stream = self._t.kv.channel(endpoint).unary_stream(
            FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
            response_deserializer=lanekv_pb2.KVChunk.FromString)
        call = stream(request, timeout=max(0.001, job.deadline - time.monotonic()), metadata=metadata)
        with self._lock:
            self._calls.append(call)
        if self._stop.is_set():
            call.cancel()
            return None
        announced: Descriptor | None = None
        layer, seq, nbytes = first, 0, 0
        try:
            for message in call:
                if announced is None:
                    try:
                        d = Descriptor.decode(message.header)
                    except ValueError as err:
                        raise CorruptChunk(job.request_id, rank, seq, f"has a bad descriptor: {err}") from err
                    bad = _mismatch(d, job.request_id, rank, seq, asked, layer, end,
                                    peer.region.rows // job.page_size)
                    if bad:
                        raise CorruptChunk(job.request_id, rank, seq, bad)
                    announced = d
                    continue
                d = announced.sealed_by(message.header)
                if d is None:
                    raise CorruptChunk(job.request_id, rank, seq, "does not seal the range announced before it")
                announced = None
                dst = job.pages_for(d.pages)
                pairs = self._pairs(rank, seq, d, dst, message)
                try:
                    self._t.read(peer, pairs, job.pool, min(job.deadline, time.monotonic() + self._t.read_timeout_s))
                except NixlReadFailed as err:  # nothing in flight: gRPC may write these pages
                    if self._stop.is_set():
                        return None
                    log.warning("NIXL: rank %d at %s: %s; over gRPC again", rank, endpoint, err)
                    self._t.forget_peer(endpoint, peer)
                    raise _SentBack("nixl_read") from err
                if self._digest(dst, d.layer_start, d.layer_end) != d.digest:
                    log.warning("NIXL: rank %d's layers [%d, %d) do not match its digest; over gRPC again",
                                rank, d.layer_start, d.layer_end)
                    raise _SentBack("nixl_digest")
                placed.append(d)
                nbytes += sum(n for _, _, n in pairs)
                seq, layer = seq + 1, d.layer_end
                if layer == end:
                    break
        except grpc.RpcError as err:
            if self._stop.is_set():
                return None
            if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and job.heads is not None:
                log.warning("NIXL: rank %d at %s: %s; over gRPC", rank, endpoint, err.details())
                raise _SentBack("nixl_staging") from err
            raise RemoteError(rank, endpoint, err.code(), err.details() or "") from err
        finally:
            call.cancel()  # a staged call's end frees its lease at the rank
        if layer != end:
            if self._stop.is_set():
                return None
            raise CorruptChunk(job.request_id, rank, seq, f"was not sent: the stream ended after layer {layer}")
        return nbytes

    def _pairs(self, rank: int, seq: int, d: Descriptor, dst: list[int], message: Any) -> list[tuple[int, int, int]]:
        """What the sealed range ``d`` reads: where the rank's pool holds it, or where it staged it."""
        job, peer = self._job, self._peers[rank]
        if job.heads is None:
            return read_pairs(peer.region, self._local, d.physical, dst, job.page_size, d.layer_start, d.layer_end)
        size = staged_bytes(self._local, len(dst), job.page_size, d.layer_end - d.layer_start)
        if not message.HasField("nixl_staged") or message.nixl_staged + size > peer.staging_bytes:
            raise CorruptChunk(job.request_id, rank, seq, f"stages {size} bytes at "
                               f"{message.nixl_staged if message.HasField('nixl_staged') else 'no offset'}, "
                               f"outside the rank's staging region of {peer.staging_bytes}")
        return staged_pairs(peer.staging_addr + message.nixl_staged, self._local, dst, job.page_size,
                            d.layer_start, d.layer_end)

    def _digest(self, dst: list[int], layer_start: int, layer_end: int) -> int:
        pool = self._job.pool
        index = torch.as_tensor(dst, dtype=torch.int64).to(pool.device)
        return as_u64(page_digest(pool, index, self._job.page_size, layer_start, layer_end, first_layer=0))


def _mismatch(d: Descriptor, request_id: str, rank: int, seq: int, asked: set[int], layer: int, layer_end: int,
              src_pages: int) -> str:
    """Why a descriptor is not the next one this fetch can use ('' when it is)."""
    if d.digest is not None:
        return "is sealed before it was announced"
    if d.request_id != request_id or d.rank != rank or d.seq != seq:
        return f"is {d.request_id!r} rank {d.rank} seq {d.seq}"
    if d.layer_start != layer or not layer < d.layer_end <= layer_end:
        return f"names layers [{d.layer_start}, {d.layer_end}), not from layer {layer} within {layer_end}"
    if set(d.pages) != asked or len(d.pages) != len(asked) or len(d.physical) != len(d.pages):
        return "does not name exactly the pages asked for"
    if len(set(d.physical)) != len(d.physical) or any(not 0 <= p < src_pages for p in d.physical):
        return f"names physical pages outside the rank's pool of {src_pages} or twice"
    return ""
