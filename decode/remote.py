"""The remote steps of a Generate call: the streamed prefill call and fast-path fetches.

``PrefillCall`` runs ``PrefillService.PrefillStream``: ``started`` returns the
first message (the pages, as soon as every owner rank can stream them) and a
thread of its own waits for the last one (the first token), so the fetch runs
while the prefill does. ``FastFetches`` copies the pages of ranks that share
their pool with this daemon (``transfer.fastpath.client``), one thread per
rank. ``transfer_refusal`` turns a transfer error into the status the
Generate call ends with.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import grpc
import torch

from proto import lanekv_pb2
from runtime.status import Refusal
from transfer.fastpath.client import DigestMismatch
from transfer.fastpath.copyorder import CopyOrder
from transfer.grpcfetch.client import CorruptChunk, RankStats, RemoteError, TransferError
from transfer.rank.service import EPOCH_METADATA_KEY

if TYPE_CHECKING:
    from decode.daemon import DecodeDaemon
    from decode.service import GenerateSpec

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
# How long a fast-path attach to one rank may take before that rank goes over gRPC.
ATTACH_TIMEOUT_S = 5.0
# How long a stopped fast-path fetch waits for its ranks' threads (each syncs its copies as it fails).
STOP_WAIT_S = 10.0
# How long a failed fetch waits to learn whether the prefill failed (and report that instead).
_PREFILL_VERDICT_S = 5.0
# A rank's status after every try that says it (or the path to it) is down for now.
_TRANSIENT = (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED, Code.RESOURCE_EXHAUSTED, Code.CANCELLED)


def transfer_refusal(err: TransferError, deadline: float) -> Refusal:
    """The status of a Generate call whose KV transfer failed with ``err``."""
    if isinstance(err, CorruptChunk):
        return Refusal(Code.DATA_LOSS, f"KV transfer: {err}")
    code = Code.ABORTED
    if isinstance(err, RemoteError) and err.code in _TRANSIENT:
        code = Code.DEADLINE_EXCEEDED if time.monotonic() >= deadline else Code.UNAVAILABLE
    return Refusal(code, f"KV transfer: {err}")


class PrefillCall:
    """One PrefillStream call of the decode daemon."""

    def __init__(self, d: DecodeDaemon, spec: GenerateSpec, timeout_s: float) -> None:
        request = lanekv_pb2.PrefillRequest(
            token_ids=lanekv_pb2.TokenIds(ids=spec.token_ids), request_id=spec.request_id
        )
        request.sampling.CopyFrom(spec.sampling_proto)
        self._endpoint = d.config.prefill_endpoint
        self._start = time.perf_counter()
        self.seconds = 0.0  # from the call to its last message
        self.epoch: str | None = None  # the prefill daemon start that pinned the pages
        self._done: Future = Future()
        self._stream = d.prefill_stub.PrefillStream(request, timeout=timeout_s)

    def started(self) -> lanekv_pb2.PrefillReply:
        """The first message: the request's pages, held by every owner rank for FetchKV."""
        first = self._next()
        self.epoch = next((v for k, v in self._stream.initial_metadata() or () if k == EPOCH_METADATA_KEY), None)
        if first.done:  # a daemon that answers once, at the end
            self._finish(first.reply)
        else:
            threading.Thread(target=self._wait_done, name="lanekv-prefill-call", daemon=True).start()
        return first.reply

    def done(self) -> lanekv_pb2.PrefillReply:
        """The last message: the whole reply, first token included (waits for it)."""
        return self._done.result()

    def answered(self) -> bool:
        """Whether the last message came (then every rank has written every layer:
        the prefill daemon answers once each rank's device is done)."""
        return self._done.done() and self._done.exception() is None

    def raise_if_failed(self) -> None:
        """Raise the prefill's own failure, if it fails within a few seconds."""
        try:
            self._done.result(timeout=_PREFILL_VERDICT_S)
        except FutureTimeout:
            pass

    def close(self) -> None:
        self._stream.cancel()  # after the last message: does nothing

    def _wait_done(self) -> None:
        try:
            last = self._next()
            if not last.done:
                raise Refusal(Code.INTERNAL, f"prefill daemon {self._endpoint} sent two messages that are not done")
            self._finish(last.reply)
        except Refusal as refusal:
            self._done.set_exception(refusal)
        except Exception as err:  # noqa: BLE001 - handed to the waiting handler thread
            self._done.set_exception(Refusal(Code.INTERNAL, f"prefill call failed: {err}"))

    def _finish(self, reply: lanekv_pb2.PrefillReply) -> None:
        self.seconds = time.perf_counter() - self._start
        self._done.set_result(reply)

    def _next(self) -> lanekv_pb2.PrefillProgress:
        try:
            return next(self._stream)
        except grpc.RpcError as err:
            raise Refusal(err.code(), f"prefill daemon {self._endpoint}: {err.details()}") from err
        except StopIteration:
            raise Refusal(Code.INTERNAL, f"prefill daemon {self._endpoint} ended the call without "
                          "its last message") from None


class FastFetches:
    """Fast-path fetches from the ranks in ``shared`` (rank -> its mapped pool), one thread each.

    ``written``: the prefill has answered, so every layer is written; each rank's
    pages are then copied from where the owner-lane rule puts them without
    waiting for the rank's announcement (``FastPath.fetch``'s ``expect``).
    """

    def __init__(self, d: DecodeDaemon, call: Any, shared: dict[int, torch.Tensor], endpoints: Sequence[str],
                 pages: dict[int, list[int]], placed: Callable[[Sequence[int], int, int], None],
                 deadline: float, *, written: bool = False) -> None:
        self.stats: dict[int, RankStats] = {}
        self._errors: dict[int, BaseException] = {}
        self._calls: list[Any] = []
        self._stopped = False
        self._lock = threading.Lock()
        self._d, self._call, self._deadline = d, call, deadline
        self._physical_of = d.prefill_contract.topology.physical_of if written else None
        self._order = CopyOrder.for_pools(shared, d.pool.tensor.device)
        self._threads = [
            threading.Thread(target=self._run, args=(rank, pool, endpoints[rank], pages[rank], placed),
                             name=f"fast-rank{rank}", daemon=True)
            for rank, pool in shared.items()
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, rank: int, pool: torch.Tensor, endpoint: str, pages: list[int],
             placed: Callable[[Sequence[int], int, int], None]) -> None:
        d, call = self._d, self._call
        try:
            got = d.fastpath.fetch(
                endpoint, rank, pool, call.spec.request_id, call.fingerprint, pages, d.pool.tensor,
                call.table.physical_pages_for, placed, epoch=call.epoch,
                timeout=max(0.001, self._deadline - time.monotonic()), on_call=self._on_call,
                order=self._order,
                expect=None if self._physical_of is None else [self._physical_of(p) for p in pages])
            self.stats[rank] = RankStats(got.bytes, got.chunks, got.seconds)
        except BaseException as err:  # noqa: BLE001 - reported by join
            self._errors[rank] = err
            self._order.done(rank)  # also when it failed before its fetch began

    def _on_call(self, call: Any) -> None:
        with self._lock:
            self._calls.append(call)
            stopped = self._stopped
        if stopped:  # a rank that called after stop()
            call.cancel()

    def join(self, deadline: float) -> list[int]:
        """Wait for every rank; the ranks to fetch again over gRPC (a digest did not match)."""
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()) + 5.0)
            if thread.is_alive():
                raise Refusal(Code.DEADLINE_EXCEEDED, "fast-path KV copy did not finish in time")
        again = []
        for rank, err in sorted(self._errors.items()):
            if isinstance(err, DigestMismatch):
                log.warning("fast path: %s; fetching rank %d again over gRPC", err, rank,
                            extra={"request_id": self._call.spec.request_id})
                self._d.metrics.failures.labels(cause="fastpath_digest").inc()
                again.append(rank)
            elif isinstance(err, Refusal):
                raise err
            elif isinstance(err, TransferError):
                raise transfer_refusal(err, self._deadline) from err
            else:
                raise Refusal(Code.INTERNAL, f"fast-path KV copy from rank {rank}: {type(err).__name__}: {err}")
        return again

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Cancel the streams still open (another part of the fetch failed) and wait up to
        ``wait_s`` for the ranks' threads: a rank's copies, made before its first
        message, may still be running, and the caller frees the pages they fill."""
        with self._lock:
            self._stopped = True
            calls = list(self._calls)
        for stream in calls:
            stream.cancel()
        until = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, until - time.monotonic()))
