"""The decode side of KV transfer: handshake, concurrent fetch from every owner rank, release.

``fetch`` opens one stream per owner rank, each received by its own thread
(``transfer.grpcfetch.fetch.RankFetch``, or a receiver process) that decodes
and verifies every chunk (header checks, XXH3-64). Verified chunks are placed
by one thread per owner rank (``transfer.grpcfetch.placers``; up to
``MAX_PLACERS``, the fetch's own thread for one rank), so ``place`` is called
concurrently, each call with cells (layer, page) no other call has: it must
be safe to call from several threads. A byte budget bounds what has been
received but not yet placed; a receiver that would exceed it stops reading,
and gRPC flow control then holds the server back.

Under a ``RetryPolicy`` with more than one attempt, a rank's stream that
breaks, stalls or delivers a damaged chunk is asked again for only the cells
(layer, page) not yet received, so every cell is placed once (a caller that
names neither the pages nor the layer end may see a cell twice after a
retry: the same verified bytes). The default, ``NO_RETRY``, fails at the
first error; a stalled stream is cut after ``stall_s`` either way.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch
from grpc.experimental import ChannelOptions
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.security import SecurityConfig, open_channel
from lanekv.runtime.status import CONTRACT_METADATA_KEY, grpc_options
from lanekv.transfer.errors import (
    ChecksumError,
    ContractMismatch,
    CorruptChunk,
    RemoteError,
    TransferError,
)
from lanekv.transfer.grpcfetch.fetch import NO_RETRY, ByteBudget, Item, Job, RankFetch, RetryPolicy
from lanekv.transfer.grpcfetch.layerwise import check_streams, split_span
from lanekv.transfer.grpcfetch.placers import MAX_PLACERS, Placers
from lanekv.transfer.grpcfetch.receivers import ReceiverPool
from lanekv.transfer.grpcfetch.remotefetch import RemoteRankFetch
from lanekv.transfer.grpcfetch.spans import Span
from lanekv.transfer.protocol.access import epoch_metadata
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract
from lanekv.transfer.protocol.fielddiff import FieldDiff, diff
from lanekv.transfer.protocol.stats import FetchStats, RankStats
from lanekv.transfer.protocol.wire import ChunkHeader

__all__ = [
    "NO_RETRY",
    "ChecksumError",
    "ContractMismatch",
    "CorruptChunk",
    "KVClient",
    "RemoteError",
    "RetryPolicy",
    "TransferError",
    "channel_options",
    "fetch_kv",
    "handshake",
    "release",
]

FETCH_METHOD = "/lanekv.v1.KVTransfer/FetchKV"
Place = Callable[[ChunkHeader, torch.Tensor], None]
# Channels replaced after a broken or stalled stream stay open (calls of other
# requests may still run on them) until this many newer ones pile up.
MAX_RETIRED_CHANNELS = 8
DIRECT_READ_OPTION = ChannelOptions.SingleThreadedUnaryStream


def channel_options() -> list[tuple[str, int]]:
    """Options of every channel a daemon opens to a peer.

    gRPC waits 1 s after a failed connection and grows the wait up to 120 s,
    failing every call meanwhile: a peer that was down for a minute would stay
    unreachable long after it came back. Capped at 2 s here. Each channel keeps
    its own connections: gRPC otherwise shares one connection among channels
    to the same target, and a new channel after a frozen connection would get
    the frozen one again.
    """
    return [
        *grpc_options(),
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


class KVClient:
    """Channels to transfer servers, opened once per endpoint and reused by every call.

    ``security`` says how every channel speaks: TLS, a client certificate and
    the token (``runtime.security``); None: plaintext without a token.
    ``retry`` is the default policy of ``fetch``. ``receivers``: how many
    processes receive owner ranks' streams outside this process's GIL
    (``transfer.grpcfetch.receivers``; 0: every stream in a thread here; closed with
    the client), or a ``ReceiverPool`` that the caller made and closes (its
    processes speak with the security they were made with).
    """

    def __init__(self, security: SecurityConfig | None = None, retry: RetryPolicy = NO_RETRY,
                 receivers: int | ReceiverPool = 0) -> None:
        self.security = SecurityConfig() if security is None else security
        self.retry = retry
        self._own_receivers = not isinstance(receivers, ReceiverPool)
        if not self._own_receivers:
            self.receivers: ReceiverPool | None = receivers
        elif isinstance(receivers, bool) or not isinstance(receivers, int) or receivers < 0:
            raise ValueError(f"receivers must be an integer >= 0 or a ReceiverPool, got receivers={receivers!r}")
        else:
            self.receivers = ReceiverPool(receivers, self.security) if receivers else None
        self._channels: dict[tuple[str, int], grpc.Channel] = {}  # (endpoint, lane)
        self._direct: dict[tuple[str, int], grpc.Channel] = {}  # see channel(direct=True)
        self._retired: deque[grpc.Channel] = deque()
        self._closed = False
        self._lock = threading.Lock()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels = [*self._channels.values(), *self._direct.values(), *self._retired]
            self._channels, self._direct = {}, {}
            self._retired.clear()
        for channel in channels:
            channel.close()
        if self.receivers is not None and self._own_receivers:
            self.receivers.close()

    def channel(self, endpoint: str, *, direct: bool = False, lane: int = 0) -> grpc.Channel:
        """The channel to ``endpoint``; ``direct``: a second one, on a connection of its own,
        whose server-streaming calls are read by the calling thread itself (gRPC's
        single-threaded unary-stream mode: no hand-over through the channel's polling
        thread, and no Python work for a message nobody reads yet). For short streams
        whose latency counts, the fast path's descriptors: they never queue behind
        chunks of the bulk connection. ``lane``: the i-th stream of a rank's fetch
        (``transfer.grpcfetch.layerwise``) gets a connection of its own, so several
        streams of one rank are not one TCP connection's flow-control window and
        polling thread."""
        with self._lock:
            self._check_open()
            channels = self._direct if direct else self._channels
            if (endpoint, lane) not in channels:
                channels[endpoint, lane] = self._open(endpoint, direct)
            return channels[endpoint, lane]

    def reconnect(self, endpoint: str, stale: grpc.Channel | None, *, direct: bool = False,
                  lane: int = 0) -> grpc.Channel:
        """A channel on a new connection in place of ``stale`` (unless another call replaced it already)."""
        closing = []
        with self._lock:
            self._check_open()
            channels = self._direct if direct else self._channels
            current = channels.get((endpoint, lane))
            if current is None or current is stale:
                if current is not None:
                    self._retired.append(current)
                    while len(self._retired) > MAX_RETIRED_CHANNELS:
                        closing.append(self._retired.popleft())
                current = channels[endpoint, lane] = self._open(endpoint, direct)
        for channel in closing:
            channel.close()
        return current

    def _open(self, endpoint: str, direct: bool) -> grpc.Channel:
        return open_channel(endpoint, self.security, channel_options() + ([(DIRECT_READ_OPTION, 1)] if direct else []))

    def _check_open(self) -> None:
        # A retry must not open a channel that nobody would close.
        if self._closed:
            raise TransferError("the KV client is closed")

    def stub(self, endpoint: str) -> lanekv_pb2_grpc.KVTransferStub:
        return lanekv_pb2_grpc.KVTransferStub(self.channel(endpoint))

    def handshake(
        self, endpoint: str, contract: Agreement | LayoutContract, timeout: float
    ) -> LayoutContract:
        """Send our agreement; return the server's contract (agreement + topology)."""
        ours = contract.agreement if isinstance(contract, LayoutContract) else contract
        request = lanekv_pb2.HandshakeRequest(contract=ours.encode())
        try:
            reply = self.stub(endpoint).Handshake(request, timeout=timeout)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise ContractMismatch(
                    _diffs_from(ours, err), f"{endpoint}: {err.details()}"
                ) from err
            raise RemoteError(None, endpoint, err.code(), err.details() or "") from err
        try:
            theirs = LayoutContract.decode(reply.contract)
        except ValueError as err:
            raise TransferError(
                f"{endpoint} answered the handshake with a bad contract: {err}"
            ) from err
        # The server said yes; refuse anyway if its contract or fingerprint says otherwise.
        if theirs.agreement != ours or reply.fingerprint != ours.fingerprint:
            diffs = diff(ours, theirs.agreement)
            raise ContractMismatch(
                diffs, f"{endpoint} accepted a contract that differs from its own"
            )
        return theirs

    def fetch(
        self,
        endpoints: Mapping[int, str],
        request_id: str,
        fingerprint: str,
        place: Place,
        *,
        max_inflight_bytes: int = 256 << 20,
        max_chunk_bytes: int = 0,
        timeout: float = 60.0,
        layer_start: int = 0,
        layer_end: int | None = None,
        pages: Mapping[int, Sequence[int]] | None = None,
        epoch: str | None = None,
        retry: RetryPolicy | None = None,
        streams_per_rank: int = 1,
        heads: tuple[int, int] | None = None,
        relays: Mapping[int, Sequence[str]] | None = None,
    ) -> FetchStats:
        """Fetch a request's KV from every owner rank at once; ``place`` each verified chunk.

        ``pages`` optionally names the logical pages to fetch per rank (all
        the rank holds by default); ``max_chunk_bytes`` 0 lets servers choose;
        ``epoch`` is the prefill daemon start that pinned the pages (servers of
        another start refuse); ``retry`` overrides the client's policy;
        ``streams_per_rank`` cuts each rank's named pages into that many streams
        (``transfer.grpcfetch.layerwise``; each with its own retries);
        ``heads``: (first KV head, count) of each row, a TP decode rank's slice
        (its chunks hold those heads only; fetched in this process's threads).
        ``relays``: each rank's sender relays (``transfer.rank.relay``): the rank's
        i-th stream goes to relay ``i % len``, and back to the rank's own endpoint
        if it fails in a way a retry may cure (a head range always goes to the rank).
        ``place`` runs in one thread per owner rank (up to ``MAX_PLACERS``) and
        must be safe to call concurrently (``transfer.grpcfetch.placers``).
        Raises ``CorruptChunk`` (``ChecksumError``), ``RemoteError`` or
        ``TransferError``; on any error every stream is cancelled and no later
        chunk is placed.
        """
        start = time.perf_counter()
        check_streams(streams_per_rank)
        policy = self.retry if retry is None else retry
        budget = ByteBudget(max_inflight_bytes)
        job = Job(request_id, fingerprint, max_chunk_bytes, policy, timeout,
                  self.stream_opener(epoch), budget)
        job.heads = heads
        parts: list[RankFetch | RemoteRankFetch] = []  # a rank's streams, one part each
        threads: list[threading.Thread] = []
        try:
            for rank, endpoint in endpoints.items():
                spans = split_span(Span(layer_start, layer_end, _pages_of(pages, rank)), streams_per_rank)
                relayed = () if heads is not None or not relays else tuple(relays.get(rank, ()))
                for lane, span in enumerate(spans):
                    via = relayed[lane % len(relayed)] if relayed else endpoint
                    parts.append(self._rank_fetch(job, rank, via, span, epoch, lane,
                                                  fallback=endpoint if relayed else None))
            for i, part in enumerate(parts):
                threads.append(threading.Thread(target=part.run, name=f"fetch-rank{part.rank}-{i}", daemon=True))
                threads[-1].start()
        except BaseException:
            _end(job, budget, None, parts, threads)
            raise
        per_rank = {rank: RankStats(0, 0, 0.0) for rank in endpoints}
        lock = threading.Lock()

        def placed(item: Item) -> None:
            with lock:
                stats = per_rank[item.rank]
                per_rank[item.rank] = RankStats(
                    stats.bytes + item.header.nbytes, stats.chunks + 1, time.perf_counter() - start
                )

        placers = Placers(job, place, budget.release, placed, min(len(parts), MAX_PLACERS))
        pending = Counter(part.rank for part in parts)  # each rank's streams not ended yet
        try:
            while pending:
                item = _next_item(job, parts, pending, endpoints, timeout)
                placers.check()
                if item.error is not None:
                    raise item.error
                if item.rank < 0:  # WAKE: a placement failed (check raised) or ended
                    continue
                if item.header is None:
                    pending[item.rank] -= 1
                    if not pending[item.rank]:
                        del pending[item.rank]
                    continue
                placers.submit(item)
            placers.drain()
        finally:
            _end(job, budget, placers, parts, threads)
        per_rank = {rank: s._replace(retries=sum(p.retries for p in parts if p.rank == rank))
                    for rank, s in per_rank.items()}
        return FetchStats(
            sum(s.bytes for s in per_rank.values()),
            sum(s.chunks for s in per_rank.values()),
            time.perf_counter() - start,
            per_rank,
            sum(s.retries for s in per_rank.values()),
        )

    def _rank_fetch(self, job: Job, rank: int, endpoint: str, span: Span, epoch: str | None,
                    lane: int = 0, fallback: str | None = None) -> RankFetch | RemoteRankFetch:
        """A rank's part of a fetch: in an idle receiver process (a connection of its own),
        else in a thread here, on the rank's ``lane``-th connection."""
        # A head range stays in this process: receiver processes fetch whole rows.
        receiver = self.receivers.take() if self.receivers is not None and job.heads is None else None
        if receiver is None:
            return RankFetch(job, rank, endpoint, span, lane=lane, fallback=fallback)
        return RemoteRankFetch(job, rank, endpoint, span, epoch, receiver, self.receivers, fallback=fallback)

    def stream_opener(self, epoch: str | None) -> Callable[..., Any]:
        """``open_stream`` of one fetch: a retry after a broken connection gets a new one."""
        metadata = epoch_metadata(epoch)
        used: dict[tuple[str, int], grpc.Channel] = {}

        def open_stream(endpoint: str, request: lanekv_pb2.FetchRequest, timeout: float, fresh: bool,
                        lane: int = 0) -> Any:
            key = (endpoint, lane)
            channel = self.reconnect(endpoint, used.get(key), lane=lane) if fresh else self.channel(endpoint, lane=lane)
            used[key] = channel
            # Messages come back as raw bytes, split by wire.split_chunk into views:
            # the payload is never copied out of the received message.
            call = channel.unary_stream(
                FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString
            )
            return call(request, timeout=timeout, metadata=metadata)

        return open_stream

    def release(
        self,
        endpoints: Mapping[int, str],
        request_id: str,
        fingerprint: str,
        timeout: float = 10.0,
        *,
        epoch: str | None = None,
    ) -> int:
        """Release the request on every owner rank; return the pages freed in all."""
        freed = 0
        request = lanekv_pb2.ReleaseRequest(request_id=request_id, fingerprint=fingerprint)
        metadata = epoch_metadata(epoch)
        for rank, endpoint in endpoints.items():
            try:
                freed += self.stub(endpoint).Release(request, timeout=timeout, metadata=metadata).pages_freed
            except grpc.RpcError as err:
                raise RemoteError(rank, endpoint, err.code(), err.details() or "") from err
        return freed


def _pages_of(pages: Mapping[int, Sequence[int]] | None, rank: int) -> tuple[int, ...] | None:
    """The pages asked of ``rank``; None (every page it holds) when not named."""
    named = tuple(pages.get(rank, ())) if pages else ()
    return named or None


def _end(job: Job, budget: ByteBudget, placers: Placers | None, parts: Sequence[RankFetch | RemoteRankFetch],
         threads: Sequence[threading.Thread]) -> None:
    """End a fetch: no more placing (the placements under way finish), every rank's part
    stopped and its thread joined, then its receiver handed back (its slots unread now)."""
    job.stopping.set()
    budget.close()
    if placers is not None:
        placers.close()
    for part in parts:
        part.cancel()
    for thread in threads:
        thread.join(timeout=10.0)
    for part in parts:
        part.close()


def _next_item(job: Job, parts: Sequence[RankFetch | RemoteRankFetch], pending: Mapping[int, int],
               endpoints: Mapping[int, str], timeout: float) -> Item:
    """The next item from the ranks' threads; meanwhile cut streams that stalled."""
    tick = min(0.25, job.policy.stall_s / 4)
    while True:
        now = time.monotonic()
        for part in parts:
            part.cut_if_stalled(now)
        # Streams carry the fetch's deadline, so their threads report soon after it.
        if now > job.deadline + 5.0:
            rank = min(pending)
            raise RemoteError(rank, endpoints[rank], grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"ranks {sorted(pending)} did not finish within {timeout:.1f}s")
        try:
            return job.ready.get(timeout=tick)
        except queue.Empty:
            continue


def _diffs_from(ours: Agreement, err: grpc.RpcError) -> list[FieldDiff]:
    """Structured diffs from the server's contract in the trailing metadata (empty if absent)."""
    for key, value in err.trailing_metadata() or ():
        if key == CONTRACT_METADATA_KEY:
            try:
                return diff(ours, LayoutContract.decode(value).agreement)
            except (ValueError, TypeError):
                return []
    return []


def handshake(
    endpoint: str,
    contract: Agreement | LayoutContract,
    timeout: float = 10.0,
    *,
    security: SecurityConfig | None = None,
) -> str:
    """Check our contract against a server's; return the agreed fingerprint or raise ``ContractMismatch``."""
    with KVClient(security) as client:
        return client.handshake(endpoint, contract, timeout).fingerprint


def fetch_kv(
    endpoints: Mapping[int, str],
    request_id: str,
    fingerprint: str,
    place: Place,
    *,
    max_inflight_bytes: int = 256 << 20,
    max_chunk_bytes: int = 0,
    timeout: float = 60.0,
    security: SecurityConfig | None = None,
    retry: RetryPolicy = NO_RETRY,
) -> FetchStats:
    """One-shot ``KVClient.fetch``; a daemon keeps a ``KVClient`` to reuse its channels."""
    with KVClient(security, retry) as client:
        return client.fetch(
            endpoints,
            request_id,
            fingerprint,
            place,
            max_inflight_bytes=max_inflight_bytes,
            max_chunk_bytes=max_chunk_bytes,
            timeout=timeout,
        )


def release(
    endpoints: Mapping[int, str],
    request_id: str,
    fingerprint: str,
    timeout: float = 10.0,
    *,
    security: SecurityConfig | None = None,
) -> int:
    with KVClient(security) as client:
        return client.release(endpoints, request_id, fingerprint, timeout)
