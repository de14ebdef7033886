"""The servicer of a rank's KVTransfer calls: Handshake, FetchKV, StageKV, AttachPool, NixlAttach, Release.

One servicer per prefill CP rank serves the pages that rank owns, read through
a ``PageSource`` (``transfer.rank.sources``). Nothing moves unless the caller's
agreement equals ours: a handshake compares field by field, and every
FetchKV, Release and AttachPool carries the agreement's fingerprint again; a
caller also names the prefill daemon's start and the request's capability.
FetchKV sends each chunk once its layers are written (the prefill may still
run): the span and the chunks come from ``fetchplan.py``, the ranges sent with
``descriptors`` (and ``nixl``'s staging lease) from ``descriptor_ranges.py``.
Starting a server with this servicer is ``server.py``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.status import (
    CONTRACT_METADATA_KEY,
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES_LIMIT,
    Refusal,
    refusals,
)
from lanekv.transfer.nixl.agent import NixlUnavailable
from lanekv.transfer.nixl.export import NixlExport
from lanekv.transfer.nixl.staging import Lease
from lanekv.transfer.protocol.contract import agreement_of
from lanekv.transfer.protocol.descriptors import MAX_TRANSPORTS, host_id
from lanekv.transfer.protocol.fielddiff import diff, format_diff
from lanekv.transfer.protocol.wire import ChunkHeader, encode_chunk, frame_chunk, kv_dtype
from lanekv.transfer.rank.admission import Admission, key_message
from lanekv.transfer.rank.descriptor_ranges import Ready, descriptor_ranges, stage_lease
from lanekv.transfer.rank.fetchplan import (
    FetchSpan,
    check_payload,
    heads_of,
    one_ahead,
    page_bytes,
    plan_of,
    span_of,
)
from lanekv.transfer.rank.progress import PrefillFailed
from lanekv.transfer.rank.sources import PageSource
from lanekv.transfer.rank.staging import RankStaging

Code = grpc.StatusCode
# The longest a FetchKV waits for one layer of a prefill that is still running
# (less when the call's deadline comes first).
LAYER_WAIT_S = 600.0
# Called when a FetchKV stream has sent its last chunk: (request_id, payload bytes, seconds).
OnFetched = Callable[[str, int, float], None]


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
        self._layer_wait_s = layer_wait_s
        self._nixl = nixl  # the pool offered over NIXL (NixlAttach), or None
        self._relay_staging = relay_staging  # the staged relays' files (StageKV), or None
        self._admission = Admission(source, epoch, relay_staging)

    def Handshake(self, request, context):
        with refusals(context):
            try:
                theirs = agreement_of(request.contract)
            except (ValueError, TypeError) as err:
                raise Refusal(Code.INVALID_ARGUMENT, f"undecodable contract: {err}") from err
            contract = self._admission.contract()
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
            agreement = self._admission.agreed(request.request_id, request.fingerprint)
            self._admission.same_start(context, request.request_id)
            heads = heads_of(request, agreement)
            if request.nixl:
                self._check_nixl(request)
            elif request.descriptors:
                self._admission.check_attached(context)
            span = span_of(request, agreement, dict(self._admission.owned(request.request_id)), self._source.rank)
            chunks = [] if request.descriptors else plan_of(request, agreement, span, self._default_chunk_bytes,
                                                            self._max_chunk_bytes)
            rid, sent_bytes = request.request_id, 0
            staged = None
            if request.nixl and heads is not None:  # the lease is released when the call ends
                staged = stage_lease(self._nixl, self._source.rank, context, span.nbytes(agreement, heads))

            def alive() -> bool:
                return context.is_active() and self._admission.holds(rid)

            def ready(layer_end: int, exact: bool = False) -> tuple[int, Any]:
                return self._ready(context, rid, layer_end, alive, exact)

            if request.descriptors:
                try:
                    yield from self._descriptors(rid, span, ready, exact=request.nixl, heads=heads,
                                                 lease=None if staged is None else staged.lease)
                except BaseException:
                    if staged is not None:
                        staged.lease.release()
                    raise
                sent_bytes = span.nbytes(agreement, heads)
            else:
                def message(seq: int) -> tuple[bytes, int]:
                    chunk, physical = chunks[seq]
                    # The event of the chunk's own last layer: a read waits for no later layer.
                    _, after = ready(chunk.layer_end, exact=True)
                    payload = self._source.read(physical, chunk.layer_start, chunk.layer_end, after)
                    # A release racing this fetch may have recycled the pages under
                    # the read; checking after it proves they were held throughout.
                    self._admission.owned(rid)
                    check_payload(payload, chunk, agreement)
                    if heads is not None:  # a TP decode rank's KV heads: the checksum covers only them
                        payload = payload[:, :, :, heads]
                    header, data = encode_chunk(rid, self._source.rank, seq, chunk.layer_start, chunk.pages, payload)
                    return self.frame(header, data), header.nbytes

                for framed, nbytes in one_ahead(message, len(chunks)):
                    yield framed
                    sent_bytes += nbytes
            if self._on_fetched is not None:
                self._on_fetched(rid, sent_bytes, time.perf_counter() - start)
            if staged is not None:  # the caller reads the last range now: held until it ends the call
                staged.hold(context)

    def _ready(self, context: grpc.ServicerContext, rid: str, layer_end: int, alive: Callable[[], bool],
               exact: bool = False) -> tuple[int, Any]:
        """Wait until layers < layer_end are written (the prefill may still run)."""
        left = context.time_remaining()
        wait_s = self._layer_wait_s if left is None else min(left, self._layer_wait_s)
        try:
            return self._source.ready(rid, layer_end, wait_s, alive, exact=exact)
        except KeyError as err:
            raise Refusal(Code.NOT_FOUND, key_message(rid, err)) from err
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
            agreement, rid = self._admission.contract().agreement, request.request_id
            owned = dict(self._admission.owned(rid))
            if not 0 <= request.layer_start < request.layer_end <= agreement.num_layers:
                raise Refusal(Code.INVALID_ARGUMENT, f"layer range [{request.layer_start}, {request.layer_end}) "
                              f"is not within [0, {agreement.num_layers})")
            pages = list(request.pages)
            foreign = [page for page in pages if page not in owned]
            if not pages or foreign or len(set(pages)) != len(pages):
                raise Refusal(Code.INVALID_ARGUMENT, f"pages {pages[:16]} are not distinct pages of request "
                              f"{rid!r:.80} on rank {self._source.rank}")
            layers = request.layer_end - request.layer_start
            nbytes = len(pages) * layers * page_bytes(agreement)
            if nbytes > slot.numel():
                raise Refusal(Code.INVALID_ARGUMENT, f"{nbytes} bytes do not fit a slot of {slot.numel()}")
            _, after = self._ready(context, rid, request.layer_end,
                                   lambda: context.is_active() and self._admission.holds(rid), exact=True)
            shape = (layers, agreement.kv_planes, len(pages) * agreement.page_size, agreement.num_kv_heads,
                     agreement.head_dim)
            out = slot[:nbytes].view(kv_dtype(agreement.kv_dtype)).view(shape)
            sealed = self._source.read_into([owned[page] for page in pages], request.layer_start,
                                            request.layer_end, after, out)
            self._admission.owned(rid)  # held throughout the read: the pages were not recycled under it
            self._relay_staging.staged(slot, nbytes, rid)
        return lanekv_pb2.StageReply(nbytes=nbytes, seal=sealed)

    def _descriptors(self, rid: str, span: FetchSpan, ready: Ready, exact: bool = False,
                     heads: slice | None = None, lease: Lease | None = None) -> Iterator[bytes]:
        """``descriptor_ranges`` of this rank's pages; with ``lease`` (NIXL and ``heads``)
        each sealed range's heads are packed there first."""
        nixl = self._nixl

        def stage(layer_start: int, layer_end: int) -> int:
            page_size = self._admission.contract().agreement.page_size
            return nixl.stage(lease, span.physical, page_size, layer_start, layer_end, span.layer_start, heads)

        packs = lease is not None and heads is not None and nixl is not None
        yield from descriptor_ranges(self._source, rid, span, ready, lambda: self._admission.owned(rid),
                                     exact=exact, heads=heads, stage=stage if packs else None)

    def AttachPool(self, request, context):
        with refusals(context):
            self._admission.agreed("attach", request.fingerprint)
            self._admission.same_start(context)
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
            self._admission.attach(context)
        return lanekv_pb2.AttachReply(handle=handle.encode())

    def NixlAttach(self, request, context):
        with refusals(context):
            self._admission.agreed("attach", request.fingerprint)
            self._admission.same_start(context)
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
            self._admission.agreed(request.request_id, request.fingerprint)
            self._admission.same_start(context, request.request_id)
            try:
                freed = self._source.release(request.request_id)
            except KeyError as err:
                raise Refusal(Code.NOT_FOUND, key_message(request.request_id, err)) from err
        return lanekv_pb2.ReleaseReply(pages_freed=freed)

    def frame(self, header: ChunkHeader, data: memoryview) -> bytes:
        """The serialized KVChunk of one chunk (the last step before the bytes leave)."""
        return frame_chunk(header.encode(), data)
