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
the destination pages, each layer at its place; ``transfer.connector.nixl_fetch``).

Tensor parallelism: an MLA decode rank keeps whole latent rows, read as above.
A GQA decode rank keeps only its KV heads (``FetchJob.heads``), a few hundred
bytes of every row, and NIXL has no strided descriptors: the prefill rank packs
those heads of each sealed range into a lease of its staging region (one
gather on its device; ``transfer.nixl.staging``), and this side reads the
range from there, one block per layer, plane and run of destination pages,
into its pool of those heads; the digest covers exactly those bytes. (Reading
the heads in place would take a descriptor per row and plane; a pool laid out
heads-first, as vLLM's NIXL connector does, would change every kernel's
layout for one transport.) A rank whose staging region is too small for one
layer of the request is left to gRPC at the claim. A rank whose bytes do not
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
from collections.abc import Mapping, Sequence

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.runtime.metrics import Counter
from lanekv.transfer.connector.base import (
    Code,
    Coverage,
    FetchJob,
    KVFetchError,
    KVTransport,
    Route,
    TransportContext,
    TransportFetch,
)
from lanekv.transfer.connector.nixl_fetch import NixlFetch, NixlPeer, window_layers
from lanekv.transfer.errors import RemoteError, TransferError
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.nixl.agent import Agent, NixlTransferError, NixlUnavailable, memory_kind
from lanekv.transfer.nixl.runs import PoolRegion
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, start_of
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.wire import kv_dtype

NIXL = "nixl"
log = logging.getLogger("lanekv.transfer")


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
        self._peers: dict[str, NixlPeer] = {}
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def from_context(cls, ctx: TransportContext) -> NixlTransport:
        return cls(ctx.kv, ctx.agreement, failures=ctx.failures)

    @property
    def kv(self) -> KVClient:
        return self._kv

    def claim(self, job: FetchJob, ranks: Sequence[int]) -> dict[int, Route]:
        start = start_of(job.epoch) or ""
        routes = {}
        for rank in ranks:
            endpoint = job.endpoints[rank]
            try:
                peer = self._peer(endpoint, start, job.epoch)
            except (NixlUnavailable, NixlTransferError, TransferError, ValueError) as err:
                log.warning("NIXL: rank %d at %s goes over gRPC: %s", rank, endpoint, err)
                continue
            if job.heads is not None and not window_layers(peer, _region(job.pool, 0), len(job.pages[rank]),
                                                           job.page_size, job.num_layers):
                log.warning("NIXL: rank %d at %s stages %d bytes, less than one layer of heads %s of %d pages: "
                            "over gRPC", rank, endpoint, peer.staging_bytes, job.heads, len(job.pages[rank]))
                continue
            routes[rank] = Route(NIXL)
        return routes

    def start(self, job: FetchJob, routes: Mapping[int, Route], coverage: Coverage) -> TransportFetch:
        if job.heads is not None and job.heads[1] != job.pool.shape[3]:
            raise KVFetchError(Code.INTERNAL, f"NIXL: heads {job.heads} are not the {job.pool.shape[3]} KV heads "
                               "of the decode pool's rows")
        local = self._register(job.pool)
        start = start_of(job.epoch) or ""
        peers = {}
        for rank in routes:
            peer = self._peers.get(job.endpoints[rank])
            if peer is None or peer.start != start:
                raise KVFetchError(Code.UNAVAILABLE, f"NIXL: rank {rank} at {job.endpoints[rank]} is not attached "
                                   f"for start {start!r}")
            peers[rank] = peer
        return NixlFetch(self, job, peers, local, coverage)

    def release_pool(self, pool: torch.Tensor) -> bool:
        """Release the registration of ``pool`` (freed: no fetch into it may run); whether
        it was registered."""
        with self._lock:
            region, agent = self._local.pop(pool.data_ptr(), None), self._agent
        return region is not None and agent is not None and agent.deregister(pool)

    def count(self, cause: str) -> None:
        if self.failures is not None:
            self.failures.labels(cause=cause).inc()

    def read(self, peer: NixlPeer, pairs: list[tuple[int, int, int]], pool: torch.Tensor, deadline: float) -> None:
        """READ ``pairs`` from ``peer`` into ``pool`` (registered by ``start``); see ``Agent.read``."""
        self._agent_here().read(peer.agent, peer.memory, pairs, peer.device, memory_kind(pool),
                                pool.device.index or 0, deadline)

    def forget_peer(self, endpoint: str, peer: NixlPeer) -> None:
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

    def _peer(self, endpoint: str, start: str, ticket: str | None) -> NixlPeer:
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
        peer = NixlPeer(start, name, PoolRegion(reply.pool_addr, a.kv_planes, reply.pool_bytes // per_row,
                                                row_bytes), reply.memory, reply.device_id, reply.staging_addr,
                        reply.staging_bytes)
        with self._lock:
            self._peers[endpoint] = peer
        return peer


def _itemsize(a: Agreement) -> int:
    return kv_dtype(a.kv_dtype).itemsize


def _region(pool: torch.Tensor, addr: int) -> PoolRegion:
    layers, planes, rows, heads, dim = pool.shape
    return PoolRegion(addr, planes, rows, heads * dim * pool.element_size())
