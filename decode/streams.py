"""The open Generate streams of a decode daemon: their event queues and their accounting.

``Streams.open`` gives each request id one queue (an id in use is refused);
the decode loop ``deliver``s every engine event to its request's queue and
counts the tokens; ``close`` forgets the request and counts how it ended
(finished, cancelled, refused), with a failure cause from the status it ended
with. A daemon that stops ``broadcast``s ``SHUTDOWN`` to every queue. A stream
opened with ``counted=False`` (the daemon's own warm-up request) gets its queue
and its log lines but no metrics and no counts.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import NamedTuple

import grpc
from lanekv.decode.engine import TokenEvent
from lanekv.runtime.rpc_metrics import LanekvMetrics
from lanekv.transfer.connector.fetcher import FetchStats

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
SHUTDOWN = object()  # queued to every open stream when the daemon stops


class DaemonFailed(Exception):
    """Queued to every open stream when a decode step fails: the daemon stops (fail-stop),
    and each stream ends UNAVAILABLE so its client goes to another daemon."""
# The failure cause of a Generate call that did not finish, by the status it ended with.
FAILURE_CAUSES = {
    Code.CANCELLED: "cancelled",
    Code.DEADLINE_EXCEEDED: "deadline",
    Code.INVALID_ARGUMENT: "invalid_argument",
    Code.OUT_OF_RANGE: "invalid_argument",
    Code.ALREADY_EXISTS: "invalid_argument",
    Code.RESOURCE_EXHAUSTED: "out_of_pages",  # ours or the prefill daemon's
    Code.FAILED_PRECONDITION: "contract_mismatch",
    Code.DATA_LOSS: "checksum",  # a chunk failed its checksum or did not fit
    Code.UNAVAILABLE: "unavailable",  # the prefill daemon or a rank is down, or we are stopping
    Code.ABORTED: "transfer",
}


class StreamCounts(NamedTuple):
    active: int  # Generate calls between admission and their end
    finished: int  # streams that ended with a finish reason
    cancelled: int  # streams the client left (or the daemon stopped) before their end
    refused: int  # calls answered with an error status


class Streams:
    def __init__(self, metrics: LanekvMetrics) -> None:
        self._metrics = metrics
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._generated: dict[str, int] = {}  # tokens sent so far, per open stream
        self._counts = {"finished": 0, "cancelled": 0, "refused": 0}
        self._uncounted: set[str] = set()  # open streams outside the metrics and counts
        self._lock = threading.Lock()

    def open(self, request_id: str, counted: bool = True) -> queue.SimpleQueue | None:
        """A fresh event queue for ``request_id``; None if that id is in use."""
        with self._lock:
            if request_id in self._queues:
                return None
            events: queue.SimpleQueue = queue.SimpleQueue()
            self._queues[request_id] = events
            self._generated[request_id] = 0
            if not counted:
                self._uncounted.add(request_id)
            return events

    def transferred(self, request_id: str, prompt_tokens: int, fetch: FetchStats, prefill_s: float,
                    first_token: bool = True) -> None:
        """The request's KV is in our pool and the engine has it: count and log the transfer.
        ``first_token=False``: the engine samples the first token (a whole-prompt cache hit)."""
        with self._lock:
            if request_id in self._generated and first_token:
                self._generated[request_id] += 1  # prefill's first token
            counted = request_id not in self._uncounted
        if counted:
            self._metrics.tokens.labels(kind="prompt").inc(prompt_tokens)
            self._metrics.tokens.labels(kind="generated").inc(int(first_token))
            self._metrics.record_transfer({rank: s.bytes for rank, s in fetch.per_rank.items()}, fetch.seconds)
        log.info("transfer done request_id=%s bytes=%d chunks=%d ranks=%d retries=%d seconds=%.4f gbps=%.3f "
                 "prefill_s=%.4f", request_id, fetch.bytes, fetch.chunks, len(fetch.per_rank), fetch.retries,
                 fetch.seconds, fetch.bytes / fetch.seconds / 1e9 if fetch.seconds > 0 else 0.0, prefill_s,
                 extra={"request_id": request_id})

    def deliver(self, events: Sequence[TokenEvent]) -> None:
        """Queue each event of a decode step for its request, counting the tokens."""
        generated = 0
        with self._lock:
            for event in events:
                if event.token_id is not None and event.request_id in self._generated:
                    self._generated[event.request_id] += 1
                    generated += event.request_id not in self._uncounted
                events_of = self._queues.get(event.request_id)
                if events_of is not None:
                    events_of.put(event)
        if generated:
            self._metrics.tokens.labels(kind="generated").inc(generated)

    def broadcast(self, item: object) -> None:
        """Queue ``item`` (an error of a decode step, or ``SHUTDOWN``) to every open stream."""
        with self._lock:
            for events in self._queues.values():
                events.put(item)

    def close(self, request_id: str | None, outcome: str, code: grpc.StatusCode, details: str) -> None:
        """Forget the request (None: refused before it had a stream); ``outcome`` is one of
        finished, cancelled, refused; ``code`` and ``details``: the status it ended with."""
        with self._lock:
            if request_id is not None:
                self._queues.pop(request_id, None)
            tokens = self._generated.pop(request_id, 0)
            counted = request_id not in self._uncounted
            self._uncounted.discard(request_id)
            if counted:
                self._counts[outcome] += 1
        extra = {"request_id": request_id}
        if outcome == "finished":
            log.info("generate finished request_id=%s tokens=%d", request_id, tokens, extra=extra)
            return
        cause = FAILURE_CAUSES.get(code, "internal")
        if code == Code.ABORTED and "NOT_FOUND" in details:
            cause = "lease_expired"  # the ranks no longer held the pages
        if counted:
            self._metrics.failures.labels(cause=cause).inc()
        level = logging.INFO if outcome == "cancelled" else logging.WARNING
        log.log(level, "generate %s request_id=%s tokens=%d cause=%s code=%s: %s", outcome,
                request_id or "-", tokens, cause, code.name, details, extra=extra)

    def counts(self) -> StreamCounts:
        with self._lock:
            return StreamCounts(len(self._queues) - len(self._uncounted), self._counts["finished"], self._counts["cancelled"],
                                self._counts["refused"])
