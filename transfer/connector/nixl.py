"""The NIXL transport: the decode side READs each owner rank's pages through NIXL (UCX).

gRPC stays the control plane. ``claim`` attaches each rank once per start of
its prefill daemon (``KVTransfer.NixlAttach``: the rank's agent metadata and
its pool's registered region, in lanekv's protobuf); a rank that offers no
NIXL, or whose attach fails, is left out (gRPC takes it). A fetch opens the
fast path's descriptor stream with ``nixl=true``: each range of layers is
announced once written and sealed with the rank's digest; at the seal this
side reads the range's pages, whole runs per layer and plane
(``transfer.nixl.runs``), straight into the decode pool, then checks the
bytes against the digest exactly as the fast path does (``page_digest`` of
the destination pages, each layer at its place). A rank whose bytes do not
verify (counted as ``failures{cause="nixl_digest"}``), or whose read NIXL
itself ended in failure with nothing left in flight (``nixl_read``; the peer
agent is dropped, attached again at the next claim), is in
``FetchOutcome.again``, and the fetcher fetches it over gRPC. A read that does
not end in time is not retried there: UCX may still be writing into the pages.

The decode side reads (NIXL READ) rather than the prefill side writing: the
decode side owns its pool and its page table, knows when a page is free to
be written, and a read needs nothing of the prefill side beyond one
registration per pool; the rank only says when a range is written.

The epoch binds a connection: a peer agent is kept per endpoint with the start
it was attached under, and a ticket naming another start drops it and attaches
again, so a prefill daemon restarted under the same address is never read
through the old agent. A dead peer fails its reads (UCX error handling
``peer``) or its descriptor stream, within ``read_timeout_s`` at most: the fetch
ends UNAVAILABLE naming the rank's endpoint (a failed read goes to gRPC first,
which then finds the rank down). ``release_pool`` releases a freed pool's
registration; ``close`` every registration and every peer (the daemon drains).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import grpc
import torch
from lanekv.kernels.page_digest import page_digest
from lanekv.proto import lanekv_pb2
from lanekv.runtime.metrics import Counter
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
)
from lanekv.transfer.errors import CorruptChunk, RemoteError, TransferError
from lanekv.transfer.grpcfetch.client import FETCH_METHOD, KVClient, RankStats
from lanekv.transfer.nixl.agent import (
    Agent,
    NixlReadFailed,
    NixlTransferError,
    NixlUnavailable,
    memory_kind,
)
from lanekv.transfer.nixl.runs import PoolRegion, read_pairs
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, start_of
from lanekv.transfer.protocol.contract import Agreement
from lanekv.transfer.protocol.descriptors import Descriptor, as_u64
from lanekv.transfer.protocol.wire import kv_dtype

NIXL = "nixl"
log = logging.getLogger("lanekv.transfer")


class _Peer(NamedTuple):
    start: str  # the prefill daemon start the agent belongs to
    agent: str  # its name, as loaded here
    region: PoolRegion
    memory: str
    device: int


class NixlTransport(KVTransport):
    """Reads ranks' pages over NIXL into the decode pool; ``devices`` pins UCX to some devices;
    ``failures`` (labelled by cause) counts the ranks sent back to gRPC."""

    def __init__(self, kv: KVClient, agreement: Agreement, *, devices: Sequence[str] = (),
                 attach_timeout_s: float = 10.0, read_timeout_s: float = 30.0,
                 failures: Counter | None = None) -> None:
        if not attach_timeout_s > 0 or not read_timeout_s > 0:
            raise ValueError(f"attach_timeout_s and read_timeout_s must be > 0, got {attach_timeout_s!r} "
                             f"and {read_timeout_s!r}")
        self._kv, self._agreement, self._devices = kv, agreement, tuple(devices)
        self.failures = failures
        self._attach_timeout_s, self.read_timeout_s = attach_timeout_s, read_timeout_s
        self._agent: Agent | None = None
        self._local: dict[int, PoolRegion] = {}  # data_ptr of a registered decode pool -> its region
        self._peers: dict[str, _Peer] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_context(cls, ctx: TransportContext) -> NixlTransport:
        return cls(ctx.kv, ctx.agreement, failures=ctx.failures)

    def claim(self, job: FetchJob, ranks: Sequence[int]) -> dict[int, Route]:
        if job.heads is not None:  # whole rows only (no strided descriptors): a TP rank's heads go another way
            return {}
        start = start_of(job.epoch) or ""
        routes = {}
        for rank in ranks:
            endpoint = job.endpoints[rank]
            try:
                self._peer(endpoint, start, job.epoch)
            except (NixlUnavailable, NixlTransferError, TransferError, ValueError) as err:
                log.warning("NIXL: rank %d at %s goes over gRPC: %s", rank, endpoint, err)
                continue
            routes[rank] = Route(NIXL)
        return routes

    def start(self, job: FetchJob, routes: Mapping[int, Route], coverage: Coverage) -> TransportFetch:
        local = self._register(job.pool)
        start = start_of(job.epoch) or ""
        peers = {}
        for rank in routes:
            peer = self._peers.get(job.endpoints[rank])
            if peer is None or peer.start != start:
                raise KVFetchError(Code.UNAVAILABLE, f"NIXL: rank {rank} at {job.endpoints[rank]} is not attached "
                                   f"for start {start!r}")
            peers[rank] = peer
        return _NixlFetch(self, job, peers, local, coverage)

    def release_pool(self, pool: torch.Tensor) -> bool:
        """Release the registration of ``pool`` (freed: no fetch into it may run); whether
        it was registered."""
        with self._lock:
            region, agent = self._local.pop(pool.data_ptr(), None), self._agent
        return region is not None and agent is not None and agent.deregister(pool)

    def count(self, cause: str) -> None:
        if self.failures is not None:
            self.failures.labels(cause=cause).inc()

    def forget_peer(self, endpoint: str, peer: _Peer) -> None:
        """Drop ``peer`` of ``endpoint`` (a read through it failed): the next claim attaches again."""
        with self._lock:
            if self._peers.get(endpoint) != peer:
                return
            del self._peers[endpoint]
            agent = self._agent
        if agent is not None:
            agent.remove_remote(peer.agent)

    def close(self) -> None:
        """Release the pool's registration and forget every peer (the daemon drains)."""
        with self._lock:
            self._closed = True
            agent, self._agent = self._agent, None
            self._peers.clear()
            self._local.clear()
        if agent is not None:
            agent.close()

    # -- peers and registrations ----------------------------------------------

    def _agent_here(self) -> Agent:
        with self._lock:
            if self._closed:
                raise NixlUnavailable("the NIXL transport is closed")
            if self._agent is None:
                self._agent = Agent(f"lanekv-decode-{secrets.token_hex(6)}", self._devices)
            return self._agent

    def _register(self, pool: torch.Tensor) -> PoolRegion:
        agent = self._agent_here()
        with self._lock:
            region = self._local.get(pool.data_ptr())
        if region is None:
            addr, _, _ = agent.register(pool)
            region = _region(pool, addr)
            with self._lock:
                self._local[pool.data_ptr()] = region
        return region

    def _peer(self, endpoint: str, start: str, ticket: str | None) -> _Peer:
        """The agent of ``endpoint`` attached under ``start``; attached now if it is not
        (a peer of another start is dropped first: never read through a stale agent)."""
        agent = self._agent_here()
        with self._lock:
            known = self._peers.get(endpoint)
        if known is not None and known.start == start:
            return known
        if known is not None:
            with self._lock:
                self._peers.pop(endpoint, None)
            agent.remove_remote(known.agent)
            log.info("NIXL: %s restarted (start %r, was %r); its old agent is dropped", endpoint, start, known.start)
        request = lanekv_pb2.NixlAttachRequest(fingerprint=self._agreement.fingerprint)
        metadata = ((EPOCH_METADATA_KEY, ticket),) if ticket else None
        try:
            reply = self._kv.stub(endpoint).NixlAttach(request, timeout=self._attach_timeout_s, metadata=metadata)
        except grpc.RpcError as err:
            raise RemoteError(None, endpoint, err.code(), err.details() or "") from err
        if reply.epoch != start:
            raise ValueError(f"{endpoint} attached NIXL for start {reply.epoch!r}, the request names {start!r}")
        a = self._agreement
        row_bytes = a.num_kv_heads * a.head_dim * _itemsize(a)
        per_row = a.num_layers * a.kv_planes * row_bytes
        if not reply.pool_bytes or reply.pool_bytes % (per_row * a.page_size):
            raise ValueError(f"{endpoint} registered {reply.pool_bytes} bytes: not a pool of whole pages")
        name = agent.add_remote(reply.agent_metadata)
        if name != reply.agent_name:
            agent.remove_remote(name)
            raise ValueError(f"{endpoint} named its agent {reply.agent_name!r}, its metadata says {name!r}")
        peer = _Peer(start, name, PoolRegion(reply.pool_addr, a.kv_planes, reply.pool_bytes // per_row, row_bytes),
                     reply.memory, reply.device_id)
        with self._lock:
            self._peers[endpoint] = peer
        return peer


class _NixlFetch(TransportFetch):
    """One thread per rank: its descriptor stream, a NIXL read per sealed range, the digest check."""

    def __init__(self, transport: NixlTransport, job: FetchJob, peers: dict[int, _Peer], local: PoolRegion,
                 coverage: Coverage) -> None:
        self._t, self._job, self._peers, self._local, self._coverage = transport, job, peers, local, coverage
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
        job, t, peer = self._job, self._t, self._peers[rank]
        begin = time.perf_counter()
        pages = list(job.pages[rank])
        asked = set(pages)
        request = lanekv_pb2.FetchRequest(request_id=job.request_id, fingerprint=job.fingerprint, layer_start=0,
                                          layer_end=job.num_layers, pages=pages, descriptors=True, nixl=True)
        metadata = ((EPOCH_METADATA_KEY, job.epoch),) if job.epoch else None
        stream = t._kv.channel(endpoint).unary_stream(
            FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
            response_deserializer=lanekv_pb2.KVChunk.FromString)
        call = stream(request, timeout=max(0.001, job.deadline - time.monotonic()), metadata=metadata)
        with self._lock:
            self._calls.append(call)
        if self._stop.is_set():
            call.cancel()
            return
        announced: Descriptor | None = None
        layer, seq, nbytes, placed = 0, 0, 0, []
        try:
            for message in call:
                if announced is None:
                    try:
                        d = Descriptor.decode(message.header)
                    except ValueError as err:
                        raise CorruptChunk(job.request_id, rank, seq, f"has a bad descriptor: {err}") from err
                    bad = _mismatch(d, job.request_id, rank, seq, asked, layer, job.num_layers,
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
                pairs = read_pairs(peer.region, self._local, d.physical, dst, job.page_size, d.layer_start,
                                   d.layer_end)
                deadline = min(job.deadline, time.monotonic() + t.read_timeout_s)
                try:
                    t._agent_here().read(peer.agent, peer.memory, pairs, peer.device, memory_kind(job.pool),
                                         job.pool.device.index or 0, deadline)
                except NixlReadFailed as err:  # nothing in flight: gRPC may write these pages
                    if self._stop.is_set():
                        return
                    log.warning("NIXL: rank %d at %s: %s; over gRPC again", rank, endpoint, err)
                    t.forget_peer(endpoint, peer)
                    self._send_back(rank, "nixl_read")
                    return
                got = self._digest(dst, d.layer_start, d.layer_end)
                if got != d.digest:
                    log.warning("NIXL: rank %d's layers [%d, %d) do not match its digest; over gRPC again",
                                rank, d.layer_start, d.layer_end)
                    self._send_back(rank, "nixl_digest")
                    return
                placed.append(d)
                nbytes += sum(n for _, _, n in pairs)
                seq, layer = seq + 1, d.layer_end
                if layer == job.num_layers:
                    break
        except grpc.RpcError as err:
            if self._stop.is_set():
                return
            raise RemoteError(rank, endpoint, err.code(), err.details() or "") from err
        finally:
            call.cancel()
        if layer != job.num_layers:
            if self._stop.is_set():
                return
            raise CorruptChunk(job.request_id, rank, seq, f"was not sent: the stream ended after layer {layer}")
        for d in placed:  # verified: only now marked placed
            self._coverage.placed(d.pages, d.layer_start, d.layer_end)
        with self._lock:
            self._stats[rank] = RankStats(nbytes, len(placed), time.perf_counter() - begin)

    def _send_back(self, rank: int, cause: str) -> None:
        """``rank`` goes to gRPC again (none of its pages is marked placed)."""
        self._t.count(cause)
        with self._lock:
            self._again.add(rank)

    def _digest(self, dst: list[int], layer_start: int, layer_end: int) -> int:
        pool = self._job.pool
        index = torch.as_tensor(dst, dtype=torch.int64).to(pool.device)
        return as_u64(page_digest(pool, index, self._job.page_size, layer_start, layer_end, first_layer=0))


def _mismatch(d: Descriptor, request_id: str, rank: int, seq: int, asked: set[int], layer: int, num_layers: int,
              src_pages: int) -> str:
    """Why a descriptor is not the next one this fetch can use ('' when it is)."""
    if d.digest is not None:
        return "is sealed before it was announced"
    if d.request_id != request_id or d.rank != rank or d.seq != seq:
        return f"is {d.request_id!r} rank {d.rank} seq {d.seq}"
    if d.layer_start != layer or not layer < d.layer_end <= num_layers:
        return f"names layers [{d.layer_start}, {d.layer_end}), not from layer {layer} within {num_layers}"
    if set(d.pages) != asked or len(d.pages) != len(asked) or len(d.physical) != len(d.pages):
        return "does not name exactly the pages asked for"
    if len(set(d.physical)) != len(d.physical) or any(not 0 <= p < src_pages for p in d.physical):
        return f"names physical pages outside the rank's pool of {src_pages} or twice"
    return ""


def _itemsize(a: Agreement) -> int:
    return kv_dtype(a.kv_dtype).itemsize


def _region(pool: torch.Tensor, addr: int) -> PoolRegion:
    layers, planes, rows, heads, dim = pool.shape
    return PoolRegion(addr, planes, rows, heads * dim * pool.element_size())
