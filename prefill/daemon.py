"""The prefill daemon: CP rank processes, leases, and the Prefill service's daemon side
(the calls themselves are ``prefill.service``'s).

Layout of the processes:
- this (parent) process serves ``PrefillService.Prefill`` and, on the same
  port, ``KVTransfer.Handshake`` (so a decode daemon checks the contract before
  any request) and the gRPC health service; it owns the lane allocator, the
  leases, and batches concurrent calls into CP batches;
- each CP rank process serves ``KVTransfer`` (Handshake, FetchKV, Release) for
  the pages it owns, on its own port.

Its port, health, metrics endpoint and drain are ``runtime.daemon.DaemonServer``'s.
Every port speaks the daemon's ``SecurityConfig`` (TLS, mutual TLS, the token;
health stays open). The parent owns the metrics: its own calls, and what the
ranks report through their event queue (their calls by code, the bytes and
time of every finished FetchKV stream); ``metrics_port`` serves them.
Request log lines read ``<what> request_id=<id> key=value ...`` and carry
``request_id`` as a record attribute too.

Each start of the daemon has its own ``epoch`` (a random id). Prefill hands
it out in its trailing metadata (``lanekv-epoch``); the ranks refuse a
FetchKV or Release that carries another start's epoch with
FAILED_PRECONDITION. Each request gets an unguessable capability (256 random
bits, ``PrefillReply.capability``), known to its ranks only as a digest:
FetchKV (descriptors too) and Release must present ``<epoch>:<capability>``,
else NOT_FOUND, the answer an unknown id gets. And a request id of an old start is unknown to a new
one (NOT_FOUND), so a restarted daemon on the same ports never serves its
pages for an old request. A rank process that dies makes the engine
unusable, and the engine notices at once (it watches the rank processes):
health says NOT_SERVING within milliseconds, every Prefill in flight or
queued ends UNAVAILABLE naming the rank (its pages go back to the lanes), and
``failure()`` names the rank; ``lanekv prefill`` then exits with status 1
and that line (``runtime.daemon.serve_until_signal``), for the orchestrator
to restart it.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent import futures
from dataclasses import dataclass

import grpc
from lanekv.model.config import ModelConfig
from lanekv.model.grammar import Grammars
from lanekv.model.tokenizer import load_tokenizer
from lanekv.prefill.batcher import Batcher
from lanekv.prefill.cp.launcher import CPPrefillEngine, PrefillInput, PrefillResult
from lanekv.prefill.cp.messages import Event, Fetched, Released, RpcTotals
from lanekv.prefill.cp.rank_worker import TransferServing
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.leases import LeaseTable
from lanekv.prefill.prefix_cache import PrefillPrefixCache
from lanekv.prefill.service import PrefillServicer
from lanekv.prefill.warmup import settle_after_freeze, warm_up
from lanekv.proto import lanekv_pb2_grpc
from lanekv.runtime.advertise import check_advertise_host
from lanekv.runtime.daemon import DaemonServer
from lanekv.runtime.metrics import PrefixMetrics
from lanekv.runtime.security import SecurityConfig
from lanekv.runtime.status import TRANSFER_SERVICE, Refusal
from lanekv.transfer.protocol.access import new_capability
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.contract import LayoutContract, Topology
from lanekv.transfer.rank.server import add_transfer_service
from lanekv.transfer.rank.service import KVTransferService
from lanekv.transfer.rank.sources import ContractOnlySource

log = logging.getLogger("lanekv.prefill")
Code = grpc.StatusCode
PREFILL_SERVICE = "lanekv.v1.PrefillService"
STOP_GRACE_S = 5.0  # what a stop gives open calls and queued prefills by default


@dataclass(frozen=True)
class DaemonConfig:
    host: str = "127.0.0.1"
    port: int = 0  # Prefill + Handshake; 0 picks a free port
    transfer_port_base: int = 0  # rank r serves KVTransfer on base + r; 0 picks free ports
    lease_s: float = 60.0  # pages stay pinned this long unless released first
    batch_wait_ms: float = 2.0
    max_batch_tokens: int = 65536
    max_workers: int = 32
    request_timeout_s: float = 600.0
    metrics_port: int | None = None  # GET /metrics on host; None: off, 0: a free port
    security: SecurityConfig = SecurityConfig()  # every port: the parent's and the ranks'
    # The host peers are told (the ranks' endpoints, the ready file); None: the bind
    # host, or for a wildcard bind this host's primary address (runtime.advertise).
    advertise_host: str | None = None
    prefix_cache: bool = True  # cache whole prompt pages (prefill.prefix_cache); False: compute every prompt
    prefix_cache_share: float = 1.0  # at most this share of the pool's pages cached

    def __post_init__(self) -> None:
        for name in ("port", "transfer_port_base"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {name}={value!r}")
        if self.metrics_port is not None and (
            isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
            or not 0 <= self.metrics_port <= 65535
        ):
            raise ValueError(f"metrics_port must be None or in [0, 65535], got metrics_port={self.metrics_port!r}")
        for name in ("lease_s", "request_timeout_s", "max_batch_tokens", "max_workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {name}={getattr(self, name)!r}")
        if isinstance(self.prefix_cache_share, bool) or not isinstance(self.prefix_cache_share, (int, float)) \
                or not 0 <= self.prefix_cache_share <= 1:
            raise ValueError(f"prefix_cache_share must be in [0, 1], got prefix_cache_share={self.prefix_cache_share!r}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got batch_wait_ms={self.batch_wait_ms!r}")
        if not isinstance(self.security, SecurityConfig):
            raise TypeError(f"security must be a SecurityConfig, got security={self.security!r}")
        check_advertise_host(self.advertise_host)


class PrefillDaemon:
    def __init__(self, engine_config: EngineConfig, config: DaemonConfig = DaemonConfig()) -> None:
        self.config = config
        self._rank_calls: dict[int, dict[tuple[str, str, str], float]] = {}  # the ranks' last totals
        self._stopped = False
        self._failure: str | None = None  # why the ranks are down, once they are
        self._lock = threading.Lock()
        # This start of the daemon: its ranks refuse FetchKV and Release naming another
        # one, so pages of a restarted daemon never answer for a request of an old start.
        self.epoch = uuid.uuid4().hex
        # Ports first: a busy one fails before any rank process starts.
        self.rpc = DaemonServer(config.security, config.host, config.port, config.max_workers, config.metrics_port,
                                config.advertise_host)
        self.registry, self.metrics = self.rpc.registry, self.rpc.metrics
        try:
            serving = TransferServing(config.host, config.transfer_port_base, config.security, self.epoch,
                                      self.rpc.advertised.host)
            self.engine = CPPrefillEngine(engine_config, serve_transfer=serving, on_event=self._on_event,
                                          on_broken=self.ranks_down)
        except BaseException:
            self.rpc.close()
            raise
        try:
            self._setup(engine_config)
        except BaseException:
            self.engine.close()
            self.rpc.close()
            raise

    def _setup(self, engine_config: EngineConfig) -> None:
        cfg = self.config
        self.agreement = Agreement.decode(self.engine.info.agreement)
        self.topology = Topology(engine_config.cp_size, "in_seq", "page_mod_cp", tuple(self.engine.endpoints),
                                 head_ranges=True)
        self.contract = LayoutContract(self.agreement, self.topology)
        self.relays = [tuple(r) for r in getattr(self.engine, "relays", ())]  # each rank's sender relays
        self.engine.set_topology(self.topology)
        model = self.engine.info.model
        self.vocab_size = model["vocab_size"]
        self.max_tokens = model["rope"]["max_position_embeddings"]
        self.tokenizer = load_tokenizer(engine_config.model_path)
        # Structured output: the first token's mask of each request with a grammar.
        self.grammars = None if self.tokenizer is None else Grammars(
            self.tokenizer.backend, self.vocab_size, ModelConfig.from_dir(engine_config.model_path).eos_token_ids)
        if engine_config.resolved_device == "cuda":  # compile before serving, not on a request
            warm_up(self.engine, self.vocab_size, self.max_tokens, cfg.max_batch_tokens,
                    forget=self.engine.forget)
        # What start-up made lives as long as a rank: no collection walks it again.
        log.info("garbage collector: froze %s objects in the rank processes", self.engine.freeze_heap())
        self.settle()
        allocator = self.engine.allocator
        # Keyed by the agreement's fingerprint: another model, layout or build never matches.
        self.cache = PrefillPrefixCache(allocator, engine_config.page_size, self.agreement.fingerprint,
                                        enabled=cfg.prefix_cache,
                                        max_pages=int(allocator.num_pages * cfg.prefix_cache_share))
        self.leases = LeaseTable(self.cache, cfg.lease_s)  # a lease's pages go back through their references
        self._prefix_held: dict[str, list[int]] = {}  # request id -> matched prefix pages, until its lease holds them
        self._watch_pools()
        self._in_flight: dict[str, futures.Future] = {}  # request id -> future of its pages
        self.batcher = Batcher(self._run_batch, batch_wait_s=cfg.batch_wait_ms / 1e3,
                               max_batch_tokens=cfg.max_batch_tokens)
        self._stop = threading.Event()
        self._expirer = threading.Thread(target=self._expire_loop, name="lanekv-leases", daemon=True)
        self._expirer.start()
        server = self.rpc.server
        lanekv_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), server)
        add_transfer_service(server, KVTransferService(
            ContractOnlySource(self.contract, "pages are served by the owner ranks' endpoints (see the contract topology)")
        ))
        self.rpc.start((PREFILL_SERVICE, TRANSFER_SERVICE))
        if self.failure() is not None:  # a rank died while the daemon was starting
            self.rpc.set_not_serving((PREFILL_SERVICE, TRANSFER_SERVICE))
        log.info("prefill daemon on %s, ranks %s, fingerprint %s, epoch %s, %s", self.endpoint,
                 list(self.topology.endpoints), self.contract.fingerprint[:16], self.epoch, self.rpc.describe())

    def _watch_pools(self) -> None:
        """Pool gauges read at every scrape: each lane's free and used pages, and the leases held."""
        allocator, m = self.engine.allocator, self.metrics
        for lane in range(allocator.cp_size):
            m.pool_pages_free.labels(rank=lane).set_function(lambda lane=lane: allocator.free_counts()[lane])
            m.pool_pages_used.labels(rank=lane).set_function(
                lambda lane=lane: allocator.pages_per_lane - allocator.free_counts()[lane])
        self.registry.gauge("lanekv_prefill_leases", "requests whose pages are pinned for a decode side").set_function(
            lambda: len(self.leases.held()))
        self.metrics_prefix = PrefixMetrics.on(self.registry, "prefill", lambda: self.cache.stats.evicted_pages)
        self.registry.gauge("lanekv_prefix_cache_pages", "pages the prefix cache holds (idle or in use)").set_function(
            lambda: self.cache.cached_pages)

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

    # -- work ----------------------------------------------------------------

    def submit(self, inp: PrefillInput) -> tuple[str, futures.Future, futures.Future]:
        """Queue a prefill: its request id, a future of its pages (set once every
        rank can serve them, before the prefill runs) and a future of its result."""
        rid = inp.request_id or uuid.uuid4().hex
        started: futures.Future = futures.Future()
        with self._lock:
            if self._stopped:
                raise Refusal(Code.UNAVAILABLE, "the prefill daemon is shutting down")
            if rid in self._in_flight or rid in self.leases:
                raise Refusal(Code.ALREADY_EXISTS, f"request_id={rid!r} is already in use")
            self._in_flight[rid] = started
        # The cached prefix: its pages are referenced for this request from here on.
        # Prompt logprobs need every prompt row's logits: such a prompt is prefilled whole.
        prefix = []
        if inp.prefix_cache and inp.prompt_logprobs is None:
            prefix = self.cache.match(inp.token_ids)
            self._count_lookup(len(inp.token_ids), len(prefix) * self.cache.page_size)
        with self._lock:
            self._prefix_held[rid] = prefix
        # Its ranks serve the pages only to a caller presenting this (PrefillReply.capability).
        done = self.batcher.submit(inp._replace(request_id=rid, capability=new_capability(), prefix_pages=prefix))

        def finished(_: futures.Future) -> None:
            with self._lock:
                self._in_flight.pop(rid, None)
                unpinned = self._prefix_held.pop(rid, None)  # its lease never took them over
            if unpinned:
                self.cache.free(unpinned)

        done.add_done_callback(finished)
        return rid, started, done

    def _run_batch(self, inputs: list[PrefillInput]) -> list[PrefillResult]:
        pinned: list[str] = []

        def started(results: list[PrefillResult]) -> None:
            # Pinned before any decode side hears of the pages: a Release may come before the prefill ends.
            for res in results:
                # The lease holds the whole request: the cached prefix (referenced at the
                # match) and the new pages (referenced here) go back through the cache.
                self.cache.hold(res.new_pages)
                self.leases.pin(res.request_id, [p.page for p in res.pages])
                pinned.append(res.request_id)
                with self._lock:
                    self._prefix_held.pop(res.request_id, None)
            with self._lock:
                waiting = [(self._in_flight.get(res.request_id), res) for res in results]
            for fut, res in waiting:
                if fut is not None and not fut.done():
                    fut.set_result(res)

        try:
            results = self.engine.prefill(inputs, on_started=started)
        except BaseException:
            for rid in pinned:  # the ranks forgot the request; free what no Release freed yet
                self.leases.cancel(rid)
            raise
        for inp, res in zip(inputs, results):
            self.leases.renew(res.request_id)  # the lease counts from the end of the prefill
            if not inp.prefix_cache:
                continue
            # Every layer of every rank is written: the prompt's full pages may serve later hits.
            self.leases.while_held(res.request_id, lambda held, inp=inp, res=res: self.cache.insert(
                inp.token_ids, _leading([p.page for p in res.pages], held)))
            res.prefix_cache_pages = self.cache.peek(inp.token_ids)  # what a router may remember
        return results

    def _count_lookup(self, num_tokens: int, hit_tokens: int) -> None:
        self.metrics_prefix.lookup_tokens.inc(num_tokens)
        self.metrics_prefix.hit_tokens.inc(hit_tokens)

    def _on_event(self, event: Event) -> None:
        """What a rank reports (run in the engine's reader thread, one event at a time)."""
        rank = event.rank
        if isinstance(event, Released):
            request_id = event.request_id
            freed = self.leases.release(request_id, rank)
            log.debug("released request_id=%s rank=%d pages=%d", request_id, rank, freed,
                      extra={"request_id": request_id})
            if freed and request_id not in self.leases:
                log.info("released request_id=%s (every rank)", request_id, extra={"request_id": request_id})
        elif isinstance(event, Fetched):
            nbytes, seconds = event.nbytes, event.seconds
            self.metrics.record_transfer({rank: nbytes}, seconds)
            log.info("transfer done request_id=%s rank=%d bytes=%d seconds=%.4f gbps=%.3f", event.request_id,
                     rank, nbytes, seconds, nbytes / seconds / 1e9 if seconds > 0 else 0.0,
                     extra={"request_id": event.request_id})
        elif isinstance(event, RpcTotals):
            self._add_rank_calls(rank, event.totals)

    def _add_rank_calls(self, rank: int, totals: dict[tuple[str, str, str], float]) -> None:
        last = self._rank_calls.get(rank, {})
        for (service, method, code), total in totals.items():
            grown = total - last.get((service, method, code), 0.0)
            if grown > 0:
                self.metrics.requests.labels(service=service, method=method, code=code).inc(grown)
        self._rank_calls[rank] = dict(totals)

    def ranks_down(self, reason: str) -> None:
        """A rank died: the engine serves no more, so health says NOT_SERVING and
        ``failure`` names the rank (once; the engine's watcher calls this)."""
        with self._lock:
            if self._failure is not None or self._stopped:
                return
            self._failure = reason
        log.error("prefill ranks are down, NOT_SERVING until restarted: %s", reason)
        self.rpc.set_not_serving((PREFILL_SERVICE, TRANSFER_SERVICE))

    def settle(self) -> None:
        """One short prefill, after a freeze of the heap (``prefill.warmup.settle_after_freeze``):
        start-up runs it once the ranks froze theirs, ``serve_until_signal`` once this process did."""
        settle_after_freeze(self.engine, self.vocab_size, self.engine.forget)

    def failure(self) -> str | None:
        """Why this daemon can serve no more (a rank died), or None while it can."""
        with self._lock:
            return self._failure

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.25):
            for request_id, ranks in self.leases.expire():
                self.metrics.failures.labels(cause="lease_expired").inc()
                log.warning("lease expired request_id=%s ranks=%s: pages freed without a release",
                            request_id, ranks, extra={"request_id": request_id})
                # Every rank recorded the id (a rank may hold none of its pages),
                # so every rank forgets it, or a reuse of the id would clash there.
                self.engine.forget(request_id)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Drain: say NOT_SERVING, refuse new calls, finish what is queued, stop the ranks.

        A second call does nothing. An open health Watch is an open call too:
        it holds the stop for ``grace_s``.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        stopped = self.rpc.drain(grace_s)  # every service NOT_SERVING, for good
        log.info("draining: %d prefills in flight, %d leases held", len(self._in_flight), len(self.leases.held()))
        self.batcher.close(grace_s)
        stopped.wait(grace_s)
        self._stop.set()
        self._expirer.join(1.0)
        self.engine.close()
        self.rpc.close()


def _leading(pages: list[int], held: set[int]) -> list[int]:
    """The pages before the first one the request no longer holds (a rank released it)."""
    for k, page in enumerate(pages):
        if page not in held:
            return pages[:k]
    return pages
