"""One owner rank's part of a KV fetch: its streams, retried and resumed.

A rank's part starts as one ``Span`` (a layer range x a page list) and is
received by its own thread (``RankFetch.run``), which checks and verifies
every chunk and records its cells (layer, page) once it is handed to the
placer. When a stream fails in a way that may pass (UNAVAILABLE, a broken or
closed connection, a stall, a damaged chunk), the thread waits and asks again
for only the cells it lacks (``leftovers``), up to ``RetryPolicy.attempts``
tries in a row that bring no new cell, within the fetch's deadline. Any other
status (NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, UNAUTHENTICATED, the
deadline) fails at once. Other ranks' streams go on meanwhile.

A stream that delivers nothing for ``RetryPolicy.stall_s`` while we wait on
the network (not on our own placer) is cancelled by the fetch's watchdog
(``cut_if_stalled``) and counts as DEADLINE_EXCEEDED; its retry, like that of
any broken connection, asks for a fresh connection, since a frozen one would
freeze the retry too.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
import torch
from lanekv.proto import lanekv_pb2
from lanekv.transfer.errors import CorruptChunk, RemoteError, TransferError
from lanekv.transfer.grpcfetch.spans import Cells, Span, StreamCheck, leftovers
from lanekv.transfer.protocol.wire import ChunkHeader, payload_to_tensor

Code = grpc.StatusCode
# (endpoint, request, timeout_s, fresh_connection) -> a started server-streaming call
OpenStream = Callable[[str, lanekv_pb2.FetchRequest, float, bool, int], Any]  # (endpoint, request, timeout, fresh, lane)
# Statuses of a stream that a retry may cure: the server or the path to it is
# down or restarting, our channel was closed under the call (CANCELLED that
# this fetch did not ask for), or the connection broke in a way gRPC reports
# as UNKNOWN ("Stream removed") or INTERNAL (a reset stream, bad HTTP/2 framing).
RETRYABLE_CODES = (Code.UNAVAILABLE, Code.CANCELLED, Code.UNKNOWN, Code.INTERNAL)
# Messages a stream's reader thread takes from gRPC ahead of their checks.
PREFETCH = 2
_END = object()  # the reader's mark: the stream ended cleanly


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # tries of one rank's stream in a row that bring no new cell
    backoff_s: float = 0.05  # wait before the first retry, doubled for each next one
    max_backoff_s: float = 1.0
    stall_s: float = 30.0  # a stream silent this long is cut (and retried, tries permitting)

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got attempts={self.attempts!r}")
        for name in ("backoff_s", "max_backoff_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {name}={getattr(self, name)!r}")
        if not self.stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got stall_s={self.stall_s!r}")

    def backoff(self, failures: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** (failures - 1))


NO_RETRY = RetryPolicy(attempts=1)


class Item(NamedTuple):
    """What a rank's thread hands to the placer: a chunk, its end (header None), or an error."""

    rank: int
    header: ChunkHeader | None
    tensor: torch.Tensor | None
    error: TransferError | None
    done: Callable[[], None] | None = None  # called after its placement ran or was skipped


class ByteBudget:
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


class Job:
    """What every rank's thread of one fetch shares."""

    def __init__(self, request_id: str, fingerprint: str, max_chunk_bytes: int, policy: RetryPolicy,
                 timeout_s: float, open_stream: OpenStream, budget: Any) -> None:
        self.request_id, self.fingerprint, self.max_chunk_bytes = request_id, fingerprint, max_chunk_bytes
        self.policy, self.open_stream, self.budget = policy, open_stream, budget
        self.deadline = time.monotonic() + timeout_s
        self.heads: tuple[int, int] | None = None  # (first KV head, count): a TP decode rank's
        self.ready: queue.Queue[Item] = queue.Queue()
        self.stopping = threading.Event()

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class _Retry(Exception):
    """A stream failed in a way a retry may cure; ``final`` is raised when no try is left."""

    def __init__(self, final: TransferError, reconnect: bool) -> None:
        super().__init__(str(final))
        self.final, self.reconnect = final, reconnect


class RankFetch:
    """One owner rank's part of a fetch (``run`` in its own thread)."""

    def __init__(self, job: Job, rank: int, endpoint: str, span: Span, received: Cells | None = None,
                 lane: int = 0, fallback: str | None = None) -> None:
        """``received``: cells of ``span`` already handed to the placer (by a receiver
        process that failed); only the others are asked for. ``lane``: which of the
        rank's connections the stream goes on (one per stream of the rank).
        ``fallback``: the rank's own endpoint when ``endpoint`` is one of its sender
        relays (``transfer.rank.relay``): a relay stream that fails in a way a retry
        may cure goes on there at once, for the cells it lacks, whatever the policy's
        tries (a relay that died or found a page it read changed says UNAVAILABLE)."""
        self.job, self.rank, self.endpoint, self.lane = job, rank, endpoint, lane
        self.fallback = fallback if fallback != endpoint else None
        self.cells = Cells() if received is None else received  # verified and handed to the placer
        self.retries = 0
        self._pending = [span] if received is None else leftovers(span, received)
        self._lock = threading.Lock()  # guards the call under way, for the watchdog
        self._call: Any = None
        self._waiting_since: float | None = None
        self._stalled = False

    def run(self) -> None:
        job, failures, fresh = self.job, 0, False
        mark = 0  # cells received at the last failure: tries count anew after progress
        try:
            while self._pending:
                span = self._pending[0]
                try:
                    if not self._stream(span, fresh):
                        return  # the fetch ended under this stream
                    self._pending.pop(0)
                    fresh = False
                    continue
                except _Retry as retry:
                    if self.fallback is not None and not job.stopping.is_set():
                        self.endpoint, self.fallback, fresh = self.fallback, None, True
                        self.retries += 1
                        self._pending[0:1] = leftovers(span, self.cells)
                        continue
                    failures = 1 if self.cells.count > mark else failures + 1
                    mark = self.cells.count
                    wait = job.policy.backoff(failures)
                    if failures >= job.policy.attempts or job.remaining() <= wait:
                        raise _after_tries(retry.final, failures) from retry
                    if job.stopping.wait(wait):
                        return
                    self.retries += 1
                    self._pending[0:1] = leftovers(span, self.cells)
                    fresh = retry.reconnect
            job.ready.put(Item(self.rank, None, None, None))
        except TransferError as err:
            job.ready.put(Item(self.rank, None, None, err))
        except Exception as err:  # a fault of ours must end the fetch now, not at its deadline
            job.ready.put(Item(self.rank, None, None, TransferError(f"rank {self.rank}: receiver failed: {err!r}")))

    def cancel(self) -> None:
        """End the stream under way (the fetch is over; ``job.stopping`` is set)."""
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """The fetch is over (``RemoteRankFetch`` hands its process back here)."""

    def cut_if_stalled(self, now: float) -> None:
        """Cancel the stream under way if it has delivered nothing for ``stall_s`` (the watchdog's call)."""
        with self._lock:
            since, call = self._waiting_since, self._call
            if call is None or since is None or now - since < self.job.policy.stall_s:
                return
            self._stalled = True
        call.cancel()

    def _stream(self, span: Span, fresh: bool) -> bool:
        """Receive one span; False when the fetch ended under it. Raises ``_Retry`` or ``TransferError``."""
        job = self.job
        timeout = job.remaining()
        if timeout <= 0:
            raise RemoteError(self.rank, self.endpoint, Code.DEADLINE_EXCEEDED, "the fetch ran out of time")
        request = span.request(job.request_id, job.fingerprint, job.max_chunk_bytes, job.heads)
        call = job.open_stream(self.endpoint, request, timeout, fresh, self.lane)
        with self._lock:
            self._call, self._stalled = call, False
        try:
            if job.stopping.is_set():
                return False
            check = StreamCheck(job.request_id, self.rank, span)
            for message in self._messages(call):
                header, data = check.chunk(message)
                if self.cells.has_all(header):
                    continue  # resent by a retry that could not say which pages it lacked
                if not job.budget.acquire(header.nbytes):
                    return False
                self.cells.add(header)
                job.ready.put(Item(self.rank, header, payload_to_tensor(header, data), None))
            check.finish()
            return True
        except grpc.RpcError as err:
            if job.stopping.is_set():
                return False
            details = err.details() or ""
            if self._stalled:
                details = f"no chunk for {job.policy.stall_s:.1f}s: the stream stalled"
                raise _Retry(RemoteError(self.rank, self.endpoint, Code.DEADLINE_EXCEEDED, details), True) from err
            error = RemoteError(self.rank, self.endpoint, err.code(), details)
            if err.code() in RETRYABLE_CODES:
                raise _Retry(error, True) from err
            raise error from err
        except CorruptChunk as err:
            raise _Retry(err, False) from err
        finally:
            with self._lock:
                self._call, self._waiting_since = None, None
            call.cancel()

    def _messages(self, call: Any) -> Iterator[bytes]:
        """The stream's messages; the watchdog's clock runs only while we wait for one.

        A reader thread takes them from gRPC (the receive and its copy into a
        bytes object) up to ``PREFETCH`` ahead, while this thread checks and
        verifies the one before: the two overlap instead of taking turns.
        """
        box: queue.Queue = queue.Queue(maxsize=PREFETCH)
        stop = threading.Event()

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    box.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def read() -> None:
            try:
                for message in call:
                    if not put(message):
                        return
                put(_END)
            except BaseException as err:  # noqa: BLE001 - raised in the fetching thread
                put(err)

        threading.Thread(target=read, name=f"fetch-read-rank{self.rank}", daemon=True).start()
        try:
            while True:
                with self._lock:
                    self._waiting_since = time.monotonic()
                try:
                    item = box.get()
                finally:
                    with self._lock:
                        self._waiting_since = None
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # the reader ends at its next message (the call is cancelled by our caller)


def _after_tries(error: TransferError, tries: int) -> TransferError:
    if tries > 1:
        error.args = (f"{error.args[0] if error.args else error} (after {tries} tries)",)
    return error
