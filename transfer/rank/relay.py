"""Sender relays: a rank's FetchKV bytes sent from processes of their own.

A rank process that sends its KV over gRPC does it in threads that share one
GIL with its prefill (page reads, the device-to-host copy, framing and gRPC's
copy of each message): with four streams a rank's own prefill ran twice as
long (238 to 496 ms at 8k tokens on an H200) and its streams moved less than
one. A relay is a process on the rank's host that maps the rank's pool the
way a same-host fast-path client does (``AttachPool``: CUDA IPC on a GPU, the
/dev/shm file on the CPU) and serves FetchKV on a port of its own:

- a decode's ``FetchRequest`` goes to the rank unchanged but for
  ``descriptors=true``, with the caller's access ticket, so the rank still makes
  every check (fingerprint, capability, epoch, lease, page and layer ranges);
  a refusal comes back with the rank's status and message;
- each sealed descriptor (a range of layers of the pages, written, with the
  digest the rank took while it held them) is read from the mapped pool
  (``gather_pages``), digested (``kernels.page_digest.kv_digest`` of exactly the
  bytes read, at the range's place among all layers) and, if it matches, cut and
  framed as ordinary KVChunk messages (``wire.plan_chunks``, ``encode_chunk``,
  ``frame_chunk``: the same chunks, seq numbers and checksums the rank's own
  FetchKV sends), so the decode side's checks and retries do not change;
- a range whose digest does not match ends the stream with UNAVAILABLE before
  any of its bytes leave: the decode side retries the cells it lacks on the
  rank's own endpoint (``grpcfetch.fetch.RankFetch``'s fallback).

Head ranges (a TP decode rank's), descriptors and NIXL are refused here: they go
to the rank. ``RelayProcesses`` starts a rank's relays (``relay_main``) and ends
them with the rank; a relay also ends when its parent does.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.kernels.page_copy import gather_pages
from lanekv.kernels.page_digest import kv_digest
from lanekv.proto import lanekv_pb2
from lanekv.runtime.security import SecurityConfig, bind, make_server, open_channel
from lanekv.runtime.status import (
    DEFAULT_CHUNK_BYTES,
    MAX_CHUNK_BYTES_LIMIT,
    TRANSFER_SERVICE,
    HealthServicer,
    Refusal,
    grpc_options,
    refusals,
)
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.descriptors import (
    TRANSPORTS,
    Descriptor,
    PoolHandle,
    host_id,
    open_pool,
)
from lanekv.transfer.protocol.wire import (
    encode_chunk,
    frame_chunk,
    kv_dtype,
    plan_chunks,
    split_chunk,
)
from lanekv.transfer.rank.relay_staged import RangeMismatch, StagingSlots, staged_chunks
from lanekv.transfer.rank.staging import RELAY_METADATA_KEY, RankStaging, StagingArea

Code = grpc.StatusCode
log = logging.getLogger("lanekv.transfer")
FETCH_METHOD = f"/{TRANSFER_SERVICE}/FetchKV"
ATTACH_METHOD = f"/{TRANSFER_SERVICE}/AttachPool"
MAX_RELAYS = 8  # per rank: more than a rank's streams could use
# Framed chunks built ahead of the one gRPC is sending.
LOOKAHEAD = 3
# How long a rank waits for a relay it started to say its port.
START_TIMEOUT_S = 60.0
# The longest a staged call waits for two slots of its relay (other calls hold them).
SLOT_WAIT_S = 30.0
_END = object()


def check_relays(relays: object) -> int:
    """``relays`` if it is a valid count of relays per rank; ValueError naming it otherwise."""
    if isinstance(relays, bool) or not isinstance(relays, int) or not 0 <= relays <= MAX_RELAYS:
        raise ValueError(f"fetch_relays must be an integer in [0, {MAX_RELAYS}], got fetch_relays={relays!r}")
    return relays


def range_payload(pool: torch.Tensor, descriptor: Descriptor, page_size: int) -> torch.Tensor:
    """The sealed ``descriptor``'s layers of its pages, read from ``pool`` in wire order and
    verified against its digest: a CPU tensor ``[layers, planes, pages * page_size, heads, dim]``.
    Raises ``RangeMismatch`` when the bytes read are not the ones the rank digested."""
    if descriptor.digest is None:
        raise ValueError(f"descriptor seq {descriptor.seq} is not sealed: it carries no digest")
    index = torch.as_tensor(descriptor.physical, dtype=torch.int64).to(pool.device)
    payload = gather_pages(pool, index, page_size, descriptor.layer_start, descriptor.layer_end)
    row_bytes = pool.shape[3] * pool.shape[4] * pool.element_size()
    # The range at its place among all layers (the rank's digests take first_layer=0).
    position = pool.shape[1] * descriptor.layer_start * len(descriptor.physical) * page_size * row_bytes // 4
    got = kv_digest(payload, position)
    if got != descriptor.digest:
        raise RangeMismatch(
            f"layers [{descriptor.layer_start}, {descriptor.layer_end}) of pages {list(descriptor.pages)[:8]} "
            f"read {got:#018x} from the mapped pool, the rank sealed them as {descriptor.digest:#018x}")
    if not payload.is_cuda:
        return payload
    host = torch.empty(payload.shape, dtype=payload.dtype, pin_memory=True)  # torch caches pinned blocks
    host.copy_(payload)
    return host


def warm_reads(pool: torch.Tensor, page_size: int) -> None:
    """Launch every specialization of a read once: ``gather_pages`` of one layer and of all,
    for 1..16 pages (its strides are specialized on the page count mod 16), and a digest."""
    layers, num_pages = pool.shape[0], pool.shape[2] // page_size
    for end in sorted({1, layers}):
        for count in range(1, min(16, num_pages) + 1):
            index = torch.arange(count, dtype=torch.int64, device=pool.device)
            kv_digest(gather_pages(pool, index, page_size, 0, end))
    torch.cuda.synchronize(pool.device)


class RelayService:
    """FetchKV of one rank's pages, sent from this process (see the module's docstring)."""

    def __init__(self, rank: int, rank_endpoint: str, agreement: Agreement,
                 security: SecurityConfig | None = None, *, default_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 staging: StagingArea | None = None) -> None:
        self.rank, self.rank_endpoint, self.agreement = rank, rank_endpoint, agreement
        self.security = SecurityConfig() if security is None else security
        self._default_chunk_bytes = default_chunk_bytes
        self._channel = open_channel(rank_endpoint, self.security, grpc_options())
        # Staged (``relay_staged``): the rank reads into this file's slots; no pool is mapped here.
        self.staging: StagingSlots | None = None
        if staging is not None:
            self.staging = StagingSlots(staging, self._channel)
        self._pool: torch.Tensor | None = None
        self._lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self.sent_bytes = 0  # payload bytes of every chunk sent, for logs and tests
        self.sent_chunks = 0

    def close(self) -> None:
        self._channel.close()

    def attach(self, timeout_s: float = 30.0) -> torch.Tensor:
        """Map the rank's pool (``AttachPool``, as a same-host fast-path client does)."""
        request = lanekv_pb2.AttachRequest(fingerprint=self.agreement.fingerprint, host_id=host_id(),
                                           transports=list(TRANSPORTS))
        call = self._channel.unary_unary(ATTACH_METHOD, request_serializer=lanekv_pb2.AttachRequest.SerializeToString,
                                         response_deserializer=lanekv_pb2.AttachReply.FromString)
        reply = call(request, timeout=timeout_s, wait_for_ready=True)
        pool = open_pool(PoolHandle.decode(reply.handle))
        expected = (self.agreement.num_layers, self.agreement.kv_planes)
        if tuple(pool.shape[:2]) != expected or pool.dtype != kv_dtype(self.agreement.kv_dtype):
            raise ValueError(f"rank {self.rank}'s pool is {tuple(pool.shape)} {pool.dtype}, the agreement says "
                             f"{expected} layers x planes of {self.agreement.kv_dtype}")
        with self._lock:
            self._pool = pool
        return pool

    def _mapped(self) -> torch.Tensor:
        """The rank's pool, mapped at the first fetch (the rank answers AttachPool only once
        its daemon has told it the topology, after every rank and relay started)."""
        with self._attach_lock:
            if self._pool is None:
                try:
                    self.attach()
                except (grpc.RpcError, OSError, RuntimeError, ValueError) as err:
                    detail = err.details() if isinstance(err, grpc.RpcError) else str(err)
                    log.error("relay of rank %d cannot map the rank's pool: %s", self.rank, detail)
                    raise Refusal(Code.UNAVAILABLE, f"the relay of rank {self.rank} cannot map the rank's pool: "
                                  f"{detail}") from err
            return self._pool

    def attach_when_served(self, stop: threading.Event, every_s: float = 0.5) -> bool:
        """Map the pool as soon as the rank answers AttachPool (once its daemon has told it the
        topology), then launch the read's kernels once (a GPU pool), so that no fetch pays a
        kernel's first load; False if ``stop`` came first."""
        while not stop.is_set():
            try:
                with self._attach_lock:
                    pool = self._pool if self._pool is not None else self.attach(timeout_s=5.0)
            except (grpc.RpcError, OSError, RuntimeError, ValueError) as err:  # not yet: the first fetch says why
                log.debug("relay of rank %d: no pool yet: %s", self.rank, err)
                stop.wait(every_s)
                continue
            if pool.is_cuda:
                warm_reads(pool, self.agreement.page_size)
            return True
        return False

    def FetchKV(self, request: lanekv_pb2.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with refusals(context):
            yield from self._fetch(request, context)

    def _fetch(self, request: lanekv_pb2.FetchRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        start = time.perf_counter()
        pool = self._mapped() if self.staging is None else None
        if request.descriptors or request.nixl:
            raise Refusal(Code.INVALID_ARGUMENT, f"a relay sends bytes: descriptors={request.descriptors} "
                          f"nixl={request.nixl} go to rank {self.rank} at {self.rank_endpoint}")
        if request.HasField("head_start") or request.HasField("head_count"):
            raise Refusal(Code.INVALID_ARGUMENT, f"head_start/head_count are served by rank {self.rank} "
                          f"at {self.rank_endpoint}, not by its relay")
        a = self.agreement
        page_bytes = a.kv_planes * a.page_size * a.num_kv_heads * a.head_dim * kv_dtype(a.kv_dtype).itemsize
        chunk_bytes = request.max_chunk_bytes or self._default_chunk_bytes
        if not page_bytes <= chunk_bytes <= MAX_CHUNK_BYTES_LIMIT:
            raise Refusal(Code.INVALID_ARGUMENT, f"max_chunk_bytes {chunk_bytes} is not within [{page_bytes} "
                          f"(one page of one layer), {MAX_CHUNK_BYTES_LIMIT}]")
        if self.staging is not None and chunk_bytes > self.staging.area.slot_bytes:
            raise Refusal(Code.UNAVAILABLE, f"chunks of {chunk_bytes} bytes do not fit the {self.staging.area.slot_bytes}"
                          f"-byte slots of relay of rank {self.rank}: fetch them from the rank at {self.rank_endpoint}")
        upstream = lanekv_pb2.FetchRequest()
        upstream.CopyFrom(request)
        upstream.descriptors = True
        metadata = [(k, v) for k, v in context.invocation_metadata() or () if k == EPOCH_METADATA_KEY]
        if self.staging is not None:  # no AttachPool: the rank knows its staged relays by their secret
            metadata.append((RELAY_METADATA_KEY, self.staging.area.secret))
        left = context.time_remaining()
        call = self._channel.unary_stream(FETCH_METHOD, request_serializer=lanekv_pb2.FetchRequest.SerializeToString)(
            upstream, timeout=left, metadata=metadata)
        context.add_callback(call.cancel)
        out: queue.Queue = queue.Queue(maxsize=LOOKAHEAD)
        stop = threading.Event()
        worker = threading.Thread(target=self._produce, args=(call, request.request_id, chunk_bytes, page_bytes,
                                                               pool, out, stop, context.time_remaining()),
                                  name=f"relay-rank{self.rank}", daemon=True)
        worker.start()
        nbytes = chunks = 0
        try:
            while True:
                item = out.get()
                if item is _END:
                    break
                if isinstance(item, Refusal):
                    raise item
                framed, size = item
                yield framed
                nbytes, chunks = nbytes + size, chunks + 1
                with self._lock:
                    self.sent_bytes += size
                    self.sent_chunks += 1
        finally:
            stop.set()
            call.cancel()
        log.info("relay of rank %d: request %r: %d bytes in %d chunks in %.3f s", self.rank,
                 request.request_id, nbytes, chunks, time.perf_counter() - start)

    def _produce(self, call: Any, rid: str, chunk_bytes: int, page_bytes: int, pool: torch.Tensor | None,
                 out: queue.Queue, stop: threading.Event, left_s: float | None) -> None:
        """Turn the rank's descriptors into framed chunks on ``out``; then ``_END`` or a ``Refusal``.
        Staged: the rank reads each chunk into one of the two slots this call takes."""
        pair = None
        if self.staging is not None:
            pair = self.staging.take(SLOT_WAIT_S if left_s is None else min(left_s, SLOT_WAIT_S))
            if pair is None:
                out.put(Refusal(Code.UNAVAILABLE, f"relay of rank {self.rank}: no staging slot came free; "
                                f"fetch from the rank at {self.rank_endpoint}"))
                return
        try:
            self._produce_chunks(call, rid, chunk_bytes, page_bytes, pool, pair, out, stop, left_s)
        finally:
            if pair is not None:
                self.staging.give(pair)

    def _produce_chunks(self, call: Any, rid: str, chunk_bytes: int, page_bytes: int, pool: torch.Tensor | None,
                        pair: tuple[int, int] | None, out: queue.Queue, stop: threading.Event,
                        left_s: float | None) -> None:

        def put(item: Any) -> bool:
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        seq, deadline = 0, None if left_s is None else time.monotonic() + left_s
        try:
            for message in call:
                header, _ = split_chunk(message)
                descriptor = Descriptor.decode(header)
                if descriptor.digest is None:
                    continue  # announced; its sealed twin follows
                if descriptor.rank != self.rank or descriptor.request_id != rid:
                    raise Refusal(Code.INTERNAL, f"rank {self.rank} sent a descriptor of rank {descriptor.rank}, "
                                  f"request {descriptor.request_id!r:.80}")
                plans = plan_chunks(descriptor.layer_end - descriptor.layer_start, descriptor.pages, page_bytes,
                                    chunk_bytes, layer_start=descriptor.layer_start)
                try:
                    if pair is not None:  # each chunk goes as soon as it has the rank's seal
                        for framed in staged_chunks(self.staging, pair, descriptor, plans, seq, self.agreement,
                                                    deadline, stop):
                            if not put(framed):
                                return
                            seq += 1
                        continue
                    payload = range_payload(pool, descriptor, self.agreement.page_size)
                except RangeMismatch as err:
                    log.error("relay of rank %d: request %r: %s", self.rank, rid, err)
                    raise Refusal(Code.UNAVAILABLE, f"relay of rank {self.rank}: {err}; fetch these pages from "
                                  f"the rank at {self.rank_endpoint}") from err
                ps = self.agreement.page_size
                where = {page: i for i, page in enumerate(descriptor.pages)}
                for plan in plans:
                    first = where[plan.pages[0]]
                    part = payload[plan.layer_start - descriptor.layer_start:plan.layer_end - descriptor.layer_start,
                                   :, first * ps:(first + len(plan.pages)) * ps]
                    chunk, data = encode_chunk(rid, self.rank, seq, plan.layer_start, plan.pages, part)
                    if not put((frame_chunk(chunk.encode(), data), chunk.nbytes)):
                        return
                    seq += 1
            put(_END)
        except Refusal as refusal:
            put(refusal)
        except grpc.RpcError as err:  # the rank's refusal, passed through as it was
            put(Refusal(err.code(), err.details() or f"rank {self.rank}: {err.code().name}"))
        except ValueError as err:
            put(Refusal(Code.INTERNAL, f"rank {self.rank} sent a bad descriptor: {err}"))
        except Exception as err:  # noqa: BLE001 - a fault of ours ends the stream, the log has why
            log.error("relay of rank %d: request %r failed", self.rank, rid, exc_info=err)
            put(Refusal(Code.UNAVAILABLE, f"relay of rank {self.rank} failed: {type(err).__name__}"))


class ServedRelay(NamedTuple):
    server: grpc.Server
    port: int
    service: RelayService

    def stop(self, grace_s: float = 1.0) -> None:
        self.server.stop(grace_s).wait(grace_s + 1.0)
        self.service.close()


def serve_relay(service: RelayService, host: str = "127.0.0.1", port: int = 0, *,
                max_workers: int = 16) -> ServedRelay:
    """Serve ``service``'s FetchKV (and health) on ``host:port`` (0: a free port)."""
    server = make_server(service.security, max_workers)
    handlers = {"FetchKV": grpc.unary_stream_rpc_method_handler(
        service.FetchKV, request_deserializer=lanekv_pb2.FetchRequest.FromString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(TRANSFER_SERVICE, handlers),))
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    bound = bind(server, host, port, service.security)
    server.start()
    for name in ("", TRANSFER_SERVICE):
        checker.set(name, health_pb2.HealthCheckResponse.SERVING)
    return ServedRelay(server, bound, service)


class RelaySpec(NamedTuple):
    """What a relay process is told on its stdin (pickled by the rank that starts it)."""

    rank: int
    rank_endpoint: str  # where the relay reaches its rank (on this host)
    agreement: bytes  # Agreement.encode()
    security: SecurityConfig
    host: str  # the relay's bind address
    advertise: str  # the host its endpoint names for peers
    device: str  # the rank's device ("cpu", "cuda:0")
    staging: StagingArea | None = None  # staged (``relay_staged``): the file the rank reads into; None: mapped


class RelayProcesses:
    """A rank's relays: ``count`` processes (``python -m lanekv.transfer.rank.relay_main``), each
    serving FetchKV of the rank's pages on a port of its own (``endpoints``, in start order).

    Each says its port on its stdout once it has mapped the pool; one that does
    not within ``START_TIMEOUT_S`` fails the start (a RuntimeError naming it).
    ``close`` terminates them (then kills); each also exits when its parent does.
    """

    def __init__(self, spec: RelaySpec, count: int, staging: RankStaging | None = None) -> None:
        check_relays(count)
        if staging is not None and len(staging.areas) != count:
            raise ValueError(f"{len(staging.areas)} staging files for {count} relays")
        self.processes: list[subprocess.Popen] = []
        self.endpoints: list[str] = []
        try:
            for i in range(count):
                env = dict(os.environ, LANEKV_RELAY_INDEX=str(i))
                proc = subprocess.Popen([sys.executable, "-m", "lanekv.transfer.rank.relay_main"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
                self.processes.append(proc)
                mine = spec if staging is None else spec._replace(staging=staging.areas[i])
                proc.stdin.write(pickle.dumps(mine))
                proc.stdin.close()
            for i, proc in enumerate(self.processes):
                port = _read_port(proc, spec.rank, i)
                self.endpoints.append(_join(spec.advertise, port))
        except BaseException:
            self.close()
            raise

    def close(self, grace_s: float = 2.0) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def _read_port(proc: subprocess.Popen, rank: int, index: int) -> int:
    box: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: box.put(proc.stdout.readline()), daemon=True).start()
    try:
        line = box.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
        raise RuntimeError(f"relay {index} of rank {rank} did not start within {START_TIMEOUT_S:.0f}s") from None
    text = line.decode(errors="replace").strip()
    if not text.startswith("port "):
        raise RuntimeError(f"relay {index} of rank {rank} failed to start (exit status {proc.poll()}); "
                           "its log says why")
    return int(text.split()[1])


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


__all__ = ["RangeMismatch", "RelayProcesses", "RelayService", "RelaySpec", "check_relays", "range_payload",
           "serve_relay"]
