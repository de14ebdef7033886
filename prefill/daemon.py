"""The prefill daemon: CP rank processes, the Prefill service, leases.

Layout of the processes:
- this (parent) process serves ``PrefillService.Prefill`` and, on the same
  port, ``KVTransfer.Handshake`` (so a decode daemon checks the contract before
  any request) and the gRPC health service; it owns the lane allocator, the
  leases, and batches concurrent calls into CP batches;
- each CP rank process serves ``KVTransfer`` (Handshake, FetchKV, Release) for
  the pages it owns, on its own port.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from prefill.allocator import OutOfPagesError
from prefill.batcher import Batcher
from prefill.engine_config import EngineConfig
from prefill.launcher import CPPrefillEngine, PrefillInput, PrefillResult, RankDiedError
from prefill.leases import LeaseTable
from prefill.tokenizer import load_tokenizer
from proto import lanekv_pb2, lanekv_pb2_grpc
from transfer.contract import Agreement, LayoutContract, Topology
from transfer.manifest import Manifest
from transfer.requests import prompt_from_proto, request_id_from_proto, sampling_from_proto
from transfer.server import KVTransferService, add_transfer_service
from transfer.status import TRANSFER_SERVICE, Refusal, grpc_options, refusals

log = logging.getLogger("lanekv.prefill")
Code = grpc.StatusCode
PREFILL_SERVICE = "lanekv.v1.PrefillService"


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

    def __post_init__(self) -> None:
        for name in ("port", "transfer_port_base"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {name}={value!r}")
        for name in ("lease_s", "request_timeout_s", "max_batch_tokens", "max_workers"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {name}={getattr(self, name)!r}")
        if self.batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms must be >= 0, got batch_wait_ms={self.batch_wait_ms!r}")


class _ContractOnly:
    """The parent's PageSource: it answers Handshake; pages live on the ranks."""

    def __init__(self, contract: LayoutContract) -> None:
        self._contract = contract
        self.rank = -1

    def contract(self) -> LayoutContract:
        return self._contract

    def pages_of(self, request_id: str) -> list[tuple[int, int]]:
        raise KeyError("pages are served by the owner ranks' endpoints (see the contract topology)")

    def read(self, physical_pages, layer_start, layer_end):
        raise KeyError("no pages here")

    def release(self, request_id: str) -> int:
        raise KeyError("release at the owner ranks' endpoints")


class PrefillDaemon:
    def __init__(self, engine_config: EngineConfig, config: DaemonConfig = DaemonConfig()) -> None:
        self.config = config
        self.engine = CPPrefillEngine(
            engine_config, serve_transfer=(config.host, config.transfer_port_base), on_event=self._on_event
        )
        try:
            self._setup(engine_config)
        except BaseException:
            self.engine.close()
            raise

    def _setup(self, engine_config: EngineConfig) -> None:
        cfg = self.config
        self.agreement = Agreement.decode(self.engine.info["agreement"])
        self.topology = Topology(engine_config.cp_size, "in_seq", "page_mod_cp", tuple(self.engine.endpoints))
        self.contract = LayoutContract(self.agreement, self.topology)
        self.engine._call("topology", self.topology.to_dict())
        model = self.engine.info["model"]
        self.vocab_size = model["vocab_size"]
        self.max_tokens = model["rope"]["max_position_embeddings"]
        self.tokenizer = load_tokenizer(engine_config.model_path)
        self.leases = LeaseTable(self.engine.allocator, cfg.lease_s)
        self._in_flight: set[str] = set()
        self._lock = threading.Lock()
        self.batcher = Batcher(self._run_batch, batch_wait_s=cfg.batch_wait_ms / 1e3,
                               max_batch_tokens=cfg.max_batch_tokens)
        self._stop = threading.Event()
        self._expirer = threading.Thread(target=self._expire_loop, name="lanekv-leases", daemon=True)
        self._expirer.start()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers), options=grpc_options())
        lanekv_pb2_grpc.add_PrefillServiceServicer_to_server(PrefillServicer(self), self.server)
        add_transfer_service(self.server, KVTransferService(_ContractOnly(self.contract)))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        try:
            self.port = self.server.add_insecure_port(f"{cfg.host}:{cfg.port}")
        except RuntimeError as err:
            raise OSError(f"cannot bind the prefill port {cfg.host}:{cfg.port}: {err}") from err
        if self.port == 0:
            raise OSError(f"cannot bind the prefill port {cfg.host}:{cfg.port} (in use?)")
        self.server.start()
        for service in ("", PREFILL_SERVICE, TRANSFER_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("prefill daemon on %s:%d, ranks %s, fingerprint %s", cfg.host, self.port,
                 list(self.topology.endpoints), self.contract.fingerprint[:16])

    @property
    def endpoint(self) -> str:
        return f"{self.config.host}:{self.port}"

    # -- work ----------------------------------------------------------------

    def prefill(self, inp: PrefillInput, timeout_s: float | None = None) -> PrefillResult:
        rid = inp.request_id or uuid.uuid4().hex
        with self._lock:
            if rid in self._in_flight or rid in self.leases:
                raise Refusal(Code.ALREADY_EXISTS, f"request_id={rid!r} is already in use")
            self._in_flight.add(rid)
        try:
            fut = self.batcher.submit(inp._replace(request_id=rid))
            return fut.result(timeout=timeout_s or self.config.request_timeout_s)
        finally:
            with self._lock:
                self._in_flight.discard(rid)

    def _run_batch(self, inputs: list[PrefillInput]) -> list[PrefillResult]:
        results = self.engine.prefill(inputs)
        for res in results:
            self.leases.pin(res.request_id, res.new_pages)
        return results

    def _on_event(self, rank: int, value: Any) -> None:
        kind, request_id, _pages = value
        if kind == "released":
            self.leases.release(request_id, rank)

    def _expire_loop(self) -> None:
        while not self._stop.wait(0.25):
            for request_id, _ranks in self.leases.expire():
                log.info("lease of %s expired; pages freed", request_id)
                # Every rank recorded the id (a rank may hold none of its pages),
                # so every rank forgets it, or a reuse of the id would clash there.
                self.engine.send("forget", request_id, range(self.engine.config.cp_size))

    def stop(self, grace_s: float = 5.0) -> None:
        """Drain: stop accepting calls, finish what is queued, stop the ranks."""
        for service in ("", PREFILL_SERVICE, TRANSFER_SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        stopped = self.server.stop(grace_s)
        self.batcher.close(grace_s)
        stopped.wait(grace_s)
        self._stop.set()
        self._expirer.join(1.0)
        self.engine.close()


class PrefillServicer(lanekv_pb2_grpc.PrefillServiceServicer):
    def __init__(self, daemon: PrefillDaemon) -> None:
        self.d = daemon

    def Prefill(self, request, context):
        d = self.d
        with refusals(context):
            ids = prompt_from_proto(request, d.tokenizer, d.vocab_size, d.max_tokens)
            inp = PrefillInput(ids, sampling_from_proto(request.sampling), (), request_id_from_proto(request))
            remaining = context.time_remaining()
            try:
                res = d.prefill(inp, timeout_s=remaining)
            except OutOfPagesError as err:
                raise Refusal(Code.RESOURCE_EXHAUSTED, f"prefill pool: {err}") from err
            except RankDiedError as err:
                raise Refusal(Code.UNAVAILABLE, f"prefill ranks are down: {err}") from err
            except futures.TimeoutError as err:
                raise Refusal(Code.DEADLINE_EXCEEDED, "prefill did not finish within the deadline") from err
            manifest = Manifest(res.request_id, res.page_size, res.num_tokens,
                                tuple((p.page, p.owner, p.valid_rows) for p in res.pages))
        return lanekv_pb2.PrefillReply(
            request_id=res.request_id,
            first_token=res.first_token,
            contract_fingerprint=d.contract.fingerprint,
            manifest=manifest.encode(),
            endpoints=list(d.topology.endpoints),
            timings=res.timings,
        )
