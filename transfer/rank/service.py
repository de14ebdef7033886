"""The gRPC KVTransfer service: handshake, streamed FetchKV, Release, AttachPool, StageKV.

One server per prefill CP rank serves the pages that rank owns, read through
a ``PageSource`` (``transfer.rank.sources``). Nothing moves unless the caller's
agreement equals ours: a handshake compares field by field, and every
FetchKV, Release and AttachPool carries the agreement's fingerprint again.
FetchKV sends each chunk once its layers are written (the prefill may still
run); with ``descriptors`` it sends where the pages are in the pool shared by
AttachPool, and their digest, instead of the bytes (``transfer.protocol.descriptors``).
With ``nixl`` and a head range, each sealed range's heads are packed into a lease
of the rank's NIXL staging region (``transfer.nixl.staging``) and the seal says
where; the lease is held until the caller ends the call (it has read them then).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, NamedTuple, TypeVar

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.limits import peer_host
from lanekv.runtime.security import SecurityConfig, bind, make_server
from lanekv.runtime.status import (
    CONTRACT_METADATA_KEY,
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES_LIMIT,
    TRANSFER_SERVICE,
    HealthServicer,
    Refusal,
    refusals,
)
from lanekv.transfer.nixl.agent import NixlUnavailable
from lanekv.transfer.nixl.export import NixlExport
from lanekv.transfer.nixl.staging import Lease, StagingFull
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY
from lanekv.transfer.protocol.contract import (
    Agreement,
    LayoutContract,
    agreement_of,
    diff,
    format_diff,
)
from lanekv.transfer.protocol.descriptors import MAX_TRANSPORTS, Descriptor, host_id
from lanekv.transfer.protocol.wire import (
    MAX_REQUEST_ID_LEN,
    ChunkHeader,
    ChunkPlan,
    encode_chunk,
    frame_chunk,
    kv_dtype,
    plan_chunks,
)
from lanekv.transfer.rank.progress import PrefillFailed
from lanekv.transfer.rank.sources import PageSource
from lanekv.transfer.rank.staging import RELAY_METADATA_KEY, RankStaging

Code = grpc.StatusCode
T = TypeVar("T")
# Attached peers remembered per rank (a descriptors fetch needs an AttachPool first).
MAX_ATTACHED_PEERS = 1024
# The longest a FetchKV waits for one layer of a prefill that is still running
# (less when the call's deadline comes first).
LAYER_WAIT_S = 600.0
# The longest a staged NIXL FetchKV holds its lease after its last range, waiting for the
# caller to end the call (less when the call's deadline comes first): a caller that read
# later than this reads bytes its digest check refuses.
STAGING_HOLD_S = 60.0
# Called when a FetchKV stream has sent its last chunk: (request_id, payload bytes, seconds).
OnFetched = Callable[[str, int, float], None]


class _Span(NamedTuple):
    """What one FetchKV asks of this rank: layers ``[layer_start, layer_end)`` of ``pages``."""

    layer_start: int
    layer_end: int
    pages: tuple[int, ...]  # logical, in the caller's order
    physical: tuple[int, ...]  # where each is in this rank's pool


class KVTransferService(lanekv_pb2_grpc.KVTransferServicer):
    def __init__(
        self,
        source: PageSource,
        *,
        default_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_chunk_bytes: int = MAX_CHUNK_BYTES_LIMIT,
        on_fetched: OnFetched | None = None,
        epoch: str | None = None,
        layer_wait_s: float = LAYER_WAIT_S,
        nixl: NixlExport | None = None,
        relay_staging: RankStaging | None = None,
    ) -> None:
        # The contract is read from the source at every call: the topology may
        # be completed after the server starts (endpoints are known only once
        # every rank has bound its port).
        self._source = source
        self._default_chunk_bytes = default_chunk_bytes
        self._max_chunk_bytes = max_chunk_bytes
        self._on_fetched = on_fetched
        self._epoch = epoch
        self._layer_wait_s = layer_wait_s
        self._nixl = nixl  # the pool offered over NIXL (NixlAttach), or None
        self._relay_staging = relay_staging  # the staged relays' files (StageKV), or None
        self._attached: OrderedDict[str, None] = OrderedDict()  # peer hosts that called AttachPool
        self._attached_lock = threading.Lock()

    def Handshake(self, request, context):
        with refusals(context):
            try:
                theirs = agreement_of(request.contract)
            except (ValueError, TypeError) as err:
                raise Refusal(Code.INVALID_ARGUMENT, f"undecodable contract: {err}") from err
            contract = self._contract()
            diffs = diff(contract.agreement, theirs)
            if diffs:
                context.set_trailing_metadata(((CONTRACT_METADATA_KEY, contract.encode()),))
                raise Refusal(
                    Code.FAILED_PRECONDITION,
                    f"layout contract mismatch on {len(diffs)} field(s):\n"
                    + format_diff(diffs, ours="server", theirs="caller"),
                )
        return lanekv_pb2.HandshakeReply(
            ok=True, contract=contract.encode(), fingerprint=contract.fingerprint
        )

    def FetchKV(self, request, context):
        with refusals(context):
            start = time.perf_counter()
            # Everything is checked before the first yield: a refused fetch sends no byte.
            agreement = self._agreed(request.request_id, request.fingerprint)
            self._same_start(context, request.request_id)
            heads = _heads(request, agreement)
            if request.nixl:
                self._check_nixl(request)
            elif request.descriptors:
                self._check_attached(context)
            span = self._span(request, agreement)
            chunks = [] if request.descriptors else self._plan(request, agreement, span)
            rid, sent_bytes = request.request_id, 0
            staged = self._staging(context, span, agreement, heads) if request.nixl and heads is not None else None

            def alive() -> bool:
                return context.is_active() and self._holds(rid)

            def ready(layer_end: int, exact: bool = False) -> tuple[int, Any]:
                return self._ready(context, rid, layer_end, alive, exact)

            if request.descriptors:
                try:
                    yield from self._descriptors(rid, span, ready, exact=request.nixl, heads=heads,
                                                 lease=None if staged is None else staged[0])
                except BaseException:
                    if staged is not None:
                        staged[0].release()
                    raise
                sent_bytes = len(span.pages) * (span.layer_end - span.layer_start) * _page_bytes(agreement, heads)
            else:
                def message(seq: int) -> tuple[bytes, int]:
                    chunk, physical = chunks[seq]
                    # The event of the chunk's own last layer: a read waits for no later layer.
                    _, after = ready(chunk.layer_end, exact=True)
                    payload = self._source.read(physical, chunk.layer_start, chunk.layer_end, after)
                    # A release racing this fetch may have recycled the pages under
                    # the read; checking after it proves they were held throughout.
                    self._owned(rid)
                    _check_payload(payload, chunk, agreement)
                    if heads is not None:  # a TP decode rank's KV heads: the checksum covers only them
                        payload = payload[:, :, :, heads]
                    header, data = encode_chunk(rid, self._source.rank, seq, chunk.layer_start, chunk.pages, payload)
                    return self.frame(header, data), header.nbytes

                for framed, nbytes in _one_ahead(message, len(chunks)):
                    yield framed
                    sent_bytes += nbytes
            if self._on_fetched is not None:
                self._on_fetched(rid, sent_bytes, time.perf_counter() - start)
            if staged is not None:  # the caller reads the last range now: held until it ends the call
                lease, ended = staged
                left = context.time_remaining()
                ended.wait(STAGING_HOLD_S if left is None else min(left, STAGING_HOLD_S))
                lease.release()

    def _ready(self, context: grpc.ServicerContext, rid: str, layer_end: int, alive: Callable[[], bool],
               exact: bool = False) -> tuple[int, Any]:
        """Wait until layers < layer_end are written (the prefill may still run)."""
        left = context.time_remaining()
        wait_s = self._layer_wait_s if left is None else min(left, self._layer_wait_s)
        try:
            return self._source.ready(rid, layer_end, wait_s, alive, exact=exact)
        except KeyError as err:
            raise Refusal(Code.NOT_FOUND, _key_message(rid, err)) from err
        except PrefillFailed as err:
            raise Refusal(Code.ABORTED, f"request {rid!r}: the prefill did not write its KV: {err}") from err
        except TimeoutError as err:
            raise Refusal(Code.DEADLINE_EXCEEDED, f"request {rid!r}: {err}") from err

    def StageKV(self, request, context):
        """A staged relay's read (``transfer.rank.staging``): layers of pages this rank holds for
        the request, read on its own (read stream, DMA) into a slot of that relay's file, and
        their chunk seal (``protocol.chunkseal``), taken as they were read."""
        with refusals(context):
            if self._relay_staging is None:
                raise Refusal(Code.FAILED_PRECONDITION, f"rank {self._source.rank} has no staged relays")
            slot = self._relay_staging.slot(request.secret, request.slot)
            agreement, rid = self._contract().agreement, request.request_id
            owned = dict(self._owned(rid))
            if not 0 <= request.layer_start < request.layer_end <= agreement.num_layers:
                raise Refusal(Code.INVALID_ARGUMENT, f"layer range [{request.layer_start}, {request.layer_end}) "
                              f"is not within [0, {agreement.num_layers})")
            pages = list(request.pages)
            foreign = [page for page in pages if page not in owned]
            if not pages or foreign or len(set(pages)) != len(pages):
                raise Refusal(Code.INVALID_ARGUMENT, f"pages {pages[:16]} are not distinct pages of request "
                              f"{rid!r:.80} on rank {self._source.rank}")
            layers = request.layer_end - request.layer_start
            nbytes = len(pages) * layers * _page_bytes(agreement)
            if nbytes > slot.numel():
                raise Refusal(Code.INVALID_ARGUMENT, f"{nbytes} bytes do not fit a slot of {slot.numel()}")
            _, after = self._ready(context, rid, request.layer_end, lambda: context.is_active() and self._holds(rid),
                                   exact=True)
            shape = (layers, agreement.kv_planes, len(pages) * agreement.page_size, agreement.num_kv_heads,
                     agreement.head_dim)
            out = slot[:nbytes].view(kv_dtype(agreement.kv_dtype)).view(shape)
            sealed = self._source.read_into([owned[page] for page in pages], request.layer_start,
                                            request.layer_end, after, out)
            self._owned(rid)  # held throughout the read: the pages were not recycled under it
            self._relay_staging.staged(slot, nbytes, rid)
        return lanekv_pb2.StageReply(nbytes=nbytes, seal=sealed)

    def _staging(self, context: grpc.ServicerContext, span: _Span, agreement: Agreement,
                 heads: slice) -> tuple[Lease, threading.Event]:
        """A lease of the rank's NIXL staging region for the call's head slice, released
        when the call ends (the event is set then); RESOURCE_EXHAUSTED when it is full."""
        nbytes = len(span.pages) * (span.layer_end - span.layer_start) * _page_bytes(agreement, heads)
        try:
            lease = self._nixl.lease(nbytes)
        except StagingFull as err:
            raise Refusal(Code.RESOURCE_EXHAUSTED, f"rank {self._source.rank}: {err}; fetch fewer layers at "
                          "once or over gRPC") from err
        except (RuntimeError, ValueError) as err:
            raise Refusal(Code.FAILED_PRECONDITION, f"rank {self._source.rank}: {err}") from err
        ended = threading.Event()

        def end() -> None:
            lease.release()
            ended.set()

        if not context.add_callback(end):  # the call has ended already
            end()
        return lease, ended

    def _descriptors(self, rid: str, span: _Span, ready: Callable[..., tuple[int, Any]],
                     exact: bool = False, heads: slice | None = None, lease: Lease | None = None) -> Iterator[bytes]:
        """Descriptor chunks (the fast path): each covers every layer written since the
        one before, so a finished prefill goes in one and a running one layer by layer.

        Each range goes twice: announced (no digest) once its layers are written
        on the device, so the caller may start copying them, then sealed with
        the digest the rank took meanwhile (while it held the pages).

        ``exact`` (NIXL, read from another host): a range ends at the last layer whose
        event has completed, not at the last one queued, so the first range goes
        out as soon as its first layer is on the device (layer-wise streaming).

        ``heads`` (a TP decode rank's KV heads): the descriptors are the same, the
        caller copies only those heads of each row, and the digest covers exactly
        them (``PageSource.digest``), the bytes that rank receives. With ``lease``
        (NIXL and ``heads``) they are packed there before the seal, which says where.
        """
        seq, layer = 0, span.layer_start
        while layer < span.layer_end:
            written, after = ready(layer + 1, exact)
            upto = min(span.layer_end, written)
            if exact:
                upto = layer + 1
                while upto < min(span.layer_end, written):
                    _, later = ready(upto + 1, True)
                    if later is not None and not later.query():
                        break  # queued, not yet written on the device
                    upto, after = upto + 1, later
            if after is not None:
                after.synchronize()  # written on the device, not only queued
            announced = Descriptor(rid, self._source.rank, seq, layer, upto, span.pages, span.physical, None)
            yield frame_chunk(announced.encode(), memoryview(b""))
            digest = self._source.digest(span.physical, layer, upto, after, request_id=rid, heads=heads)
            staged = b""
            if lease is not None and heads is not None and self._nixl is not None:
                offset = self._nixl.stage(lease, span.physical, self._contract().agreement.page_size, layer, upto,
                                          span.layer_start, heads)
                staged = lanekv_pb2.KVChunk(nixl_staged=offset).SerializeToString()
            self._owned(rid)  # held while the digest (and the staging) read them
            yield frame_chunk(dataclasses.replace(announced, digest=digest).encode(), memoryview(b"")) + staged
            seq, layer = seq + 1, upto

    def AttachPool(self, request, context):
        with refusals(context):
            self._agreed("attach", request.fingerprint)
            self._same_start(context)
            here = host_id()
            if request.host_id != here:
                raise Refusal(Code.FAILED_PRECONDITION,
                              f"host_id {request.host_id!r:.120} is not this rank's host {here!r}: "
                              "the fast path needs one host")
            transports = list(request.transports)
            if len(transports) > MAX_TRANSPORTS:
                raise Refusal(Code.INVALID_ARGUMENT, f"transports lists {len(transports)} entries, at most {MAX_TRANSPORTS}")
            try:
                handle = self._source.share(transports)
            except ValueError as err:
                raise Refusal(Code.FAILED_PRECONDITION, f"rank {self._source.rank}: {err}") from err
            with self._attached_lock:
                self._attached[peer_host(context.peer() or "")] = None
                while len(self._attached) > MAX_ATTACHED_PEERS:
                    self._attached.popitem(last=False)
        return lanekv_pb2.AttachReply(handle=handle.encode())

    def NixlAttach(self, request, context):
        with refusals(context):
            self._agreed("attach", request.fingerprint)
            self._same_start(context)
            if self._nixl is None:
                raise Refusal(Code.FAILED_PRECONDITION, f"rank {self._source.rank} offers no NIXL")
            try:
                return self._nixl.attach()
            except (NixlUnavailable, RuntimeError, ValueError) as err:
                raise Refusal(Code.FAILED_PRECONDITION, f"rank {self._source.rank}: {err}") from err

    def _check_nixl(self, request: lanekv_pb2.FetchRequest) -> None:
        if not request.descriptors:
            raise Refusal(Code.INVALID_ARGUMENT, "nixl=true needs descriptors=true: NIXL moves the bytes")
        if self._nixl is None or not self._nixl.attached:
            raise Refusal(Code.FAILED_PRECONDITION,
                          f"nixl=true needs a NixlAttach on rank {self._source.rank} first")

    def Release(self, request, context):
        with refusals(context):
            self._agreed(request.request_id, request.fingerprint)
            self._same_start(context, request.request_id)
            try:
                freed = self._source.release(request.request_id)
            except KeyError as err:
                raise Refusal(Code.NOT_FOUND, _key_message(request.request_id, err)) from err
        return lanekv_pb2.ReleaseReply(pages_freed=freed)

    def frame(self, header: ChunkHeader, data: memoryview) -> bytes:
        """The serialized KVChunk of one chunk (the last step before the bytes leave)."""
        return frame_chunk(header.encode(), data)

    def _contract(self) -> LayoutContract:
        try:
            return self._source.contract()
        except RuntimeError as err:  # the topology is not complete yet
            raise Refusal(Code.UNAVAILABLE, str(err)) from err

    def _agreed(self, request_id: str, fingerprint: str) -> Agreement:
        """Our agreement, if the caller's fingerprint is its fingerprint and the request id is sane."""
        agreement = self._contract().agreement
        if fingerprint != agreement.fingerprint:
            raise Refusal(
                Code.FAILED_PRECONDITION,
                f"contract fingerprint {fingerprint!r:.80} is not this server's {agreement.fingerprint}; handshake again",
            )
        if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise Refusal(
                Code.INVALID_ARGUMENT,
                f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters, got {request_id!r:.80}",
            )
        return agreement

    def _same_start(self, context: grpc.ServicerContext, request_id: str | None = None) -> None:
        """Refuse a caller that names another start of the prefill daemon than ours, and
        (with ``request_id``) one without the capability the request was pinned with."""
        capability = None
        for key, value in context.invocation_metadata() or ():
            if key != EPOCH_METADATA_KEY:
                continue
            epoch, _, capability = value.partition(":")
            if self._epoch is not None and epoch and epoch != self._epoch:
                raise Refusal(
                    Code.FAILED_PRECONDITION,
                    f"the request was prefilled by prefill daemon start {epoch!r:.40}, this is start "
                    f"{self._epoch!r}: the daemon restarted and the request's pages are gone",
                )
        if request_id is not None and not self._source.admits(request_id, capability or None):
            # The answer an unknown id gets, word for word: a caller without the
            # capability cannot tell which request ids are live.
            raise Refusal(Code.NOT_FOUND, _unknown_message(request_id))

    def _check_attached(self, context: grpc.ServicerContext) -> None:
        """Descriptors are for a same-host peer that attached the pool first, or a staged relay of ours."""
        if self._relay_staging is not None and any(
                key == RELAY_METADATA_KEY and self._relay_staging.knows(value)
                for key, value in context.invocation_metadata() or ()):
            return
        with self._attached_lock:
            attached = peer_host(context.peer() or "") in self._attached
        if not attached:
            raise Refusal(Code.FAILED_PRECONDITION,
                          f"descriptors=true needs an AttachPool on rank {self._source.rank} first; "
                          "fetch the bytes (descriptors=false) or attach")

    def _holds(self, request_id: str) -> bool:
        try:
            self._source.pages_of(request_id)
        except KeyError:
            return False
        return True

    def _owned(self, request_id: str) -> list[tuple[int, int]]:
        try:
            return self._source.pages_of(request_id)
        except KeyError as err:
            raise Refusal(Code.NOT_FOUND, _key_message(request_id, err)) from err

    def _span(self, request: lanekv_pb2.FetchRequest, agreement: Agreement) -> _Span:
        """The layers and pages a fetch asks for, checked against what this rank holds."""
        owned = dict(self._owned(request.request_id))
        layer_end = request.layer_end if request.HasField("layer_end") else agreement.num_layers
        if not 0 <= request.layer_start < layer_end <= agreement.num_layers:
            raise Refusal(
                Code.INVALID_ARGUMENT,
                f"layer range [{request.layer_start}, {layer_end}) is not within [0, {agreement.num_layers})",
            )
        pages = list(request.pages) or list(owned)
        if len(set(pages)) != len(pages):
            raise Refusal(Code.INVALID_ARGUMENT, f"pages lists a page twice: {pages[:16]}")
        foreign = [page for page in pages if page not in owned]
        if foreign:
            raise Refusal(
                Code.INVALID_ARGUMENT,
                f"pages {foreign[:16]} are not pages of request {request.request_id!r} on rank {self._source.rank}",
            )
        return _Span(request.layer_start, layer_end, tuple(pages), tuple(owned[page] for page in pages))

    def _plan(
        self, request: lanekv_pb2.FetchRequest, agreement: Agreement, span: _Span
    ) -> list[tuple[ChunkPlan, list[int]]]:
        """Cut a fetch of bytes into chunks, each with its physical pages."""
        page_bytes = _page_bytes(agreement)
        chunk_bytes = request.max_chunk_bytes or self._default_chunk_bytes
        if not page_bytes <= chunk_bytes <= self._max_chunk_bytes:
            raise Refusal(
                Code.INVALID_ARGUMENT,
                f"max_chunk_bytes {chunk_bytes} is not within [{page_bytes} (one page of one layer), {self._max_chunk_bytes}]",
            )
        plans = plan_chunks(
            span.layer_end - span.layer_start,
            span.pages,
            page_bytes,
            chunk_bytes,
            layer_start=span.layer_start,
        )
        physical = dict(zip(span.pages, span.physical))
        return [(plan, [physical[page] for page in plan.pages]) for plan in plans]


# Chunks built ahead of the one gRPC is sending. Reading pages, hashing and
# framing a chunk take about as long as sending it, and the read, the hash and
# the framing copy drop the GIL (gRPC's own copy of the message does not:
# bench/notes_grpc_fetch_cpu.md), so two builders in flight keep the stream fed
# (one held the stream well below a raw one: BENCHMARKS.md, KV transfer over gRPC).
LOOKAHEAD = 3


def _one_ahead(produce: Callable[[int], T], count: int) -> Iterator[T]:
    """Yield ``produce(0)``, ..., ``produce(count - 1)`` in order, building the next
    ``LOOKAHEAD`` while gRPC sends the current one (a send blocks the handler thread)."""
    if count == 0:
        return
    with futures.ThreadPoolExecutor(max_workers=LOOKAHEAD - 1, thread_name_prefix="fetchkv") as pool:
        pending = deque(pool.submit(produce, seq) for seq in range(min(LOOKAHEAD, count)))
        for seq in range(count):
            message = pending.popleft().result()
            if seq + LOOKAHEAD < count:
                pending.append(pool.submit(produce, seq + LOOKAHEAD))
            yield message


def _heads(request: lanekv_pb2.FetchRequest, a: Agreement) -> slice | None:
    """The KV heads a fetch asks for (``head_start``/``head_count``), or None for whole rows."""
    has_start, has_count = request.HasField("head_start"), request.HasField("head_count")
    if not has_start and not has_count:
        return None
    start, count = request.head_start, request.head_count
    if not has_count or count < 1 or start + count > a.num_kv_heads:
        raise Refusal(Code.INVALID_ARGUMENT, f"heads [{start}, {start + count}) (head_start={start}, "
                      f"head_count={count if has_count else 'absent'}) are not within the "
                      f"num_kv_heads={a.num_kv_heads} of a row")
    return slice(start, start + count)


def _page_bytes(a: Agreement, heads: slice | None = None) -> int:
    """K and V (or the MLA latent) of one page of one layer (of KV heads ``heads`` only)."""
    count = a.num_kv_heads if heads is None else heads.stop - heads.start
    return a.kv_planes * a.page_size * count * a.head_dim * kv_dtype(a.kv_dtype).itemsize


def _check_payload(payload: torch.Tensor, chunk: ChunkPlan, a: Agreement) -> None:
    shape = (
        chunk.layer_end - chunk.layer_start,
        a.kv_planes,
        len(chunk.pages) * a.page_size,
        a.num_kv_heads,
        a.head_dim,
    )
    if tuple(payload.shape) != shape or payload.dtype != kv_dtype(a.kv_dtype):
        raise Refusal(
            Code.INTERNAL,
            f"page source returned {tuple(payload.shape)} {payload.dtype}, expected {shape} {a.kv_dtype}",
        )


def _key_message(request_id: str, err: KeyError) -> str:
    detail = err.args[0] if err.args else UNKNOWN
    return _unknown_message(request_id) if detail == UNKNOWN else f"request {request_id!r:.80}: {detail}"


UNKNOWN = "unknown request"  # what a source's KeyError says of an id it never held


def _unknown_message(request_id: str) -> str:
    return (f"request {request_id!r:.80}: {UNKNOWN} here, or not yours: present the capability its prefill "
            f"returned ('{EPOCH_METADATA_KEY}: <epoch>:<capability>' metadata)")


def add_transfer_service(server: grpc.Server, service: KVTransferService) -> None:
    """Register ``service`` on ``server``; use this, not the generated adder.

    FetchKV yields KVChunk messages already serialized by ``wire.frame_chunk``
    (one payload copy instead of three), so its handler passes bytes through.
    """
    handlers = {
        "Handshake": grpc.unary_unary_rpc_method_handler(
            service.Handshake,
            request_deserializer=lanekv_pb2.HandshakeRequest.FromString,
            response_serializer=lanekv_pb2.HandshakeReply.SerializeToString,
        ),
        "FetchKV": grpc.unary_stream_rpc_method_handler(
            service.FetchKV, request_deserializer=lanekv_pb2.FetchRequest.FromString
        ),
        "Release": grpc.unary_unary_rpc_method_handler(
            service.Release,
            request_deserializer=lanekv_pb2.ReleaseRequest.FromString,
            response_serializer=lanekv_pb2.ReleaseReply.SerializeToString,
        ),
        "AttachPool": grpc.unary_unary_rpc_method_handler(
            service.AttachPool,
            request_deserializer=lanekv_pb2.AttachRequest.FromString,
            response_serializer=lanekv_pb2.AttachReply.SerializeToString,
        ),
        "NixlAttach": grpc.unary_unary_rpc_method_handler(
            service.NixlAttach,
            request_deserializer=lanekv_pb2.NixlAttachRequest.FromString,
            response_serializer=lanekv_pb2.NixlAttachReply.SerializeToString,
        ),
        "StageKV": grpc.unary_unary_rpc_method_handler(
            service.StageKV,
            request_deserializer=lanekv_pb2.StageRequest.FromString,
            response_serializer=lanekv_pb2.StageReply.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(TRANSFER_SERVICE, handlers),)
    )


class Served(NamedTuple):
    server: grpc.Server
    port: int
    health: HealthServicer

    def stop(self, grace_s: float) -> None:
        """Say NOT_SERVING, then let open streams finish for ``grace_s`` and stop."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait(grace_s + 1.0)


def serve(
    source: PageSource,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    max_workers: int = 16,
    security: SecurityConfig | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    on_fetched: OnFetched | None = None,
    epoch: str | None = None,
    nixl: NixlExport | None = None,
    relay_staging: RankStaging | None = None,
) -> Served:
    """Start a KVTransfer server (plus the gRPC health service); port 0 picks a free port.

    Each open FetchKV stream holds one of ``max_workers`` threads. ``security``
    sets TLS and the token (``runtime.security``; None: plaintext, no token); ``interceptors`` go
    outside the token check (metrics); ``epoch`` names this start of the
    prefill daemon (see ``EPOCH_METADATA_KEY``; None: no check); ``relay_staging``: the files of
    the rank's staged relays, which StageKV fills. Raises ``OSError`` naming
    ``host:port`` when the port cannot be bound.
    """
    security = SecurityConfig() if security is None else security
    server = make_server(security, max_workers, interceptors=interceptors)
    add_transfer_service(server, KVTransferService(source, on_fetched=on_fetched, epoch=epoch, nixl=nixl,
                                                   relay_staging=relay_staging))
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = bind(server, host, port, security)
    server.start()
    for service in ("", TRANSFER_SERVICE):
        checker.set(service, health_pb2.HealthCheckResponse.SERVING)
    return Served(server, bound, checker)
