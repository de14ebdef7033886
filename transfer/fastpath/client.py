"""The decode side of the same-host fast path (see ``transfer.protocol.descriptors``).

``FastPath.pool`` asks a rank once per prefill-daemon start for its pool
(``AttachPool``) and maps it; a rank that refuses, or a handle this process
cannot open, is remembered as ``None`` and the caller uses gRPC for it.
``FastPath.fetch`` runs one rank's fetch (``transfer.fastpath.rankfetch``):
it streams the rank's descriptors (each layer as soon as the rank has
written it), copies the pages from the mapped pool into the caller's pages
and checks the digest of every copied chunk (``DigestMismatch``: the caller
fetches that rank again over gRPC).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.transfer.fastpath.copyorder import CopyOrder
from lanekv.transfer.fastpath.rankfetch import FastRequest, FastStats, RankFetch, RankPages
from lanekv.transfer.fastpath.sidestreams import StreamSet
from lanekv.transfer.fastpath.tuning import DEFAULT_FAST_PATH, FastPathTuning
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.access import epoch_metadata, start_of
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.descriptors import (
    CUDA_IPC,
    SHM,
    PoolHandle,
    host_id,
    open_pool,
)
from lanekv.transfer.protocol.wire import kv_dtype

log = logging.getLogger("lanekv.transfer")
ATTACH_METHOD = "/lanekv.v1.KVTransfer/AttachPool"


class _Attached(NamedTuple):
    epoch: str | None
    pool: torch.Tensor | None  # None: this rank is fetched over gRPC
    transport: str


class FastPath:
    """Mapped pools of same-host prefill ranks, by endpoint."""

    def __init__(self, kv: KVClient, agreement: Agreement, transports: Sequence[str] | None = None,
                 *, copy_at_end: bool = True, tuning: FastPathTuning = DEFAULT_FAST_PATH) -> None:
        self._kv = kv
        self.tuning = tuning
        # True: copy every layer once the rank has sent its last descriptor; False:
        # copy each layer as its descriptor arrives, overlapping the prefill (copies
        # from another process on the prefill's GPUs slow it; BENCHMARKS.md).
        self.copy_at_end = copy_at_end
        self._agreement = agreement
        if transports is None:
            transports = ([CUDA_IPC] if torch.cuda.is_available() else []) + [SHM]
        self._transports = list(transports)
        self._host = host_id()
        self._attached: dict[str, _Attached] = {}
        self._stream_sets: dict[tuple, StreamSet] = {}
        self._lock = threading.Lock()

    def pool(self, endpoint: str, epoch: str | None, timeout: float) -> torch.Tensor | None:
        """The rank's pool mapped here, or None when the fast path does not reach it.
        ``epoch``: the daemon start, or a request's ``access_ticket`` (one attach per start)."""
        epoch = start_of(epoch)
        with self._lock:
            known = self._attached.get(endpoint)
            if known is not None and known.epoch == epoch:
                return known.pool
        pool, transport = self._attach(endpoint, epoch, timeout)
        with self._lock:
            self._attached[endpoint] = _Attached(epoch, pool, transport)
        return pool

    def _stream_set(self, rank: int, src: torch.device, dst: torch.device) -> StreamSet:
        """The rank's side streams, made once: buffers the caching allocator keeps for a
        stream are reused by the next fetch instead of allocated again (each new stream
        from torch's pool of 32 starts with none)."""
        key = (rank, src, dst)
        with self._lock:
            made = self._stream_sets.get(key)
            if made is None:
                made = self._stream_sets[key] = StreamSet.make(src, dst)
            return made

    def transport(self, endpoint: str) -> str:
        """How the last attach to ``endpoint`` went: a transport name, or 'grpc'."""
        with self._lock:
            known = self._attached.get(endpoint)
        return known.transport if known is not None else "grpc"

    def _attach(self, endpoint: str, epoch: str | None, timeout: float) -> tuple[torch.Tensor | None, str]:
        request = lanekv_pb2.AttachRequest(fingerprint=self._agreement.fingerprint, host_id=self._host,
                                           transports=self._transports)
        try:
            attach = self._kv.channel(endpoint).unary_unary(
                ATTACH_METHOD, request_serializer=lanekv_pb2.AttachRequest.SerializeToString,
                response_deserializer=lanekv_pb2.AttachReply.FromString)
            handle = PoolHandle.decode(attach(request, timeout=timeout, metadata=epoch_metadata(epoch)).handle)
            pool = open_pool(handle)
            self._check(pool)
        except grpc.RpcError as err:
            log.info("fast path to %s: not offered (%s: %s); using gRPC", endpoint, err.code().name, err.details())
            return None, "grpc"
        except (ValueError, TypeError, OSError, RuntimeError) as err:
            log.warning("fast path to %s: cannot open the pool (%s); using gRPC", endpoint, err)
            return None, "grpc"
        log.info("fast path to %s: %s, pool %s %s", endpoint, handle.transport, tuple(pool.shape), pool.dtype)
        return pool, handle.transport

    def _check(self, pool: torch.Tensor) -> None:
        a = self._agreement
        if pool.dim() != 5 or pool.shape[0] != a.num_layers or pool.shape[1] != a.kv_planes \
                or tuple(pool.shape[3:]) != (a.num_kv_heads, a.head_dim) or pool.shape[2] % a.page_size:
            raise ValueError(f"shared pool is {tuple(pool.shape)}, not a pool of the agreed layout")
        if pool.dtype != kv_dtype(a.kv_dtype):
            raise ValueError(f"shared pool is {pool.dtype}, the agreement says {a.kv_dtype}")

    def fetch(self, request: FastRequest, part: RankPages, *, on_call: Callable[[Any], None] | None = None,
              order: CopyOrder | None = None, tuning: FastPathTuning | None = None) -> FastStats:
        """Copy every layer of ``part.pages`` of ``request`` from the rank's mapped pool
        (``part.src``, from ``pool``) into ``request.dst_pool``, each range verified
        (``rankfetch.RankFetch``).

        ``order``: the copy order of the ranks fetched at once (``CopyOrder``).
        ``on_call``: gets the rank's call (the caller may cancel it).
        ``tuning``: how to call and copy (None: this FastPath's ``tuning``).
        Raises ``ValueError`` for a bad ``part.expect`` (before any call),
        ``RemoteError``, ``CorruptChunk`` or ``DigestMismatch`` (fetch the rank
        over gRPC); no copy into ``request.dst_pool`` runs once it has raised.
        """
        order = CopyOrder(()) if order is None else order
        stream_set = functools.partial(self._stream_set, part.rank, part.src.device, request.dst_pool.device)
        try:
            fetch = RankFetch(self._kv, self._agreement, request, part, order=order,
                              tuning=self.tuning if tuning is None else tuning, copy_at_end=self.copy_at_end,
                              stream_set=stream_set, on_call=on_call)
            return fetch.run()
        finally:
            order.done(part.rank)  # the others go on without this rank's copies
