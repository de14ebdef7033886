"""The decode daemon: one process, one page pool, one decode loop, many Generate streams.

At start-up it loads the model, builds its layout agreement and handshakes
with the prefill daemon (and with every owner rank the prefill contract
names): a ``ContractMismatch`` ends start-up before anything is served. Then it
serves ``DecodeService.Generate`` (see ``decode.service``), ``KVTransfer.Handshake``
with its own contract (so ``lanekv handshake`` can read it; it holds no pages
for others, so FetchKV and Release answer NOT_FOUND) and the gRPC health service.

Threads: gRPC handler threads run each request's prefill call, transfer and
placement; one loop thread runs ``DecodeEngine.step`` while there is work and
routes every ``TokenEvent`` to its request's queue.

Its port, its channel to the prefill daemon and its channels to the ranks all
speak ``config.security`` (TLS, mutual TLS, the token; health stays open).
It owns a metrics registry (calls by code, tokens, transfer bytes and
throughput by prefill rank, failures by cause, pool gauges), served on
``metrics_port``. Request log lines read ``<what> request_id=<id> key=value ...``
and carry ``request_id`` as a record attribute too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode.budget import PageBudget
from decode.config import DecodeConfig
from decode.engine import DecodeEngine
from decode.pool import PagePool
from model.checkpoint import load_checkpoint
from proto import lanekv_pb2_grpc
from runtime.hostmem import keep_freed_buffers
from runtime.metrics import MetricsEndpoint, Registry, serve_metrics
from runtime.rpc_metrics import lanekv_metrics
from runtime.security import bind, make_server, open_channel
from runtime.status import TRANSFER_SERVICE
from transfer.fastpath.client import FastPath
from transfer.grpcfetch.client import KVClient, RemoteError, channel_options
from transfer.protocol.contract import Agreement, LayoutContract
from transfer.rank.service import KVTransferService, add_transfer_service
from transfer.rank.sources import ContractOnlySource

if TYPE_CHECKING:
    from decode.service import GenerateSpec, Prepared

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
DECODE_SERVICE = "lanekv.v1.DecodeService"
_IDLE_WAIT_S = 0.1  # how often an idle loop checks for shutdown
SHUTDOWN = object()  # queued to every open stream when the daemon stops
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


class DecodeStats(NamedTuple):
    free_pages: int  # pages of the pool not held by any request
    total_pages: int
    reserved_pages: int  # pages promised to admitted requests (see PageBudget)
    active_requests: int  # Generate calls between admission and their end
    finished: int  # streams that ended with a finish reason
    cancelled: int  # streams the client left (or the daemon stopped) before their end
    refused: int  # calls answered with an error status


class DecodeDaemon:
    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        keep_freed_buffers()  # gRPC hands this process a multi-MiB bytes object per chunk
        self.registry = Registry()
        self.metrics = lanekv_metrics(self.registry)
        self.metrics_endpoint: MetricsEndpoint | None = None
        # Channels to the owner ranks, shared by every request.
        self.kv = KVClient(config.security, retry=config.fetch_retry, receivers=config.resolved_fetch_processes)
        self._prefill_channel = None
        self._stop = threading.Event()
        self._stopped = False
        # Ports first: a busy one fails before the model loads.
        self.server = make_server(config.security, config.max_workers, interceptors=[self.metrics.interceptor()])
        try:
            self.port = bind(self.server, config.host, config.port, config.security)
            if config.metrics_port is not None:
                self.metrics_endpoint = serve_metrics(self.registry, config.host, config.metrics_port)
            self._start()
        except BaseException:
            self._stop.set()
            self._close_clients()
            self._close_ports()
            raise

    # -- start-up -------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        device = torch.device(config.resolved_device)
        self.loaded = load_checkpoint(config.model_path, config.torch_dtype, device, config.load_format)
        model_config = self.loaded.config
        self.vocab_size = model_config.vocab_size
        self.max_positions = model_config.max_position_embeddings
        self.tokenizer = self.loaded.tokenizer
        self.agreement = Agreement.from_model(
            model_config.contract_fields(), self.loaded.weights_digest, config.torch_dtype, config.page_size
        )
        self.prefill_contract = self._handshake()
        self.fastpath = FastPath(self.kv, self.agreement) if config.transport == "auto" else None
        self._prefill_channel = open_channel(config.prefill_endpoint, config.security, channel_options())
        self.prefill_stub = lanekv_pb2_grpc.PrefillServiceStub(self._prefill_channel)
        self.pool = PagePool.for_model(model_config, config.pool_pages, config.page_size,
                                       config.torch_dtype, device)
        self.engine = DecodeEngine(self.loaded.model, self.pool, max_batch_size=config.max_batch_size)
        self.budget = PageBudget(config.pool_pages)
        self._streams: dict[str, queue.SimpleQueue] = {}
        self._generated: dict[str, int] = {}  # tokens sent so far, per open stream
        self._counts = {"finished": 0, "cancelled": 0, "refused": 0}
        self._lock = threading.Lock()
        self._watch_pool()
        self._loop = threading.Thread(target=self._decode_loop, name="lanekv-decode-loop", daemon=True)
        self._loop.start()
        self._serve()

    def _watch_pool(self) -> None:
        """Gauges read at every scrape: the pool's free and used pages, promised pages, open streams."""
        pool, m = self.pool, self.metrics
        m.pool_pages_free.labels(rank=0).set_function(lambda: pool.free_count)
        m.pool_pages_used.labels(rank=0).set_function(lambda: pool.used_count)
        self.registry.gauge("lanekv_decode_pages_reserved",
                            "pool pages promised to admitted requests").set_function(lambda: self.budget.used)
        self.registry.gauge("lanekv_decode_active_requests",
                            "Generate calls between admission and their end").set_function(
            lambda: self.stats().active_requests)

    def _handshake(self) -> LayoutContract:
        """The prefill daemon's contract, once it and every owner rank accept ours.

        Raises ``ContractMismatch`` at the first refusal; retries only while the
        prefill daemon is unreachable, until ``connect_timeout_s``.
        """
        cfg = self.config
        deadline = time.monotonic() + cfg.connect_timeout_s
        while True:
            try:
                theirs = self.kv.handshake(cfg.prefill_endpoint, self.agreement, timeout=cfg.connect_timeout_s)
                break
            except RemoteError as err:
                if err.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        for endpoint in theirs.topology.endpoints:
            self.kv.handshake(endpoint, self.agreement, timeout=cfg.connect_timeout_s)
        return theirs

    def _serve(self) -> None:
        from decode.service import DecodeServicer  # the servicer imports this module's types

        cfg = self.config
        # Our own contract: our agreement and the topology our prefill daemon told us.
        self.contract = LayoutContract(self.agreement, self.prefill_contract.topology)
        lanekv_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self), self.server)
        add_transfer_service(self.server, KVTransferService(ContractOnlySource(self.contract, "a decode daemon serves no pages")))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.server.start()
        for service in ("", DECODE_SERVICE, TRANSFER_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        security = cfg.security
        tls = "mutual TLS" if security.require_client_cert else "TLS" if security.tls else "plaintext"
        log.info("decode daemon on %s, paired with prefill %s (cp %d), fingerprint %s, %s%s%s",
                 self.endpoint, cfg.prefill_endpoint, self.prefill_contract.topology.cp_size,
                 self.agreement.fingerprint[:16], tls, " + token" if security.token else "",
                 f", metrics on http://{cfg.host}:{self.metrics_port}/metrics" if self.metrics_port else "")

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        """The port serving /metrics (the one picked when ``metrics_port`` was 0), or None."""
        return None if self.metrics_endpoint is None else self.metrics_endpoint.port

    # -- streams and the decode loop -----------------------------------------

    def open_stream(self, request_id: str) -> queue.SimpleQueue | None:
        """A fresh event queue for ``request_id``; None if that id is in use."""
        with self._lock:
            if request_id in self._streams:
                return None
            events: queue.SimpleQueue = queue.SimpleQueue()
            self._streams[request_id] = events
            self._generated[request_id] = 0
            return events

    def transferred(self, spec: GenerateSpec, prepared: Prepared) -> None:
        """The request's KV is in our pool and the engine has it: count and log the transfer."""
        rid, fetch = spec.request_id, prepared.fetch
        self.metrics.tokens.labels(kind="prompt").inc(len(spec.token_ids))
        self._count_tokens(rid, 1)  # prefill's first token
        self.metrics.record_transfer({rank: s.bytes for rank, s in fetch.per_rank.items()}, fetch.seconds)
        log.info("transfer done request_id=%s bytes=%d chunks=%d ranks=%d retries=%d seconds=%.4f gbps=%.3f "
                 "prefill_s=%.4f", rid, fetch.bytes, fetch.chunks, len(fetch.per_rank), fetch.retries, fetch.seconds,
                 fetch.bytes / fetch.seconds / 1e9 if fetch.seconds > 0 else 0.0, prepared.prefill_s,
                 extra={"request_id": rid})

    def close_stream(self, request_id: str | None, outcome: str, context: grpc.ServicerContext | None = None) -> None:
        """Forget the request (None: refused before it had a stream); ``outcome`` is
        one of finished, cancelled, refused; ``context`` says the status it ended with."""
        with self._lock:
            if request_id is not None:
                self._streams.pop(request_id, None)
            tokens = self._generated.pop(request_id, 0)
            self._counts[outcome] += 1
        extra = {"request_id": request_id}
        if outcome == "finished":
            log.info("generate finished request_id=%s tokens=%d", request_id, tokens, extra=extra)
            return
        code, details = _ended_with(context, outcome)
        cause = FAILURE_CAUSES.get(code, "internal")
        if code == Code.ABORTED and "NOT_FOUND" in details:
            cause = "lease_expired"  # the ranks no longer held the pages
        self.metrics.failures.labels(cause=cause).inc()
        level = logging.INFO if outcome == "cancelled" else logging.WARNING
        log.log(level, "generate %s request_id=%s tokens=%d cause=%s code=%s: %s", outcome,
                request_id or "-", tokens, cause, code.name, details, extra=extra)

    def _count_tokens(self, request_id: str, n: int) -> None:
        self.metrics.tokens.labels(kind="generated").inc(n)
        with self._lock:
            if request_id in self._generated:
                self._generated[request_id] += n

    def _decode_loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.wait_for_work(_IDLE_WAIT_S):
                continue
            try:
                events = self.engine.step()
            except Exception as err:  # keep serving: fail the requests of this step, not the daemon
                log.exception("decode step failed")
                self._broadcast(err)
                self._stop.wait(_IDLE_WAIT_S)
                continue
            if not events:  # requests wait for pages freed by others: do not spin
                self._stop.wait(0.001)
            generated = 0
            with self._lock:
                for event in events:
                    if event.token_id is not None and event.request_id in self._generated:
                        self._generated[event.request_id] += 1
                        generated += 1
                    events_of = self._streams.get(event.request_id)
                    if events_of is not None:
                        events_of.put(event)
            if generated:
                self.metrics.tokens.labels(kind="generated").inc(generated)

    def _broadcast(self, item: object) -> None:
        with self._lock:
            for events in self._streams.values():
                events.put(item)

    # -- accounting -----------------------------------------------------------

    def free_pages(self) -> int:
        return self.pool.free_count

    def stats(self) -> DecodeStats:
        with self._lock:
            active, counts = len(self._streams), dict(self._counts)
        return DecodeStats(self.pool.free_count, self.pool.num_pages, self.budget.used, active,
                           counts["finished"], counts["cancelled"], counts["refused"])

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self, grace_s: float = 5.0) -> None:
        """Drain: say NOT_SERVING, refuse new calls, let open streams finish for
        ``grace_s``, then end them. A second call does nothing.

        An open health Watch is an open call too: it holds the stop for ``grace_s``.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            active = len(self._streams)
        self.health.enter_graceful_shutdown()  # every service NOT_SERVING, for good
        log.info("draining: %d open streams, %.1fs to finish", active, grace_s)
        self.server.stop(grace_s).wait(grace_s + 1.0)
        self._stop.set()
        self._broadcast(SHUTDOWN)  # wake streams still waiting
        self._loop.join(5.0)
        self._close_clients()
        self._close_ports()

    def _close_clients(self) -> None:
        self.kv.close()
        if self._prefill_channel is not None:
            self._prefill_channel.close()

    def _close_ports(self) -> None:
        self.server.stop(None)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()


def _ended_with(context: grpc.ServicerContext | None, outcome: str) -> tuple[grpc.StatusCode, str]:
    """The status a call that did not finish ends with; a client that left sets none itself."""
    if context is None:
        return Code.UNKNOWN, ""
    code, details = context.code(), context.details() or ""
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    if outcome == "cancelled" and code in (None, Code.CANCELLED):
        # gRPC ends a call whose deadline passed as it ends one the client left.
        if context.time_remaining() <= 0:
            return Code.DEADLINE_EXCEEDED, "the client's deadline passed"
        return Code.CANCELLED, details or "the client went away"
    return (Code.UNKNOWN if code is None else code), details


