"""A rank's FetchKV with ``descriptors``: ranges of layers announced, then sealed, and NIXL's lease.

With ``descriptors`` a rank sends where the pages are in the pool shared by
AttachPool and their digest, instead of the bytes (``transfer.protocol.descriptors``):
each range goes twice, announced once its layers are written on the device, then
sealed with the digest the rank took while it held the pages. With ``nixl`` and a
head range, each sealed range's heads are packed into a lease of the rank's NIXL
staging region (``transfer.nixl.staging``) and the seal says where; the lease is
held until the caller ends the call (it has read them then), at most
``STAGING_HOLD_S`` after the last range. The servicer (``service.py``) checks the
call before any of this runs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import grpc
from lanekv.proto import lanekv_pb2
from lanekv.runtime.status import Refusal
from lanekv.transfer.nixl.export import NixlExport
from lanekv.transfer.nixl.staging import Lease, StagingFull
from lanekv.transfer.protocol.descriptors import Descriptor
from lanekv.transfer.protocol.wire import frame_chunk
from lanekv.transfer.rank.fetchplan import FetchSpan
from lanekv.transfer.rank.sources import PageSource

Code = grpc.StatusCode
# The longest a staged NIXL FetchKV holds its lease after its last range, waiting for the
# caller to end the call (less when the call's deadline comes first): a caller that read
# later than this reads bytes its digest check refuses.
STAGING_HOLD_S = 60.0
# (layer_end, exact) -> (layers written, a token covering them for the source's reads or
# None): ``PageSource.ready`` for the call's request, waiting while the prefill runs.
Ready = Callable[..., tuple[int, Any]]
# (layer_start, layer_end) -> the offset in the staging lease where those layers' heads now are.
Stage = Callable[[int, int], int]


def descriptor_ranges(source: PageSource, rid: str, span: FetchSpan, ready: Ready, held: Callable[[], object],
                      exact: bool = False, heads: slice | None = None, stage: Stage | None = None) -> Iterator[bytes]:
    """Descriptor chunks (the fast path): each covers every layer written since the
    one before, so a finished prefill goes in one and a running one layer by layer.

    Each range goes twice: announced (no digest) once its layers are written
    on the device, so the caller may start copying them, then sealed with
    the digest the rank took meanwhile (while it held the pages: ``held``
    raises when the request was released under the digest).

    ``exact`` (NIXL, read from another host): a range ends at the last layer whose
    event has completed, not at the last one queued, so the first range goes
    out as soon as its first layer is on the device (layer-wise streaming).

    ``heads`` (a TP decode rank's KV heads): the descriptors are the same, the
    caller copies only those heads of each row, and the digest covers exactly
    them (``PageSource.digest``), the bytes that rank receives. With ``stage``
    (NIXL and ``heads``) they are packed into the call's lease before the seal,
    which says where.
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
        announced = Descriptor(rid, source.rank, seq, layer, upto, span.pages, span.physical, None)
        yield frame_chunk(announced.encode(), memoryview(b""))
        digest = source.digest(span.physical, layer, upto, after, request_id=rid, heads=heads)
        staged = b""
        if stage is not None:
            staged = lanekv_pb2.KVChunk(nixl_staged=stage(layer, upto)).SerializeToString()
        held()  # held while the digest (and the staging) read them
        yield frame_chunk(dataclasses.replace(announced, digest=digest).encode(), memoryview(b"")) + staged
        seq, layer = seq + 1, upto


class StagedLease(NamedTuple):
    """A NIXL FetchKV's lease of the staging region, and the event set when the call ends."""

    lease: Lease
    ended: threading.Event

    def hold(self, context: grpc.ServicerContext) -> None:
        """The caller reads the last range now: hold the lease until it ends the call
        (at most ``STAGING_HOLD_S``, less when the call's deadline comes first), then free it."""
        left = context.time_remaining()
        self.ended.wait(STAGING_HOLD_S if left is None else min(left, STAGING_HOLD_S))
        self.lease.release()


def stage_lease(nixl: NixlExport, rank: int, context: grpc.ServicerContext, nbytes: int) -> StagedLease:
    """A lease of ``nbytes`` of the rank's NIXL staging region for the call's head slice,
    released when the call ends (the event is set then); RESOURCE_EXHAUSTED when it is full."""
    try:
        lease = nixl.lease(nbytes)
    except StagingFull as err:
        raise Refusal(Code.RESOURCE_EXHAUSTED, f"rank {rank}: {err}; fetch fewer layers at "
                      "once or over gRPC") from err
    except (RuntimeError, ValueError) as err:
        raise Refusal(Code.FAILED_PRECONDITION, f"rank {rank}: {err}") from err
    ended = threading.Event()

    def end() -> None:
        lease.release()
        ended.set()

    if not context.add_callback(end):  # the call has ended already
        end()
    return StagedLease(lease, ended)
