"""One fast-path fetch of one rank (``RankFetch``): its state, and a method per event.

``FastPath.fetch`` (``transfer.fastpath.client``) makes one per call and runs
it. The events, in order: the rank's FetchKV goes out (``call``); while its
round trip runs, where the asked pages go here and their digest are made, and
with ``RankPages.expect`` every layer is copied early (``prepare``); then each
message of the stream either announces a range (``announce``: copied now, or
with the last range) or seals the one announced (``seal``); the stream's end
(``finish``); the digests compared and the caller told (``verify``).

Invariants: a range is announced, then sealed by the next message with the
same pages, places and layers plus the rank's digest; the last range names
the last layer; nothing follows it. Every copy queued is waited for before a
failure leaves (``_settled``): the caller frees its pages after one.
"""

from __future__ import annotations

import contextlib
import logging
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
from lanekv.transfer.fastpath.tuning import FastPathTuning
from lanekv.transfer.grpcfetch.client import FETCH_METHOD, KVClient
from lanekv.transfer.protocol.access import epoch_metadata
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.descriptors import Descriptor, as_u64

log = logging.getLogger("lanekv.transfer")
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


class FastRequest(NamedTuple):
    """What the fetches of every rank of one request share."""

    request_id: str
    fingerprint: str
    dst_pool: torch.Tensor  # the caller's pool, where the pages go
    pages_for: PagesFor
    on_copied: OnCopied
    epoch: str | None  # the access ticket sent to the rank (None: none)
    deadline: float  # time.monotonic() by which the fetch ends
    # A tensor-parallel decode rank's KV heads of each row, (first, count): only they are
    # copied (a strided copy over the head dim) and digested; ``dst_pool`` holds only them.
    # None: whole rows.
    heads: tuple[int, int] | None = None


class RankPages(NamedTuple):
    """One rank's part of a request: its pool mapped here (``FastPath.pool``) and the
    logical pages it owns. ``expect``: where those pages are in its pool
    (``Topology.physical_of``), given when every layer of them is written (the
    prefill answered): they are then copied from there before the rank's
    announcement, which must name the same places, else they are copied again
    from where it says. The rank's digest checks the bytes either way."""

    rank: int
    endpoint: str
    src: torch.Tensor
    pages: tuple[int, ...]
    expect: tuple[int, ...] | None = None


class _Range(NamedTuple):
    """A sealed range, where its pages went here, the digest of what was copied (device),
    and the runs of consecutive pages it was copied in."""

    descriptor: Descriptor
    dst: list[int]
    digest: torch.Tensor
    runs: int


class _Copied(NamedTuple):
    digest: torch.Tensor  # of what was copied, on the destination's device
    runs: int


class _Placed(NamedTuple):
    """A range and where its pages go here."""

    descriptor: Descriptor
    dst: list[int]


class RankFetch:
    """One rank's fetch: the layers of ``part.pages`` copied from ``part.src`` into
    ``request.dst_pool``, each range checked against the rank's digest.

    ``order``: the copy order of the ranks fetched at once (``CopyOrder``);
    ``copy_at_end``: copy every range once the last one is announced (else each
    as it is announced); ``stream_set``: the rank's side streams, asked for once
    the call is out. ``on_call`` gets the call (the caller may cancel it).
    Bad ``part.expect`` is a ``ValueError`` here, before any call.
    """

    def __init__(self, kv: KVClient, agreement: Agreement, request: FastRequest, part: RankPages, *,
                 order: CopyOrder, tuning: FastPathTuning, copy_at_end: bool,
                 stream_set: Callable[[], StreamSet], on_call: Callable[[Any], None] | None = None) -> None:
        part = part._replace(pages=tuple(part.pages), expect=None if part.expect is None else tuple(part.expect),
                             src=_heads_of(part.src, request.heads, request.dst_pool))
        self.request, self.part = request, part
        self._kv, self._order, self._tuning = kv, order, tuning
        self._copy_at_end, self._stream_set, self._on_call = copy_at_end, stream_set, on_call
        self._page_size, self._num_layers = agreement.page_size, agreement.num_layers
        self._asked = set(part.pages)
        self._guess = None if part.expect is None else self._expected(part.expect)
        # The state of the events.
        self.early: tuple[Descriptor, _Copied] | None = None  # copied before the first message, not matched yet
        self._calls: list[Any] = []
        self._announced: _Placed | None = None  # announced, not sealed yet
        self._todo: list[_Placed] = []  # announced, not copied yet
        self._sealed: list[_Placed] = []
        self._copied: dict[int, _Copied] = {}  # by seq, once copied
        self._ready: Prepared | None = None  # made by prepare
        self._streams: Streams | None = None  # while the copies may run
        self._times: dict[str, float] = {}  # "first" message, last copies "issued", "called"

    def run(self) -> FastStats:
        """Every event in order; the fetch's figures. Raises ``RemoteError`` (the rank's
        status; a stuck connection is replaced first), ``CorruptChunk`` (a stream
        out of order) or ``DigestMismatch``; no copy is running then."""
        start = time.perf_counter()
        endpoint, direct = self.part.endpoint, self._tuning.direct_descriptors
        channel = self._kv.channel(endpoint, direct=direct)
        try:
            call = self.call(channel)  # its round trip runs while this prepares (and copies early)
            src, dst = self.part.src.device, self.request.dst_pool.device
            with streams_for(src, dst, self._stream_set()) as streams, _settled(streams):
                self.prepare(streams)
                received = self.receive(call)
                self._order.all_queued(self._left())
                received_s = time.perf_counter() - start
                with streams.digesting():
                    got = [as_u64(t) for t in torch.stack([r.digest for r in received]).cpu()]
                streams.sync()
                copied_s = time.perf_counter() - start
            self.finish(call, len(received))
        except RemoteError as err:
            if err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._kv.reconnect(endpoint, channel, direct=direct)  # the connection may be stuck
            raise
        finally:
            for sent in self._calls:
                sent.cancel()
        self.verify(received, got)
        return self._stats(start, received, received_s, copied_s)

    def call(self, channel: grpc.Channel) -> Any:
        """Send the rank's FetchKV for descriptors of every layer of the pages."""
        request, part = self.request, self.part
        message = lanekv_pb2.FetchRequest(request_id=request.request_id, fingerprint=request.fingerprint,
                                          layer_start=0, layer_end=self._num_layers, pages=list(part.pages),
                                          descriptors=True)
        if request.heads is not None:  # the rank digests only these heads of each row
            message.head_start, message.head_count = request.heads
        stream = channel.unary_stream(
            FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
            response_deserializer=lanekv_pb2.KVChunk.FromString)
        call = stream(message, timeout=max(0.001, self._left()), metadata=epoch_metadata(request.epoch))
        self._calls.append(call)
        self._times["called"] = time.perf_counter()
        if self._on_call is not None:
            self._on_call(call)
        return call

    def prepare(self, streams: Streams) -> None:
        """While the call goes out: where the asked pages go here and a digest of them over
        every layer that each range adds its layers to (made after early copies);
        with ``expect``, every layer copied from there now (``early``)."""
        order, rank, part, request = self._order, self.part.rank, self.part, self.request
        self._streams = streams
        if self._tuning.prepare_in_order:
            order.may_prepare(rank, self._left())
        ready = self._ready = Prepared(part.pages, request.pages_for(part.pages), request.dst_pool,
                                       self._page_size, self._num_layers, streams)
        if self._guess is None:
            ready.make()
        else:
            order.turn(rank, self._left())
            self.early = (self._guess, self._copy(self._guess, ready.dst))
            self._times["issued"] = time.perf_counter()
            order.done(rank)
        order.prepared(rank)

    def receive(self, call: Any) -> list[_Range]:
        """The stream's ranges up to the last layer's, each announced then sealed, checked.
        A stream that ends before the last layer's range is a ``CorruptChunk``; its
        status is read later (``finish``), after the copies."""
        try:
            for message in call:
                self._times.setdefault("first", time.perf_counter())
                if self._announced is None:
                    self.announce(message.header)
                elif self.seal(message.header):
                    return [_Range(d, dst, *self._copied[d.seq]) for d, dst in self._sealed]
        except grpc.RpcError as err:
            raise RemoteError(self.part.rank, self.part.endpoint, err.code(), err.details() or "") from err
        layer = self._sealed[-1].descriptor.layer_end if self._sealed else 0
        raise CorruptChunk(self.request.request_id, self.part.rank, len(self._sealed),
                           f"was not sent: the stream ended after layer {layer} of {self._num_layers}")

    def announce(self, header: bytes) -> None:
        """A range announced: checked, then matched to the early copy (which stands for it
        when the same, else is dropped and the range copied again), or queued to copy.
        Copies start at an announcement: of each range (``copy_at_end`` False), or of
        every range at the last one's, whose copies wait for the rank's turn."""
        seq, ready = len(self._sealed), self._ready
        try:
            d = Descriptor.decode(header)
        except ValueError as err:
            raise CorruptChunk(self.request.request_id, self.part.rank, seq, f"has a bad descriptor: {err}") from err
        bad = "is sealed before it was announced" if d.digest is not None else self._mismatch(d, seq)
        if bad:
            raise CorruptChunk(self.request.request_id, self.part.rank, seq, bad)
        self._announced = _Placed(d, ready.dst if d.pages == ready.pages else self.request.pages_for(d.pages))
        if self.early is not None:
            (guess, made), self.early = self.early, None
            if d == guess:
                self._copied[d.seq] = made
                return
            log.info("fast path: rank %d announced %s, not the places copied early; copying again",
                     self.part.rank, _what(d))
            ready.discard()  # the ranges copied again add up in a digest of their own
        self._todo.append(self._announced)
        last = d.layer_end == self._num_layers
        if not self._copy_at_end or last:
            self._copy_announced(last)

    def seal(self, header: bytes) -> bool:
        """The announced range sealed with the rank's digest; whether it was the last."""
        d = self._announced.descriptor.sealed_by(header)
        if d is None:
            raise CorruptChunk(self.request.request_id, self.part.rank, len(self._sealed),
                               "does not seal the range announced before it")
        self._sealed.append(_Placed(d, self._announced.dst))
        self._announced = None
        return d.layer_end == self._num_layers

    def finish(self, call: Any, seq: int) -> None:
        """The stream's end: its status, and nothing after the last layer's range."""
        try:
            for _ in call:
                raise CorruptChunk(self.request.request_id, self.part.rank, seq,
                                   "came after the descriptor of the last layer")
        except grpc.RpcError as err:
            raise RemoteError(self.part.rank, self.part.endpoint, err.code(), err.details() or "") from err

    def verify(self, received: Sequence[_Range], got: Sequence[int]) -> None:
        """Each range's digest of what was copied against the rank's (``DigestMismatch``);
        then the caller is told of every range."""
        for r, value in zip(received, got):
            if value != r.descriptor.digest:
                raise DigestMismatch(self.request.request_id, self.part.rank, r.descriptor.seq,
                                     "was copied from the shared pool but does not match the rank's digest")
        for r in received:
            self.request.on_copied(r.descriptor.pages, r.descriptor.layer_start, r.descriptor.layer_end)

    def _copy_announced(self, last: bool) -> None:
        if last:
            self._order.turn(self.part.rank, self._left())
        for d, dst in self._todo:
            self._copied[d.seq] = self._copy(d, dst)
        self._todo.clear()
        self._times["issued"] = time.perf_counter()
        if last:
            self._order.done(self.part.rank)

    def _copy(self, d: Descriptor, dst: list[int]) -> _Copied:
        return _Copied(*copy_range(self.part.src, d, dst, self.request.dst_pool, self._streams, self._ready,
                                   self._page_size, self._tuning.copy))

    def _stats(self, start: float, received: Sequence[_Range], received_s: float, copied_s: float) -> FastStats:
        src = self.part.src
        page_layer_bytes = src.shape[1] * self._page_size * src.shape[3] * src.shape[4] * src.element_size()
        d = [r.descriptor for r in received]
        nbytes = sum(len(r.pages) * (r.layer_end - r.layer_start) for r in d) * page_layer_bytes
        runs = max((r.runs for r in received), default=0)
        seconds = time.perf_counter() - start
        return FastStats(nbytes, len(received), seconds, received_s, copied_s - received_s, runs,
                         *(self._times.get(step, start) - start for step in ("first", "issued", "called")))

    def _left(self) -> float:
        return self.request.deadline - time.monotonic()

    def _expected(self, expect: Sequence[int]) -> Descriptor:
        """Every layer of the pages at the places ``expect`` names, checked as a descriptor is."""
        pages = self.part.pages
        if not pages or len(expect) != len(pages):
            raise ValueError(f"expect names {len(expect)} places for {len(pages)} pages")
        guess = Descriptor(self.request.request_id, self.part.rank, 0, 0, self._num_layers, tuple(pages),
                           tuple(expect), None)
        bad = self._mismatch(guess, 0)
        if bad:
            raise ValueError(f"expect {bad}")
        return guess

    def _mismatch(self, d: Descriptor, seq: int) -> str:
        """Why a descriptor is not one this fetch can use ('' when it is)."""
        request_id, rank, num_layers = self.request.request_id, self.part.rank, self._num_layers
        src_pages = self.part.src.shape[2] // self._page_size
        if d.request_id != request_id or d.rank != rank or d.seq != seq:
            return f"is {d.request_id!r} rank {d.rank} seq {d.seq}"
        if d.layer_end > num_layers:
            return f"names layers up to {d.layer_end} of {num_layers}"
        if not self._asked.issuperset(d.pages):
            return f"names pages {[p for p in d.pages if p not in self._asked][:8]} that were not asked for"
        outside = [p for p in d.physical if not 0 <= p < src_pages]
        if outside:
            return f"names physical pages {outside[:8]} outside the shared pool of {src_pages}"
        if len(set(d.pages)) != len(d.pages):
            return "names a page twice"
        if len(set(d.physical)) != len(d.physical):
            return "names a place twice in the shared pool"
        return ""


def _heads_of(src: torch.Tensor, heads: tuple[int, int] | None, dst_pool: torch.Tensor) -> torch.Tensor:
    """The part of the rank's pool ``[layers, planes, rows, kv_heads, head_dim]`` that is
    copied: every head, or a view of heads ``[first, first + count)`` (strided over the
    head dim; the copies move only those bytes of each row). ``ValueError`` naming
    the heads when they are not within the rows or ``dst_pool`` does not hold that many."""
    if heads is None:
        return src
    first, count = heads
    if not (count >= 1 and 0 <= first and first + count <= src.shape[3]) or dst_pool.shape[3] != count:
        raise ValueError(f"heads (first={first}, count={count}) are not within the {src.shape[3]} KV heads of "
                         f"the rank's rows, or the pool here holds {dst_pool.shape[3]} heads, not {count}")
    return src[:, :, :, first:first + count]


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


def _what(d: Descriptor) -> str:
    return f"layers [{d.layer_start}, {d.layer_end}) of {len(d.pages)} pages"
