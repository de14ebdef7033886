"""The decode side of the same-host fast path (see ``transfer.protocol.descriptors``).

``FastPath.pool`` asks a rank once per prefill-daemon start for its pool
(``AttachPool``) and maps it; a rank that refuses, or a handle this process
cannot open, is remembered as ``None`` and the caller uses gRPC for it.
``FastPath.fetch`` streams a rank's descriptors (each layer as soon as the
rank has written it), copies the pages from the mapped pool into the
caller's pages and checks the digest of every copied chunk
(``DigestMismatch``: the caller fetches that rank again over gRPC).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.transfer.errors import CorruptChunk, RemoteError
from lanekv.transfer.fastpath.copyorder import CopyOrder
from lanekv.transfer.fastpath.rangecopy import Prepared, copy_range
from lanekv.transfer.fastpath.sidestreams import Streams, StreamSet, streams_for
from lanekv.transfer.fastpath.tuning import DEFAULT_FAST_PATH, FastPathTuning
from lanekv.transfer.grpcfetch.client import FETCH_METHOD, KVClient
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, start_of
from lanekv.transfer.protocol.contract import Agreement
from lanekv.transfer.protocol.descriptors import (
    CUDA_IPC,
    SHM,
    Descriptor,
    PoolHandle,
    as_u64,
    host_id,
    open_pool,
)
from lanekv.transfer.protocol.wire import kv_dtype

log = logging.getLogger("lanekv.transfer")
ATTACH_METHOD = "/lanekv.v1.KVTransfer/AttachPool"
# Destination pages of logical pages (the caller's page table).
PagesFor = Callable[[Sequence[int]], list[int]]
# Told of every copied and verified chunk: (logical pages, layer_start, layer_end).
OnCopied = Callable[[Sequence[int], int, int], None]


class DigestMismatch(CorruptChunk):
    """Pages copied from a shared pool do not match the digest the rank sent."""


class FastStats(NamedTuple):
    bytes: int
    chunks: int
    seconds: float
    received_s: float = 0.0  # until the rank's last descriptor
    copy_s: float = 0.0  # then the copies not made while receiving, and every digest
    runs: int = 0  # most runs of consecutive pages in a descriptor (1: one dense block per layer)
    first_s: float = 0.0  # from the call to the rank's first announcement
    issued_s: float = 0.0  # from the call to the last range's copies and digests queued
    called_s: float = 0.0  # from the call to the rank's FetchKV going out


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
        metadata = ((EPOCH_METADATA_KEY, epoch),) if epoch else None
        try:
            attach = self._kv.channel(endpoint).unary_unary(
                ATTACH_METHOD, request_serializer=lanekv_pb2.AttachRequest.SerializeToString,
                response_deserializer=lanekv_pb2.AttachReply.FromString)
            handle = PoolHandle.decode(attach(request, timeout=timeout, metadata=metadata).handle)
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

    def fetch(self, endpoint: str, rank: int, src: torch.Tensor, request_id: str, fingerprint: str,
              pages: Sequence[int], dst_pool: torch.Tensor, pages_for: PagesFor, on_copied: OnCopied,
              *, epoch: str | None, timeout: float, on_call: Callable[[Any], None] | None = None,
              order: CopyOrder | None = None, expect: Sequence[int] | None = None,
              tuning: FastPathTuning | None = None) -> FastStats:
        """Copy layers of the rank's ``pages`` of a request from ``src`` into ``dst_pool``, verified.

        ``order``: the copy order of the ranks fetched at once (``CopyOrder``).
        ``expect``: where ``pages`` are in the rank's pool (``Topology.physical_of``),
        given when the caller knows that every layer of them is written (the
        prefill answered). Every layer is then copied from there at once, a
        round trip before the rank's announcement comes; the announcement must
        name every layer of those places, else the pages are copied again from
        where it says. The rank's digest checks the bytes either way.
        ``tuning``: how to call and copy (None: this FastPath's ``tuning``).
        """
        order = CopyOrder(()) if order is None else order
        tuning = self.tuning if tuning is None else tuning
        try:
            return self._fetch(endpoint, rank, src, request_id, fingerprint, pages, dst_pool, pages_for, on_copied,
                               epoch, time.monotonic() + timeout, on_call, order, expect, tuning)
        finally:
            order.done(rank)  # the others go on without this rank's copies

    def _fetch(self, endpoint: str, rank: int, src: torch.Tensor, request_id: str, fingerprint: str,
               pages: Sequence[int], dst_pool: torch.Tensor, pages_for: PagesFor, on_copied: OnCopied,
               epoch: str | None, deadline: float, on_call: Callable[[Any], None] | None,
               order: CopyOrder, expect: Sequence[int] | None, tuning: FastPathTuning) -> FastStats:
        start = time.perf_counter()
        a, ps = self._agreement, self._agreement.page_size
        asked = set(pages)
        guess = None if expect is None else _guess(request_id, rank, pages, asked, expect, src.shape[2] // ps,
                                                   a.num_layers)
        request = lanekv_pb2.FetchRequest(request_id=request_id, fingerprint=fingerprint, layer_start=0,
                                          layer_end=a.num_layers, pages=list(pages), descriptors=True)
        metadata = ((EPOCH_METADATA_KEY, epoch),) if epoch else None
        channel = self._kv.channel(endpoint, direct=tuning.direct_descriptors)
        stream = channel.unary_stream(
            FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
            response_deserializer=lanekv_pb2.KVChunk.FromString)
        calls: list[Any] = []
        times: dict[str, float] = {}

        def call_rank() -> Any:
            call = stream(request, timeout=max(0.001, deadline - time.monotonic()), metadata=metadata)
            calls.append(call)
            times["called"] = time.perf_counter()
            if on_call is not None:
                on_call(call)  # the caller may cancel it
            return call

        try:
            call = call_rank()  # its round trip runs while this prepares (and copies early)
            with streams_for(src.device, dst_pool.device, self._stream_set(rank, src.device, dst_pool.device)) \
                    as streams, _settled(streams):
                if tuning.prepare_in_order:
                    order.may_prepare(rank, deadline - time.monotonic())
                # Where the asked pages go here, and a digest of them over every layer
                # that each range of them adds its layers to (made after early copies).
                ready = Prepared(tuple(pages), pages_for(pages), dst_pool, ps, a.num_layers, streams)
                if guess is None:
                    ready.make()
                early = None
                if guess is not None:
                    order.turn(rank, deadline - time.monotonic())
                    early = (guess, copy_range(src, guess, ready.dst, dst_pool, streams, ready, ps, tuning.copy))
                    times["issued"] = time.perf_counter()
                    order.done(rank)
                order.prepared(rank)
                received = self._receive(call, endpoint, rank, request_id, asked, src, dst_pool, pages_for,
                                         streams, times, ready, order, deadline, tuning, early)
                order.all_queued(deadline - time.monotonic())
                received_s = time.perf_counter() - start
                with streams.digesting():
                    got = [as_u64(t) for t in torch.stack([r.digest for r in received]).cpu()]
                streams.sync()
                copied_s = time.perf_counter() - start
            self._finish(call, endpoint, rank, request_id, len(received))
        except RemoteError as err:
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # the connection may be stuck
                self._kv.reconnect(endpoint, channel, direct=tuning.direct_descriptors)
            raise
        finally:
            for call in calls:
                call.cancel()
        for (d, *_), value in zip(received, got):
            if value != d.digest:
                raise DigestMismatch(request_id, rank, d.seq, "was copied from the shared pool but does not "
                                     "match the rank's digest")
        for d, *_ in received:
            on_copied(d.pages, d.layer_start, d.layer_end)
        page_layer_bytes = src.shape[1] * ps * src.shape[3] * src.shape[4] * src.element_size()
        nbytes = sum(len(d.pages) * (d.layer_end - d.layer_start) for d, *_ in received) * page_layer_bytes
        runs = max((r.runs for r in received), default=0)
        seconds = time.perf_counter() - start
        return FastStats(nbytes, len(received), seconds, received_s, copied_s - received_s, runs,
                         *(times.get(step, start) - start for step in ("first", "issued", "called")))

    def _receive(self, call, endpoint: str, rank: int, request_id: str, asked: set[int], src: torch.Tensor,
                 dst_pool: torch.Tensor, pages_for: PagesFor, streams: Streams,
                 times: dict[str, float], ready: Prepared, order: CopyOrder, deadline: float,
                 tuning: FastPathTuning, early: tuple[Descriptor, tuple[torch.Tensor, int]] | None) -> list[_Range]:
        """The stream's ranges up to the last layer's, each announced then sealed, checked.

        ``early``: a range copied before the first message, and its copy; it stands
        for the first announcement when that is the same (else it is copied again).

        Copies start at an announcement: of each range (``copy_at_end`` False), or
        of every range at the last one's; the rank's digest of the last range then
        runs while they do. The stream's status is read after the copies; a
        stream that ends before the last layer's range is a ``CorruptChunk``.
        ``times`` gets when the first message came ("first") and when the last
        copies were queued ("issued"). The copies of the last range wait for
        the rank's turn in ``order``.
        """
        a = self._agreement
        sealed: list[tuple[Descriptor, list[int]]] = []
        todo: list[tuple[Descriptor, list[int]]] = []  # announced, not copied yet
        announced: tuple[Descriptor, list[int]] | None = None
        copied: dict[int, tuple[torch.Tensor, int]] = {}  # by seq, once copied: (digest, runs)
        try:
            for message in call:
                times.setdefault("first", time.perf_counter())
                seq = len(sealed)
                if announced is None:
                    try:
                        d = Descriptor.decode(message.header)
                    except ValueError as err:
                        raise CorruptChunk(request_id, rank, seq, f"has a bad descriptor: {err}") from err
                    bad = "is sealed before it was announced" if d.digest is not None else \
                        _mismatch(d, request_id, rank, seq, asked, src.shape[2] // a.page_size, a.num_layers)
                    if bad:
                        raise CorruptChunk(request_id, rank, seq, bad)
                    announced = (d, ready.dst if d.pages == ready.pages else pages_for(d.pages))
                    if early is not None:
                        (guess, made), early = early, None
                        if d == guess:
                            copied[d.seq] = made
                            continue
                        log.info("fast path: rank %d announced %s, not the places copied early; copying again",
                                 rank, _what(d))
                        ready.discard()  # the ranges copied again add up in a digest of their own
                    todo.append(announced)
                    if not self.copy_at_end or d.layer_end == a.num_layers:
                        last = d.layer_end == a.num_layers
                        if last:
                            order.turn(rank, deadline - time.monotonic())
                        for r, dst in todo:
                            copied[r.seq] = copy_range(src, r, dst, dst_pool, streams, ready, a.page_size,
                                                       tuning.copy)
                        todo.clear()
                        times["issued"] = time.perf_counter()
                        if last:
                            order.done(rank)
                    continue
                d = announced[0].sealed_by(message.header)
                if d is None:
                    raise CorruptChunk(request_id, rank, seq, "does not seal the range announced before it")
                sealed.append((d, announced[1]))
                announced = None
                if d.layer_end == a.num_layers:
                    return [_Range(r, dst, *copied[r.seq]) for r, dst in sealed]
        except grpc.RpcError as err:
            raise RemoteError(rank, endpoint, err.code(), err.details() or "") from err
        layer = sealed[-1][0].layer_end if sealed else 0
        raise CorruptChunk(request_id, rank, len(sealed), f"was not sent: the stream ended after layer {layer} "
                           f"of {a.num_layers}")

    @staticmethod
    def _finish(call, endpoint: str, rank: int, request_id: str, seq: int) -> None:
        """The stream's end: its status, and nothing after the last layer's range."""
        try:
            for _ in call:
                raise CorruptChunk(request_id, rank, seq, "came after the descriptor of the last layer")
        except grpc.RpcError as err:
            raise RemoteError(rank, endpoint, err.code(), err.details() or "") from err


class _Range(NamedTuple):
    """A sealed range, where its pages went here, the digest of what was copied (device),
    and the runs of consecutive pages it was copied in."""

    descriptor: Descriptor
    dst: list[int]
    digest: torch.Tensor
    runs: int


@contextlib.contextmanager
def _settled(streams: Streams) -> Iterator[None]:
    """On an error, wait for the copies already queued: none may land in the caller's
    pages after the fetch failed (the caller frees them)."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the error that got here is the one to report
            streams.sync()
        raise


def _guess(request_id: str, rank: int, pages: Sequence[int], asked: set[int], expect: Sequence[int],
           src_pages: int, num_layers: int) -> Descriptor:
    """Every layer of ``pages`` at the places ``expect`` names, checked as a descriptor is."""
    if not pages or len(expect) != len(pages):
        raise ValueError(f"expect names {len(expect)} places for {len(pages)} pages")
    guess = Descriptor(request_id, rank, 0, 0, num_layers, tuple(pages), tuple(expect), None)
    bad = _mismatch(guess, request_id, rank, 0, asked, src_pages, num_layers)
    if bad:
        raise ValueError(f"expect {bad}")
    return guess


def _what(d: Descriptor) -> str:
    return f"layers [{d.layer_start}, {d.layer_end}) of {len(d.pages)} pages"


def _mismatch(d: Descriptor, request_id: str, rank: int, seq: int, asked: set[int], src_pages: int,
              num_layers: int) -> str:
    """Why a descriptor is not one this fetch can use ('' when it is)."""
    if d.request_id != request_id or d.rank != rank or d.seq != seq:
        return f"is {d.request_id!r} rank {d.rank} seq {d.seq}"
    if d.layer_end > num_layers:
        return f"names layers up to {d.layer_end} of {num_layers}"
    if not asked.issuperset(d.pages):
        return f"names pages {[p for p in d.pages if p not in asked][:8]} that were not asked for"
    outside = [p for p in d.physical if not 0 <= p < src_pages]
    if outside:
        return f"names physical pages {outside[:8]} outside the shared pool of {src_pages}"
    if len(set(d.pages)) != len(d.pages):
        return "names a page twice"
    if len(set(d.physical)) != len(d.physical):
        return "names a place twice in the shared pool"
    return ""
