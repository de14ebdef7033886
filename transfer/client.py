"""The decode side of KV transfer: handshake, concurrent fetch from every owner rank, release.

``fetch_kv`` opens one stream per owner rank, each drained by its own thread
that decodes and verifies every chunk (header checks, XXH3-64). Verified
chunks queue up for the calling thread, which alone runs ``place``, so a
``place`` that writes a GPU pool needs no locking. A byte budget bounds what
has been received but not yet placed; a receiver that would exceed it stops
reading, and gRPC flow control then holds the server back.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import grpc
import torch

from proto import lanekv_pb2, lanekv_pb2_grpc
from transfer.contract import Agreement, FieldDiff, LayoutContract, diff
from transfer.security import SecurityConfig, open_channel
from transfer.status import CONTRACT_METADATA_KEY
from transfer.wire import ChunkHeader, checksum, payload_to_tensor, split_chunk

FETCH_METHOD = "/lanekv.v1.KVTransfer/FetchKV"
Place = Callable[[ChunkHeader, torch.Tensor], None]


class TransferError(RuntimeError):
    """Base of the errors a transfer raises."""


class ContractMismatch(TransferError):
    """The server refused our contract; ``diffs`` compare ours (client) with theirs (server)."""

    def __init__(self, diffs: list[FieldDiff], message: str) -> None:
        super().__init__(message)
        self.diffs = diffs


class ChecksumError(TransferError):
    def __init__(self, request_id: str, rank: int, seq: int) -> None:
        super().__init__(
            f"request {request_id!r}: chunk {seq} from rank {rank} failed its checksum"
        )
        self.request_id, self.rank, self.seq = request_id, rank, seq


class RemoteError(TransferError):
    """A gRPC status from a transfer server (``rank`` is None for a handshake)."""

    def __init__(
        self, rank: int | None, endpoint: str, code: grpc.StatusCode, details: str
    ) -> None:
        where = endpoint if rank is None else f"rank {rank} ({endpoint})"
        super().__init__(f"{where}: {code.name}: {details}")
        self.rank, self.endpoint, self.code, self.details = rank, endpoint, code, details


class RankStats(NamedTuple):
    bytes: int
    chunks: int
    seconds: float  # from the start of the fetch to this rank's last placed chunk


class FetchStats(NamedTuple):
    bytes: int
    chunks: int
    seconds: float
    per_rank: dict[int, RankStats]


class _ByteBudget:
    """Bytes received but not yet placed; one chunk is always admitted when nothing is held."""

    def __init__(self, limit: int) -> None:
        self._limit, self._used, self._closed = limit, 0, False
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> bool:
        with self._cond:
            while not self._closed and self._used and self._used + nbytes > self._limit:
                self._cond.wait()
            self._used += nbytes
            return not self._closed

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._used -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class _Chunk(NamedTuple):
    rank: int
    header: ChunkHeader | None  # None: the rank's stream ended cleanly
    tensor: torch.Tensor | None
    error: Exception | None


class KVClient:
    """Channels to transfer servers, opened once per endpoint and reused by every call.

    ``security`` says how every channel speaks: TLS, a client certificate and
    the token (``transfer.security``); None: plaintext without a token.
    """

    def __init__(self, security: SecurityConfig | None = None) -> None:
        self.security = SecurityConfig() if security is None else security
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            if endpoint not in self._channels:
                self._channels[endpoint] = open_channel(endpoint, self.security)
            return self._channels[endpoint]

    def stub(self, endpoint: str) -> lanekv_pb2_grpc.KVTransferStub:
        return lanekv_pb2_grpc.KVTransferStub(self.channel(endpoint))

    def _fetch_call(self, endpoint: str) -> grpc.UnaryStreamMultiCallable:
        # Messages come back as raw bytes, split by wire.split_chunk into views:
        # the payload is never copied out of the received message.
        return self.channel(endpoint).unary_stream(
            FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString
        )

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
    ) -> FetchStats:
        """Fetch a request's KV from every owner rank at once; ``place`` each verified chunk.

        ``pages`` optionally names the logical pages to fetch per rank (all
        the rank holds by default); ``max_chunk_bytes`` 0 lets servers choose.
        Raises ``ChecksumError``, ``RemoteError`` or ``TransferError``; on any
        error every stream is cancelled and no later chunk is placed.
        """
        start = time.perf_counter()
        budget = _ByteBudget(max_inflight_bytes)
        ready: queue.Queue[_Chunk] = queue.Queue()
        calls = {}
        for rank, endpoint in endpoints.items():
            request = lanekv_pb2.FetchRequest(
                request_id=request_id,
                fingerprint=fingerprint,
                layer_start=layer_start,
                pages=list(pages.get(rank, ())) if pages else [],
                max_chunk_bytes=max_chunk_bytes,
            )
            if layer_end is not None:
                request.layer_end = layer_end
            calls[rank] = self._fetch_call(endpoint)(request, timeout=timeout)
        threads = [
            threading.Thread(
                target=_receive,
                args=(rank, endpoints[rank], call, request_id, budget, ready),
                name=f"fetch-rank{rank}",
                daemon=True,
            )
            for rank, call in calls.items()
        ]
        for thread in threads:
            thread.start()
        per_rank = {rank: RankStats(0, 0, 0.0) for rank in calls}
        pending = set(calls)
        try:
            while pending:
                # Streams carry the same deadline, so this wait ends soon after theirs.
                item = ready.get(timeout=max(0.0, start + timeout - time.perf_counter()) + 5.0)
                if item.error is not None:
                    raise item.error
                stats = per_rank[item.rank]
                if item.header is None:
                    pending.discard(item.rank)
                    continue
                try:
                    place(item.header, item.tensor)
                finally:
                    budget.release(item.header.nbytes)
                elapsed = time.perf_counter() - start
                per_rank[item.rank] = RankStats(
                    stats.bytes + item.header.nbytes, stats.chunks + 1, elapsed
                )
        except queue.Empty as err:
            raise TransferError(
                f"request {request_id!r}: ranks {sorted(pending)} did not finish within {timeout:.1f}s"
            ) from err
        finally:
            budget.close()
            for call in calls.values():
                call.cancel()
            for thread in threads:
                thread.join(timeout=10.0)
        total = sum(s.bytes for s in per_rank.values())
        chunks = sum(s.chunks for s in per_rank.values())
        return FetchStats(total, chunks, time.perf_counter() - start, per_rank)

    def release(
        self, endpoints: Mapping[int, str], request_id: str, fingerprint: str, timeout: float = 10.0
    ) -> int:
        """Release the request on every owner rank; return the pages freed in all."""
        freed = 0
        request = lanekv_pb2.ReleaseRequest(request_id=request_id, fingerprint=fingerprint)
        for rank, endpoint in endpoints.items():
            try:
                freed += self.stub(endpoint).Release(request, timeout=timeout).pages_freed
            except grpc.RpcError as err:
                raise RemoteError(rank, endpoint, err.code(), err.details() or "") from err
        return freed


def _diffs_from(ours: Agreement, err: grpc.RpcError) -> list[FieldDiff]:
    """Structured diffs from the server's contract in the trailing metadata (empty if absent)."""
    for key, value in err.trailing_metadata() or ():
        if key == CONTRACT_METADATA_KEY:
            try:
                return diff(ours, LayoutContract.decode(value).agreement)
            except (ValueError, TypeError):
                return []
    return []


def _receive(
    rank: int, endpoint: str, call, request_id: str, budget: _ByteBudget, ready: queue.Queue
) -> None:
    """Drain one rank's stream: check and verify each chunk, then hand it to the placer."""
    seen: dict[int, set[int]] = {}  # layer -> pages received, to catch repeats and gaps
    try:
        for seq, message in enumerate(call):
            header_bytes, data = split_chunk(message)
            header = ChunkHeader.decode(header_bytes)
            if (header.request_id, header.rank, header.seq) != (request_id, rank, seq):
                raise TransferError(
                    f"rank {rank} sent chunk ({header.request_id!r}, rank {header.rank}, seq {header.seq}),"
                    f" expected ({request_id!r}, rank {rank}, seq {seq})"
                )
            if data.nbytes != header.nbytes or checksum(data) != header.checksum:
                raise ChecksumError(request_id, rank, seq)
            for layer in range(header.layer_start, header.layer_end):
                got = seen.setdefault(layer, set())
                if not got.isdisjoint(header.pages):
                    raise TransferError(
                        f"rank {rank} sent layer {layer} of a page twice (chunk {seq})"
                    )
                got.update(header.pages)
            if not budget.acquire(header.nbytes):
                return
            ready.put(_Chunk(rank, header, payload_to_tensor(header, data), None))
        if len({frozenset(pages) for pages in seen.values()}) > 1:
            raise TransferError(
                f"rank {rank} sent different pages for different layers of {request_id!r}"
            )
        ready.put(_Chunk(rank, None, None, None))
    except grpc.RpcError as err:
        ready.put(
            _Chunk(rank, None, None, RemoteError(rank, endpoint, err.code(), err.details() or ""))
        )
    except (TransferError, ValueError, TypeError) as err:
        ready.put(_Chunk(rank, None, None, err))


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
) -> FetchStats:
    """One-shot ``KVClient.fetch``; a daemon keeps a ``KVClient`` to reuse its channels."""
    with KVClient(security) as client:
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
