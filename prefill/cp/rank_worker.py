"""The body of one CP rank process: join the group, load the model, serve commands.

A rank runs the parent's commands (``prefill.cp.messages``) one at a time in
the order sent and answers each ``Call`` once, on the shared result queue;
a failure becomes a ``Failed`` with its traceback, never a dead loop. A rank
serving transfers registers a batch's pages (``Registered``) before it
prefills, and reports releases, finished fetches and its call counts as
events. It exits on ``Shutdown`` or once its parent is gone, stopping its
transfer server and removing its /dev/shm pool (mappings held elsewhere stay
valid); a rank process then ends without the interpreter's finalization
(``rank_process_main``), which would only free memory the OS takes back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import grpc
import torch
import torch.distributed as dist
from lanekv.model.attention import pool_contract_fields, pool_rows
from lanekv.model.checkpoint import LoadedModel
from lanekv.model.config import ModelConfig
from lanekv.model.parallel.ep import ExpertExchange, attach_expert_exchange
from lanekv.model.parallel.rendezvous import join_store
from lanekv.model.parallel.tp import weight_bytes
from lanekv.model.parallel.weights_digest import WeightsDigest, WeightsSource
from lanekv.prefill.cp.gemm_warmup import warm_gemms
from lanekv.prefill.cp.messages import (
    Answer,
    Call,
    CaptureGraphs,
    Command,
    Failed,
    Fetched,
    Forget,
    FreezeHeap,
    RankInfo,
    ReadPages,
    Ready,
    Registered,
    Released,
    RpcTotals,
    RunPrefill,
    SetTopology,
    Shutdown,
    Snapshot,
    TileRows,
    WarmGemms,
    Weights,
)
from lanekv.prefill.cp.page_source import RankPageSource
from lanekv.prefill.cp.runner import PrefillBatch, RankProcess, RankRunner
from lanekv.prefill.cp.tile_rows import tile_switch_rows
from lanekv.prefill.engine_config import EngineConfig, load_for
from lanekv.prefill.layout import OwnerLaneLayout
from lanekv.runtime.advertise import join_host_port
from lanekv.runtime.gcpause import GcClock, exit_at_once, freeze_start_up, thaw
from lanekv.runtime.hostmem import keep_freed_buffers
from lanekv.runtime.metrics import Registry
from lanekv.runtime.rpc_metrics import lanekv_metrics
from lanekv.runtime.security import SecurityConfig
from lanekv.runtime.shmfiles import pool_file_name
from lanekv.runtime.status import TRANSFER_SERVICE, bounded, one_line
from lanekv.transfer.nixl.export import NixlExport
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.descriptors import (
    SHM_DIR,
    remove_shared_pool,
    shared_cpu_pool,
    shm_room,
)
from lanekv.transfer.rank.progress import LayerProgress
from lanekv.transfer.rank.relay import RelayProcesses, RelaySpec
from lanekv.transfer.rank.server import Served, serve
from lanekv.transfer.rank.staging import RankStaging, staged_mode

# A test hook: ``<layer>:<seconds>`` makes every prefill sleep once that layer is written.
SLOW_LAYER_ENV = "LANEKV_SLOW_LAYER"
# How often an idle rank checks that its parent is still alive (and reports its call counts).
_POLL_S = 1.0
# A stopping rank lets open FetchKV streams finish this long.
_STOP_GRACE_S = 1.0
# What a rank's server answers; RpcMetricsInterceptor counts unknown methods as 'unknown'.
_RANK_METHODS = (
    *((TRANSFER_SERVICE, method) for method in ("Handshake", "FetchKV", "Release", "AttachPool", "StageKV")),
    ("grpc.health.v1.Health", "Check"),
    ("grpc.health.v1.Health", "Watch"),
    ("unknown", "unknown"),
)


class TransferServing(NamedTuple):
    """How each rank serves KVTransfer: rank r binds ``host:port_base + r`` (any free port when 0).

    ``epoch`` names this start of the prefill daemon; FetchKV and Release that
    name another start are refused (``transfer.protocol.access.EPOCH_METADATA_KEY``).
    ``advertise``: the host the rank's endpoint names for peers (None: ``host``;
    the daemon picks it, ``runtime.advertise``, so a wildcard bind is never advertised).
    """

    host: str
    port_base: int
    security: SecurityConfig = SecurityConfig()
    epoch: str | None = None
    advertise: str | None = None


class RpcReporter:
    """A rank's gRPC calls by method and code, sent to the parent as running totals.

    The rank's server counts into its own registry (nobody scrapes a rank);
    ``report`` sends ``RpcTotals`` through the result queue whenever the
    totals changed, and the parent adds the differences to its own
    ``lanekv_requests_total``.
    """

    def __init__(self, rank: int, results: Any) -> None:
        self._rank, self._results = rank, results
        self._metrics = lanekv_metrics(Registry())
        self._sent: dict[tuple[str, str, str], float] = {}

    def interceptor(self) -> grpc.ServerInterceptor:
        return self._metrics.interceptor()

    def report(self) -> None:
        totals = {}
        for service, method in _RANK_METHODS:
            for code in grpc.StatusCode:
                value = self._metrics.requests.labels(service=service, method=method, code=code.name).value
                if value:
                    totals[service, method, code.name] = value
        if totals != self._sent:
            self._sent = totals
            self._results.put(RpcTotals(self._rank, totals))


def shared_pool_path(config: EngineConfig, serve_transfer: TransferServing | tuple[str, int] | None,
                     rank: int) -> Path | None:
    """Where rank ``rank`` keeps a CPU pool in /dev/shm so that a decode daemon of this
    host reads it in place (AttachPool); None where it will not (a GPU pool, no
    transfer service, no /dev/shm). The launcher names it, so that it can remove
    the file of a rank that died without doing so itself; the name carries the
    daemon's start (epoch) and the launcher's pid as its owner, so a daemon
    starting after both died reclaims it (``runtime.shmfiles.reclaim_stale``)."""
    if serve_transfer is None or config.resolved_device == "cuda" or not SHM_DIR.is_dir():
        return None
    epoch = TransferServing(*serve_transfer).epoch or uuid.uuid4().hex
    return SHM_DIR / pool_file_name(epoch, rank, uuid.uuid4().hex[:8])


def rank_main(
    rank: int,
    config: EngineConfig,
    port: int,
    commands: Any,
    results: Any,
    serve_transfer: TransferServing | tuple[str, int] | None = None,
    shared_path: Path | None = None,
) -> None:
    parent = os.getppid()
    # A rank stops when its parent says Shutdown (after its drain), or once the parent is
    # gone; a SIGINT/SIGTERM to the whole process group (Ctrl-C, an orchestrator's stop)
    # is the parent's to handle, not a rank death to report as an ERROR.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    reporter = None
    try:
        serving = None
        if serve_transfer is not None:
            reporter = RpcReporter(rank, results)
            serving = _TransferServer(config, rank, TransferServing(*serve_transfer), results, reporter)
        weights = None
        if config.load_format == "safetensors":  # the parent computes the digest once for every rank
            weights = lambda: _await_weights(commands, parent, config.start_timeout_s)  # noqa: E731
        runner = _start(rank, config, port, shared_path, serving, weights)
        info = describe(runner, config)
        if serving is not None:
            info = serving.described(runner.process, info)
        results.put(Ready(rank, info))
    except Exception as err:  # report start-up failures to the parent, then exit
        if not isinstance(err, _ToldToStop):
            results.put(Failed(rank, None, _reported(rank, err)))
        if serving is not None:
            serving.close_relays()
            serving.close_staging()
        remove_shared_pool(shared_path)
        return
    try:
        while True:
            if reporter is not None:
                reporter.report()
            try:
                call: Call = commands.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent:  # orphaned: the launcher is gone
                    return
                continue
            if isinstance(call.command, Shutdown):
                return

            def registered(seq: int = call.seq) -> None:
                results.put(Registered(rank, seq))

            try:
                results.put(Answer(rank, call.seq, handle(runner, call.command, registered)))
            except Exception as err:
                results.put(Failed(rank, call.seq, _reported(rank, err)))
    finally:
        if serving is not None:
            serving.close_relays()  # no relay outlives its rank
        served = runner.process.transfer_server
        if served is not None:
            served.stop(_STOP_GRACE_S)
        if serving is not None:
            serving.close_staging()  # after the server: no StageKV writes into them any more
        if serving is not None and serving.nixl is not None:
            serving.nixl.close()  # the pool's registration, after the last FetchKV ended
        if dist.is_initialized():
            dist.destroy_process_group()
        remove_shared_pool(shared_path)  # mappings a decode daemon holds stay valid
        thaw()  # the interpreter's last collections free what FreezeHeap kept


def rank_process_main(
    rank: int,
    config: EngineConfig,
    port: int,
    commands: Any,
    results: Any,
    serve_transfer: TransferServing | tuple[str, int] | None = None,
    shared_path: Path | None = None,
) -> NoReturn:
    """``rank_main`` as the whole life of a rank process (the launcher's target): once it
    returns (transfer server stopped, relays gone, pool file removed), the process ends
    without the interpreter's finalization (``runtime.gcpause.exit_at_once``). An exception
    still ends it the usual way (its traceback, exit code 1)."""
    rank_main(rank, config, port, commands, results, serve_transfer, shared_path)
    exit_at_once(results)


class _ToldToStop(Exception):
    """The parent said Shutdown during start-up (its own start failed): exit, report nothing."""


def _await_weights(commands: Any, parent: int, timeout_s: float) -> WeightsDigest:
    """The weights digest the parent sends once it is computed (the first item of the queue)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            item = commands.get(timeout=_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                raise _ToldToStop("the parent is gone") from None
            continue
        if isinstance(item, Weights):
            return item.digest
        if isinstance(item, Call) and isinstance(item.command, Shutdown):
            raise _ToldToStop("Shutdown")
        raise TypeError(f"the first item of a rank's queue must be Weights, got item={item!r}")
    raise TimeoutError(f"no weights digest from the parent within start_timeout_s={timeout_s}")


def _start(rank: int, config: EngineConfig, port: int, shared_path: Path | None,
           serving: _TransferServer | None, weights: WeightsSource | None = None) -> RankRunner:
    device = torch.device(config.resolved_device, rank) if config.resolved_device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # The host only builds small index tensors here: a pool of CPU threads per op
        # cost more than the op (BENCHMARKS.md: a 1k-token prefill's index build).
        torch.set_num_threads(1)
    else:
        threads = config.cpu_threads or max(1, (os.cpu_count() or 1) // config.cp_size)
        torch.set_num_threads(threads)
    group = None
    if config.cp_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=join_store(port, config.start_timeout_s),
            rank=rank,
            world_size=config.cp_size,
            timeout=timedelta(seconds=config.request_timeout_s),
            **({"device_id": device} if device.type == "cuda" else {}),
        )
        group = dist.group.WORLD
    loaded = load_for(config, device, rank, weights)  # the digest asked after the read: computed meanwhile
    exchange = None
    if config.ep and group is not None:  # each MoE layer dispatches its rows to the experts' owners (all-to-all)
        exchange = attach_expert_exchange(loaded.model, group, capturable=config.ep_dispatch == "capturable")
    clock = GcClock().install()  # this process's collections, timed per prefill
    return build_runner(loaded, config, rank, group, shared_path, gc_clock=clock, serving=serving,
                        exchange=exchange)


def build_runner(loaded: LoadedModel, config: EngineConfig, rank: int, group: Any,
                 shared_path: Path | None = None, *, gc_clock: GcClock | None = None,
                 serving: _TransferServer | None = None, exchange: ExpertExchange | None = None,
                 ) -> RankRunner:
    """A rank's runner: the loaded model and a fresh owner-lane pool on its device
    (a CPU pool in the /dev/shm file ``shared_path`` when given), with its process state
    built once (``RankProcess``): ``serving`` starts the KVTransfer server over the pool;
    ``exchange``: its MoE layers' EP exchange, told each forward's rows per rank."""
    cfg = loaded.config
    device = next(loaded.model.parameters()).device
    layout = pool_rows(cfg, config.torch_dtype, config.index_cache_dtype, config.kv_cache_dtype)
    shape = layout.pool_shape(cfg.num_layers, config.pages_per_lane * config.page_size)
    nbytes = math.prod(shape) * layout.dtype.itemsize
    # a byte pool (FP8 rows) poisoned with NaN holds 0xFF bytes: e4m3 NaN, a NaN scale
    fill = 255 if layout.dtype == torch.uint8 and math.isnan(config.pool_fill) else config.pool_fill
    if shared_path is not None and device.type == "cpu" and shm_room(shared_path.parent) >= nbytes:
        pool = shared_cpu_pool(shared_path, shape, layout.dtype, fill)
    else:  # a GPU pool (shared by CUDA IPC), or a /dev/shm too small: a private pool, served over gRPC only
        shared_path = None
        pool = torch.full(shape, fill, dtype=layout.dtype, device=device)
    page_source = server = None
    if serving is not None:
        page_source, server = serving.start(cfg, loaded.weights_digest, pool, shared_path)
    process = RankProcess(loaded.weights_digest, loaded.tokenizer, shared_path, gc_clock, page_source, server)
    logging.getLogger("lanekv.prefill").info(
        "prefill rank %d of %d holds %.1f MiB of weights%s and a %.1f MiB KV pool (%d pages)", rank,
        config.cp_size, weight_bytes(loaded.model) / 2**20, " (its share of the experts)" if config.ep else "",
        nbytes / 2**20, config.pages_per_lane)
    return RankRunner(
        loaded.model, pool, cp_rank=rank, cp_size=config.cp_size, page_size=config.page_size, group=group,
        rows=layout, process=process, exchange=exchange,
    )


def describe(runner: RankRunner, config: EngineConfig) -> RankInfo:
    return RankInfo(
        model=pool_contract_fields(runner.model.config, config.torch_dtype, config.index_cache_dtype,
                                   config.kv_cache_dtype),
        weights_digest=runner.process.weights_digest,
        pool_shape=tuple(runner.pool.shape),
        device=str(runner.device),
    )


def handle(runner: RankRunner, command: Command, registered: Callable[[], None] | None = None) -> Any:
    """Run one command on this rank; what it answers (see ``prefill.cp.messages``)."""
    if isinstance(command, RunPrefill):
        return _prefill(runner, command.batch, registered)
    if isinstance(command, SetTopology):
        runner.process.page_source.set_topology(command.topology)
        return None
    if isinstance(command, Forget):
        runner.process.page_source.forget(command.request_id)
        return None
    if isinstance(command, ReadPages):
        layout: OwnerLaneLayout = runner.layout
        pages = torch.tensor(command.pages, dtype=torch.int64)
        ps = runner.page_size
        locs = (pages[:, None] * ps + torch.arange(ps)).flatten()
        rows = layout.physical_rows(runner.cp_rank, locs).to(runner.device)
        return runner.pool[:, :, rows].cpu()
    if isinstance(command, Snapshot):
        return runner.pool.cpu()
    if isinstance(command, FreezeHeap):
        return freeze_start_up()
    if isinstance(command, WarmGemms):
        return warm_gemms(runner.model, runner.page_size, command.max_rows)
    if isinstance(command, CaptureGraphs):
        return runner.capture_graphs(command.max_rows)
    if isinstance(command, TileRows):
        return tile_switch_rows(runner.model.config, runner.model.dtype, runner.device)
    raise TypeError(f"command must be one of prefill.cp.messages' commands, got command={command!r}")


def _prefill(runner: RankRunner, batch: PrefillBatch, registered: Callable[[], None] | None) -> Any:
    """Pin this rank's pages of each request for FetchKV, say so (``registered``),
    then prefill: FetchKV sends each layer once it is written."""
    source = runner.process.page_source
    progress = None
    if source is not None:
        n = runner.cp_size
        progress = LayerProgress(runner.model.config.num_layers, runner.device)
        capabilities = batch.capabilities or (None,) * len(batch.request_ids)
        # A cached prefix's pages too: a decode side that lacks them fetches them with the rest.
        for rid, prefix, pages, capability in zip(batch.request_ids, batch.prefix_pages, batch.extend_pages,
                                                  capabilities):
            source.add(rid, [(p, p // n) for p in (*prefix, *pages) if p % n == runner.cp_rank], progress,
                       capability)
    if registered is not None:
        registered()

    slow_layer, slow_s = _slowed_layer()

    def written(layer: int) -> None:
        source.digest_written(batch.request_ids, layer)  # queued before the layer's event
        progress.layer_written(layer)
        if layer == slow_layer:
            time.sleep(slow_s)

    try:
        result = runner.run(batch, None if progress is None else written)
    except BaseException as err:
        if progress is not None:
            progress.fail(f"rank {runner.cp_rank}: {type(err).__name__}: {err}")
            for rid in batch.request_ids:
                source.forget(rid)
        raise
    return result


def _slowed_layer() -> tuple[int, float]:
    """The test hook ``LANEKV_SLOW_LAYER=<layer>:<seconds>``: the prefill sleeps that long
    once the layer is written, so a test sees what the transfer does meanwhile; (-1, 0)
    when unset. A malformed value is a ValueError naming it."""
    value = os.environ.get(SLOW_LAYER_ENV, "")
    if not value:
        return -1, 0.0
    layer, _, seconds = value.partition(":")
    try:
        parsed = int(layer), float(seconds)
    except ValueError as err:
        raise ValueError(f"{SLOW_LAYER_ENV} must be '<layer>:<seconds>', got {value!r}") from err
    if parsed[0] < 0 or not 0 <= parsed[1] <= 60:
        raise ValueError(f"{SLOW_LAYER_ENV} must name a layer >= 0 and 0-60 seconds, got {value!r}")
    return parsed


class _TransferServer:
    """Starts a rank's KVTransfer server over its own pool, once its model is loaded.

    Releases and finished fetches go to the parent as ``Released`` and ``Fetched`` events.
    """

    def __init__(self, config: EngineConfig, rank: int, where: TransferServing, results: Any,
                 reporter: RpcReporter) -> None:
        self._config, self._rank, self._where, self._results, self._reporter = config, rank, where, results, reporter
        self._agreement: Agreement | None = None
        self.nixl: NixlExport | None = None  # the pool offered over NIXL, once started
        self.relays: RelayProcesses | None = None  # its sender relays, once started
        self.staging: RankStaging | None = None  # its staged relays' files (transfer.rank.staging)

    def start(self, model_config: ModelConfig, weights_digest: str, pool: torch.Tensor,
              shared_path: Path | None) -> tuple[RankPageSource, Served]:
        config, rank, where, results = self._config, self._rank, self._where, self._results
        self._agreement = agreement = Agreement.from_model(
            pool_contract_fields(model_config, config.torch_dtype, config.index_cache_dtype,
                                 config.kv_cache_dtype),
            weights_digest, pool.dtype, config.page_size
        )

        def on_release(request_id: str, pages: list[int]) -> None:
            results.put(Released(rank, request_id, tuple(pages)))

        def on_fetched(request_id: str, nbytes: int, seconds: float) -> None:
            results.put(Fetched(rank, request_id, nbytes, seconds))

        keep_freed_buffers()  # this process builds a multi-MiB message per chunk it sends
        source = RankPageSource(agreement, rank, pool, on_release, shared_path)
        port = where.port_base + rank if where.port_base else 0
        self.nixl = NixlExport(pool, rank, where.epoch)  # NIXL is loaded at the first NixlAttach
        # Relays stage (the rank reads into their files) on a GPU, else map the pool (in /dev/shm).
        staged = bool(config.fetch_relays) and staged_mode(pool.is_cuda)
        if staged:
            try:
                self.staging = RankStaging(where.epoch or uuid.uuid4().hex, rank, config.fetch_relays, pool.device)
            except OSError as err:  # no room under /dev/shm: the relays map the pool instead
                logging.getLogger("lanekv.prefill").warning("rank %d: relays map the pool, not staged: %s", rank, err)
                staged = False
        try:
            server = serve(source, where.host, port, security=where.security,
                           interceptors=[self._reporter.interceptor()], on_fetched=on_fetched, epoch=where.epoch,
                           nixl=self.nixl, relay_staging=self.staging)
        except BaseException:
            self.close_staging()
            raise
        if config.fetch_relays and (staged or pool.is_cuda or shared_path is not None):
            try:
                advertise = where.advertise or where.host
                self.relays = RelayProcesses(RelaySpec(
                    rank, join_host_port(advertise, server.port), agreement.encode(), where.security,
                    where.host, advertise, str(pool.device)), config.fetch_relays, self.staging)
            except BaseException:
                server.stop(0)
                self.close_staging()
                raise
        return source, server

    def close_relays(self) -> None:
        if self.relays is not None:
            self.relays.close()

    def close_staging(self) -> None:
        """Unpin and unlink the staged relays' files (once no StageKV can be in flight)."""
        if self.staging is not None:
            self.staging.close()

    def described(self, process: RankProcess, info: RankInfo) -> RankInfo:
        """``info`` with the server's endpoint and the agreement it serves."""
        endpoint = join_host_port(self._where.advertise or self._where.host, process.transfer_server.port)
        relays = () if self.relays is None else tuple(self.relays.endpoints)
        return dataclasses.replace(info, endpoint=endpoint, agreement=self._agreement.encode(), relays=relays)


def _reported(rank: int, err: Exception) -> str:
    """Log the traceback here (the daemon's log); the parent gets one line, which may
    reach a client or a command's error line."""
    logging.getLogger("lanekv.prefill").error("rank %d failed", rank, exc_info=err)
    return bounded(one_line(f"{type(err).__name__}: {err}"), 500)
