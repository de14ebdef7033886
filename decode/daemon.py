"""The decode daemon: one process, one page pool, one decode loop, many Generate streams.

At start-up it loads the model, builds its layout agreement and handshakes
with each of its prefill daemons (and with every owner rank each contract
names; xPyD: several ``--prefill``). One that refuses is logged, one line per
differing field, and left out for good; one not reached joins once its health
says SERVING and its handshake passes. Start-up ends with a
``ContractMismatch`` (or the first error) only when none accepts. Then it
serves ``DecodeService.Generate`` (``decode.service``, running ``decode.generate``), ``KVTransfer.Handshake``
with its own contract (so ``lanekv handshake`` can read it; it holds no pages
for others, so FetchKV and Release answer NOT_FOUND) and the gRPC health service.

``warm_up`` sends one short request of its own through each prefill daemon and
the whole pipeline (``lanekv decode`` runs it before its ready file).

It builds what a Generate call runs on (a ``GenerateContext``: pool, engine,
KV fetcher, prefill pool, page budget, streams) and owns it. Threads: gRPC
handler threads run each request's prefill call, transfer and placement; one
loop thread runs ``DecodeEngine.step`` while there is work and hands every
``TokenEvent`` to its request's stream (``decode.streams``).

Its port, its channels to the prefill daemons and its channels to the ranks all
speak ``config.security`` (TLS, mutual TLS, the token; health stays open).
It owns a metrics registry (calls by code, tokens, transfer bytes and
throughput by prefill rank, failures by cause, pool gauges), served on
``metrics_port``. Request log lines read ``<what> request_id=<id> key=value ...``
and carry ``request_id`` as a record attribute too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import TYPE_CHECKING, NamedTuple

import grpc
import torch
from grpc_health.v1 import health_pb2_grpc
from lanekv.decode.budget import PageBudget
from lanekv.decode.config import DecodeConfig
from lanekv.decode.cuda.warmup import warm_up_kernels
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.generate import GenerateContext, GeneratePipeline, GenerateSpec, LocalCaller
from lanekv.decode.pool import PagePool
from lanekv.decode.prefill_call import PrefillClient, PrefillPool, PrefillTarget
from lanekv.decode.prefix.cache import DecodePrefixCache
from lanekv.decode.prefix.route import PrefixMemory
from lanekv.decode.service import DecodeServicer
from lanekv.decode.streams import SHUTDOWN, DaemonFailed, Streams
from lanekv.decode.tp.engine import TPDecodeEngine
from lanekv.decode.tp.group import RankFailed, TPGroup
from lanekv.decode.tp.start import start_group, tp_fetcher
from lanekv.model.attention import pool_contract_fields, pool_rows
from lanekv.model.checkpoint import load_checkpoint
from lanekv.model.grammar import Grammars
from lanekv.model.sampling import SamplingParams
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.daemon import DaemonServer
from lanekv.runtime.hostmem import keep_freed_buffers
from lanekv.runtime.metrics import PrefixMetrics
from lanekv.runtime.security import open_channel
from lanekv.runtime.status import TRANSFER_SERVICE, Refusal, one_line
from lanekv.transfer.connector.base import KVTransport, TransportContext
from lanekv.transfer.connector.registry import make_fetcher
from lanekv.transfer.errors import ContractMismatch
from lanekv.transfer.grpcfetch.client import KVClient, RemoteError, channel_options
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract, Topology
from lanekv.transfer.protocol.fielddiff import format_diff
from lanekv.transfer.rank.server import add_transfer_service
from lanekv.transfer.rank.service import KVTransferService
from lanekv.transfer.rank.sources import ContractOnlySource

if TYPE_CHECKING:
    from lanekv.transfer.fastpath.client import FastPath

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
DECODE_SERVICE = "lanekv.v1.DecodeService"
STOP_GRACE_S = 5.0  # what a stop gives open streams by default
WARM_UP_TIMEOUT_S = 60.0  # one warm-up request, its prefill to its last token
WARM_UP_NEW_TOKENS = 2  # prefill's first token and one decode step
WAIT_LOG_S = 3.0  # how often start-up says it still waits for a prefill daemon
_IDLE_WAIT_S = 0.1  # how often an idle loop checks for shutdown


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
        self._serving = False  # health set by start; the prefill pick may change it after
        keep_freed_buffers()  # gRPC hands this process a multi-MiB bytes object per chunk
        # Channels to the owner ranks, shared by every request.
        self.kv = KVClient(config.security, retry=config.fetch_retry, receivers=config.resolved_fetch_processes)
        self._prefill_channels: list[grpc.Channel] = []
        self.prefills: PrefillPool | None = None
        self._stop = threading.Event()
        self._stopped = False
        self._failure: str | None = None  # why the decode loop stopped (fail-stop), once it has
        self.tp: TPGroup | None = None  # tp_size > 1: the group of decode ranks (decode.tp), rank 0 here
        # Ports first: a busy one fails before the model loads.
        try:
            self.rpc = DaemonServer(config.security, config.host, config.port, config.max_workers,
                                    config.metrics_port, config.advertise_host)
        except BaseException:
            self._close_clients()
            raise
        self.registry, self.metrics = self.rpc.registry, self.rpc.metrics
        try:
            self._start()
        except BaseException:
            self._stop.set()
            if self.tp is not None:
                self.tp.close()
            self._close_clients()
            self.rpc.close()
            raise

    # -- start-up -------------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        device = torch.device(config.resolved_device)
        if config.tp_size > 1:
            # A death before the streams exist fails the start below instead.
            self.tp = start_group(config, on_death=lambda rank, reason: (
                self._fail(reason) if hasattr(self, "streams") else None))
            self.loaded = self.tp.state.loaded  # its config the whole model's, its model rank 0's shard
        else:
            self.loaded = load_checkpoint(config.model_path, config.torch_dtype, device, config.load_format)
        model_config = self.loaded.config
        self.agreement = Agreement.from_model(
            pool_contract_fields(model_config, config.torch_dtype, config.index_cache_dtype,
                                 config.kv_cache_dtype),
            self.loaded.weights_digest,
            pool_rows(model_config, config.torch_dtype, config.index_cache_dtype,
                      config.kv_cache_dtype).dtype, config.page_size
        )
        contracts = self._handshake_all()
        self._size_receivers(contracts)
        # Ours, as KVTransfer.Handshake serves it, names the first accepting daemon's topology.
        self.prefill_contract = next(c for c in contracts.values() if c is not None)
        targets = []
        for endpoint, contract in contracts.items():
            channel = open_channel(endpoint, config.security, channel_options())
            self._prefill_channels.append(channel)
            targets.append(PrefillTarget(PrefillClient(lanekv_pb2_grpc.PrefillServiceStub(channel), endpoint),
                                         None if contract is None else contract.topology,
                                         health_pb2_grpc.HealthStub(channel),
                                         memory=PrefixMemory(self.agreement.fingerprint, config.page_size)
                                         if config.prefix_cache else None))
        self.prefills = PrefillPool(targets, interval_s=config.prefill_health_interval_s,
                                    rejoin=self._rejoin,
                                    on_available=self._prefill_available)
        self.fetcher = make_fetcher(config.transports, TransportContext(
            self.kv, self.agreement, self.metrics.failures, config.max_inflight_bytes, config.fetch_chunk_bytes,
            config.resolved_fetch_streams))
        if self.tp is not None:
            self.fetcher = tp_fetcher(config, self.fetcher, self.tp, self.agreement)
            self.pool = self.tp.state.pool
            self.engine = TPDecodeEngine(self.loaded.model, self.pool, group=self.tp,
                                         max_batch_size=config.max_batch_size)
        else:
            self.pool = PagePool.for_model(model_config, config.pool_pages, config.page_size,
                                           config.torch_dtype, device,
                                           index_cache_dtype=config.index_cache_dtype,
                                           kv_cache_dtype=config.kv_cache_dtype)
            self.engine = DecodeEngine(self.loaded.model, self.pool, max_batch_size=config.max_batch_size,
                                       graph_sizes=config.graph_batch_sizes)
        self.engine.capture_graphs()  # CUDA only: compiles and captures before we serve
        warm_up_kernels(self.pool, self.loaded.model.config)  # the shard's heads with tp_size > 1
        self.budget = PageBudget(config.pool_pages)
        self.streams = Streams(self.metrics)
        self._lock = threading.Lock()
        # Keyed by the agreement's fingerprint, as the prefill daemon's cache is.
        self.prefix_cache = DecodePrefixCache(self.pool, self.agreement.fingerprint, enabled=config.prefix_cache,
                                              max_pages=int(config.pool_pages * config.prefix_cache_share))
        # A finished request's whole pages, its reply's included (decode.prefix.cache: generated pages).
        self.engine.on_finish = self.prefix_cache.admit
        prefix_metrics = self._watch_prefix_cache()
        self.generate = GenerateContext(
            config, self.pool, self.engine, self.fetcher, self.prefills, self.budget,
            self.streams, self.agreement, self.loaded.tokenizer, model_config.vocab_size,
            config.max_model_len or model_config.max_position_embeddings, self._stop,
            self.prefix_cache, prefix_metrics,
            grammars=None if self.loaded.tokenizer is None else Grammars(
                self.loaded.tokenizer.backend, model_config.vocab_size, self.engine.eos_token_ids),
        )
        self._watch_pool()
        if self.tp is not None and self.tp.failure is not None:
            raise RankFailed(self.tp.failure)  # a rank died during start-up
        self._loop = threading.Thread(target=self._decode_loop, name="lanekv-decode-loop", daemon=True)
        self._loop.start()
        self._serve()

    def _size_receivers(self, contracts: dict[str, LayoutContract | None]) -> None:
        """One receiver process per stream of a fetch, now that the prefill daemons' CP is
        known (``DecodeConfig.fetch_processes_for``); they start while the model warms up,
        and a daemon that joins later with a larger CP adds its own (``_rejoin``)."""
        want = self.config.fetch_processes_for([c.topology.cp_size for c in contracts.values() if c is not None])
        if self.kv.receivers is not None and want > self.kv.receivers.size:
            log.info("receiver processes: %d, one per gRPC stream of a fetch", self.kv.receivers.grow_to(want))

    def _rejoin(self, endpoint: str) -> Topology:
        """The topology of a prefill daemon that joins (or comes back) after start."""
        contract = self._handshake(endpoint, patient=False)
        self._size_receivers({endpoint: contract})
        return contract.topology

    @property
    def fastpath(self) -> FastPath | None:
        """The fast path's mapped pools (tests and benchmarks look at them); None without it."""
        transport = self.fetcher.transport("fastpath")
        return None if transport is None else transport.fastpath

    def _watch_prefix_cache(self) -> PrefixMetrics:
        """The prefix cache's metrics (``runtime.metrics.PrefixMetrics``) and its size."""
        cache = self.prefix_cache
        self.registry.gauge("lanekv_prefix_cache_pages", "pages the prefix cache holds (idle or in use)").set_function(
            lambda: cache.cached_pages)
        picks = self.registry.gauge("lanekv_prefix_routed_picks", "prefill daemon picks since start; hit: of "
                                    "one remembered to hold a prefix of the prompt; evicted: replies showing a "
                                    "remembered prefix was gone there (forgotten since)", ("followed",))
        picks.labels(followed="any").set_function(lambda: self.prefills.picks)
        picks.labels(followed="hit").set_function(lambda: self.prefills.picks_on_hit)
        picks.labels(followed="evicted").set_function(lambda: self.prefills.picks_on_stale)
        return PrefixMetrics.on(self.registry, "decode", lambda: cache.stats.evicted_pages)

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
        healthy = self.registry.gauge("lanekv_decode_prefill_healthy",
                                      "1 while the prefill daemon is in the pick", ("prefill",))
        queued = self.registry.gauge("lanekv_decode_prefill_queued_tokens",
                                     "prompt tokens sent to the prefill daemon, not yet prefilled", ("prefill",))
        retried = self.registry.gauge("lanekv_decode_prefill_retried_requests",
                                      "requests that failed on the prefill daemon before a token was sent "
                                      "and went to another one", ("prefill",))
        for target in self.prefills.targets:
            healthy.labels(prefill=target.endpoint).set_function(lambda t=target: float(t.healthy))
            queued.labels(prefill=target.endpoint).set_function(lambda t=target: t.queued_tokens)
            retried.labels(prefill=target.endpoint).set_function(lambda t=target: t.retried)

    def _handshake_all(self) -> dict[str, LayoutContract | None]:
        """Each prefill daemon's contract, in the configured order: None for one not
        reached (it joins later); one that refuses ours is logged and left out.

        Raises ``ContractMismatch`` (naming every refusal, the first one's diffs)
        when none accepts and one refused, else the first daemon's error.
        """
        endpoints = self.config.prefill_endpoints
        results: dict[str, LayoutContract | Exception] = {}

        def one(endpoint: str) -> None:
            try:
                results[endpoint] = self._handshake(endpoint)
            except Exception as err:  # noqa: BLE001 - judged below, with the other daemons' answers
                results[endpoint] = err

        threads = [threading.Thread(target=one, args=(e,), name="lanekv-handshake") for e in endpoints]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [(e, results[e]) for e in endpoints if isinstance(results[e], ContractMismatch)]
        for endpoint, err in refused:
            lines = format_diff(err.diffs, ours="decode", theirs="prefill").splitlines() if err.diffs \
                else [str(err).splitlines()[0]]
            for line in lines:  # one line per differing field, each naming the daemon
                log.error("prefill daemon %s refused, its layout contract differs: %s", endpoint, line)
        accepted = {e: r for e, r in results.items() if isinstance(r, LayoutContract)}
        if not accepted:
            if refused:
                named = "; ".join(f"{e}: {', '.join(d.name for d in err.diffs) or err}" for e, err in refused)
                raise ContractMismatch(refused[0][1].diffs, f"no prefill daemon accepts our contract ({named})")
            raise results[endpoints[0]]
        out: dict[str, LayoutContract | None] = {}
        for endpoint in endpoints:
            result = results[endpoint]
            if isinstance(result, LayoutContract):
                out[endpoint] = result
            elif not isinstance(result, ContractMismatch):
                log.error("prefill daemon %s not reached at start (%s); it joins once its health says SERVING",
                          endpoint, str(result).splitlines()[0])
                out[endpoint] = None
        return out

    def _handshake(self, endpoint: str, patient: bool = True) -> LayoutContract:
        """The contract of the prefill daemon at ``endpoint``, once it and every owner
        rank accept ours.

        Raises ``ContractMismatch`` at the first refusal; ``patient``: retries while
        the prefill daemon is unreachable, until ``connect_timeout_s``.
        """
        cfg = self.config
        start = time.monotonic()
        deadline, said = start + cfg.connect_timeout_s, start
        while True:
            try:
                theirs = self.kv.handshake(endpoint, self.agreement, timeout=cfg.connect_timeout_s)
                break
            except RemoteError as err:
                now = time.monotonic()
                if not patient or err.code != grpc.StatusCode.UNAVAILABLE or now > deadline:
                    raise
                if now - said >= WAIT_LOG_S:  # a daemon started first says what it waits for
                    said = now
                    log.info("waiting for prefill daemon %s (%s): %.0f s so far, %.0f s left of "
                             "connect_timeout_s", endpoint, err.code.name, now - start, deadline - now)
                time.sleep(0.2)
        try:
            theirs.topology.check_decode_layout(cfg.tp_size)
        except ValueError as err:
            raise ContractMismatch([], f"prefill daemon {endpoint}: {err}") from None
        for rank in theirs.topology.endpoints:
            self.kv.handshake(rank, self.agreement, timeout=cfg.connect_timeout_s)
        return theirs

    def _serve(self) -> None:
        # Our own contract: our agreement and the topology the first accepting prefill daemon told us.
        self.contract = LayoutContract(self.agreement, self.prefill_contract.topology)
        server = self.rpc.server
        lanekv_pb2_grpc.add_DecodeServiceServicer_to_server(DecodeServicer(self.generate), server)
        add_transfer_service(server, KVTransferService(ContractOnlySource(self.contract, "a decode daemon serves no pages")))
        self.rpc.start((DECODE_SERVICE, TRANSFER_SERVICE))
        self._serving = True
        if not self.prefills.available:  # every prefill daemon left the pick during start-up
            self._prefill_available(False)
        log.info("decode daemon on %s, paired with prefill %s, fingerprint %s, %s", self.endpoint,
                 ", ".join(f"{t.endpoint} (cp {t.topology.cp_size if t.topology else '?'})"
                           for t in self.prefills.targets),
                 self.agreement.fingerprint[:16], self.rpc.describe())

    def _prefill_available(self, available: bool) -> None:
        """Our health follows the prefill pick: with no prefill daemon to take a prompt
        every Generate would fail, so say NOT_SERVING (a front or an orchestrator then
        sends elsewhere) until one is back. A drain's NOT_SERVING stays for good."""
        if not self._serving:
            return  # before start: start sets the health, then asks again
        if available:
            log.info("a prefill daemon is back in the pick: SERVING")
            self.rpc.start_serving((DECODE_SERVICE, TRANSFER_SERVICE))
        else:
            log.warning("no prefill daemon is in the pick: NOT_SERVING until one is back")
            self.rpc.set_not_serving((DECODE_SERVICE, TRANSFER_SERVICE))

    @property
    def port(self) -> int:
        """The gRPC port (the one picked when ``port`` was 0)."""
        return self.rpc.port

    @property
    def endpoint(self) -> str:
        return self.rpc.endpoint

    @property
    def metrics_port(self) -> int | None:
        """The port serving /metrics (the one picked when ``metrics_port`` was 0), or None."""
        return self.rpc.metrics_port

    # -- the warm-up request ---------------------------------------------------

    @property
    def warms_up_by_default(self) -> bool:
        """Whether ``lanekv decode`` runs ``warm_up`` unless told: with a GPU pool
        (first use costs milliseconds there; a CPU pool has no kernels to load)."""
        return self.config.resolved_device == "cuda"

    def warm_up(self) -> int:
        """One short greedy request through each prefill daemon in the pick and the
        whole pipeline, as a client's would go, outside our metrics and counts; how
        many went through.

        The first request after start otherwise pays for what is made on first use:
        the prefill daemon's first PrefillStream, the fast path's attach and mapping
        of each rank's pool, the connections to the ranks, the copy and digest
        kernels, the engine's first step. ``lanekv decode`` runs it after its heap
        freeze, before the ready file (on CUDA unless ``--no-warm-up-request``). The
        prefill daemon counts it as a request. One that fails is logged; the daemon
        serves anyway.
        """
        ctx = self.generate
        config = dataclasses.replace(self.config, request_timeout_s=WARM_UP_TIMEOUT_S)
        # Its made-up prompt stays out of both sides' prefix caches and our routing memory: a warm-up
        # leaves the pools, the caches and the picks as it found them.
        pipeline = GeneratePipeline(dataclasses.replace(ctx, config=config, prefix_cache=None, prefix_metrics=None,
                                                        uncached=True))
        # Two pages when the model and the pool allow (a remap across pages), and one decode step.
        tokens = max(1, min(2 * config.page_size, ctx.max_positions - WARM_UP_NEW_TOKENS,
                            config.pool_pages * config.page_size - WARM_UP_NEW_TOKENS))
        ids = [(7 * i + 1) % ctx.vocab_size for i in range(tokens)]
        done = 0
        for target in self.prefills.targets:
            if target.topology is None or not target.healthy:
                continue
            spec = GenerateSpec(f"lanekv-warm-up-{uuid.uuid4().hex[:12]}", ids, SamplingParams(),
                                lanekv_pb2.SamplingParams(), WARM_UP_NEW_TOKENS, ())
            done += self._warm_up_through(pipeline, spec, target)
        return done

    def _warm_up_through(self, pipeline: GeneratePipeline, spec: GenerateSpec, target: PrefillTarget) -> bool:
        caller, code, details = LocalCaller(WARM_UP_TIMEOUT_S), Code.OK, ""
        start, first = time.perf_counter(), None
        call = pipeline.open(spec, counted=False)
        try:
            events = pipeline.run(call, caller, target)
            try:
                for _ in events:
                    if first is None:
                        first = time.perf_counter() - start
            finally:
                events.close()
        except Refusal as refusal:
            code, details = refusal.code, refusal.message
        except Exception as err:  # noqa: BLE001 - a warm-up that fails must not stop the daemon
            log.warning("warm-up request through prefill %s failed", target.endpoint, exc_info=True)
            code, details = Code.INTERNAL, one_line(str(err))
        finally:
            pipeline.close(call, code, details)
        if code != Code.OK:
            log.warning("warm-up request through prefill %s: %s: %s; serving anyway", target.endpoint,
                        code.name, details)
            return False
        paths = dict(caller.metadata).get("lanekv-transfer-paths", "")
        log.info("warm-up request through prefill %s: %d prompt tokens, first token after %.1f ms, "
                 "%d tokens in %.1f ms (transfer %s)", target.endpoint, len(spec.token_ids), first * 1e3,
                 spec.max_new_tokens, (time.perf_counter() - start) * 1e3, paths or "-")
        return True

    # -- streams and the decode loop -----------------------------------------

    def _decode_loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.wait_for_work(_IDLE_WAIT_S):
                continue
            try:
                events = self.engine.step()
            except Exception as err:  # noqa: BLE001 - every step failure is the daemon's: fail-stop
                log.exception("decode step failed: the daemon stops serving")
                self._fail(f"decode step failed: {type(err).__name__}: {one_line(str(err))}")
                return
            if not events:  # requests wait for pages freed by others: do not spin
                self._stop.wait(0.001)
            self.streams.deliver(events)

    # -- accounting -----------------------------------------------------------

    def free_pages(self) -> int:
        return self.pool.free_count

    def stats(self) -> DecodeStats:
        counts = self.streams.counts()
        return DecodeStats(self.pool.free_count, self.pool.num_pages, self.budget.used, *counts)

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _fail(self, reason: str) -> None:
        """Fail-stop after a decode step failed. Requests were checked at admission, so
        the failure is the daemon's (a poisoned CUDA context fails every later step
        too): health turns NOT_SERVING, open streams end UNAVAILABLE (their clients
        retry elsewhere), new calls are refused, and ``failure()`` says why, so
        ``lanekv decode`` exits 1 for its supervisor."""
        self._failure = reason
        self.rpc.health.enter_graceful_shutdown()  # NOT_SERVING for good: a prefill daemon's return cannot undo it
        self._stop.set()
        self.streams.broadcast(DaemonFailed(reason))

    def failure(self) -> str | None:
        """Why the daemon can no longer serve (a decode step failed), or None. A dead
        receiver process is replaced and a prefill daemon that is down fails calls,
        not the daemon."""
        return self._failure

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Drain: say NOT_SERVING, refuse new calls, let open streams finish for
        ``grace_s``, then end them. A second call does nothing.

        An open health Watch is an open call too: it holds the stop for ``grace_s``.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        active = self.streams.counts().active
        drained = self.rpc.drain(grace_s)  # every service NOT_SERVING, for good
        log.info("draining: %d open streams, %.1fs to finish", active, grace_s)
        drained.wait(grace_s + 1.0)
        self._stop.set()
        self.streams.broadcast(SHUTDOWN)  # wake streams still waiting
        self._loop.join(5.0)
        if self.tp is not None:
            self.tp.close(graceful=not self._loop.is_alive())  # STOP to the ranks, unless a step still runs
        self._close_clients()
        self.rpc.close()

    @property
    def nixl(self) -> KVTransport | None:
        """The NIXL transport (``--transport nixl``), or None."""
        fetcher = getattr(self, "fetcher", None)
        return None if fetcher is None else fetcher.transport("nixl")

    def _close_clients(self) -> None:
        if self.prefills is not None:
            self.prefills.close()
        nixl = self.nixl
        if nixl is not None:
            nixl.close()  # the pool's registration and every peer agent
        self.kv.close()
        for channel in self._prefill_channels:
            channel.close()
