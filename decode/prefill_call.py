"""The decode daemon's calls to its prefill daemons: one ``PrefillStream`` per Generate.

``PrefillClient.stream`` starts ``PrefillService.PrefillStream``; the
``PrefillCall``'s ``started`` returns the first message (the pages, as soon as
every owner rank can stream them) and a thread of its own waits for the last
one (the first token), so the KV fetch runs while the prefill does;
``check_manifest`` holds the first message to our contract, the request and
the prefill topology. Every failure is a ``Refusal`` with the status the
Generate call ends with. ``PrefillPool`` holds the prefill daemons of an xPyD
decode daemon and picks the one that takes each prompt (the daemon does not
use it yet: it pairs with one prefill daemon).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import lanekv_pb2, lanekv_pb2_grpc
from runtime.status import Refusal
from transfer.protocol.contract import Topology
from transfer.protocol.manifest import Manifest
from transfer.rank.service import EPOCH_METADATA_KEY

log = logging.getLogger("lanekv.decode")
Code = grpc.StatusCode
PREFILL_SERVICE = lanekv_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
# How long a failed fetch waits to learn whether the prefill failed (and report that instead).
_PREFILL_VERDICT_S = 5.0


@dataclass(frozen=True)
class PrefillClient:
    """The prefill daemon at ``endpoint``, over ``stub``'s channel (shared by every call)."""

    stub: lanekv_pb2_grpc.PrefillServiceStub
    endpoint: str

    def stream(self, request_id: str, token_ids: Sequence[int], sampling: lanekv_pb2.SamplingParams,
               timeout_s: float) -> PrefillCall:
        """Start the prefill of a prompt (``sampling`` forwarded as the client gave it)."""
        request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=token_ids), request_id=request_id)
        request.sampling.CopyFrom(sampling)
        return PrefillCall(self, request, timeout_s)


class PrefillCall:
    """One PrefillStream call of the decode daemon."""

    def __init__(self, client: PrefillClient, request: lanekv_pb2.PrefillRequest, timeout_s: float) -> None:
        self._endpoint = client.endpoint
        self._start = time.perf_counter()
        self.seconds = 0.0  # from the call to its last message
        self.epoch: str | None = None  # the prefill daemon start that pinned the pages
        self._done: Future = Future()
        self._stream = client.stub.PrefillStream(request, timeout=timeout_s)

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


def check_manifest(reply: lanekv_pb2.PrefillReply, request_id: str, num_tokens: int, fingerprint: str,
                   page_size: int, topology: Topology) -> Manifest:
    """The manifest of a PrefillStream's first message, checked against our contract
    (``fingerprint``, ``page_size``), the request and the prefill ``topology``."""
    if reply.contract_fingerprint != fingerprint:
        raise Refusal(
            Code.FAILED_PRECONDITION,
            f"prefill answered with contract {reply.contract_fingerprint[:16]!r}, ours is "
            f"{fingerprint[:16]!r}; restart this daemon to handshake again",
        )
    try:
        manifest = Manifest.decode(reply.manifest)
    except ValueError as err:
        raise Refusal(Code.INTERNAL, f"prefill daemon sent a bad manifest: {err}") from err
    if manifest.page_size != page_size:
        raise Refusal(Code.FAILED_PRECONDITION, f"manifest page_size={manifest.page_size}, ours is {page_size}")
    if manifest.request_id != request_id or manifest.num_tokens != num_tokens:
        raise Refusal(
            Code.INTERNAL,
            f"manifest is for {manifest.request_id!r} with {manifest.num_tokens} tokens, asked for "
            f"{request_id!r} with {num_tokens}",
        )
    try:
        if len(reply.endpoints) != topology.cp_size:
            raise ValueError(f"{len(reply.endpoints)} endpoints for cp_size {topology.cp_size}")
        topology.check((p.page, p.owner) for p in manifest.pages)
    except ValueError as err:
        raise Refusal(Code.FAILED_PRECONDITION, f"prefill topology: {err}") from err
    return manifest


# -- xPyD: several prefill daemons ---------------------------------------------


@dataclass(eq=False)
class PrefillTarget:
    """One prefill daemon whose handshake accepted ours, as the decode daemon tracks it."""

    client: PrefillClient
    topology: Topology  # its ranks: each prefill daemon may have its own cp_size
    health: health_pb2_grpc.HealthStub
    healthy: bool = True
    queued_tokens: int = 0  # prompt tokens sent to it whose prefill has not ended
    problem: str = ""  # why it is out of the pick

    @property
    def endpoint(self) -> str:
        return self.client.endpoint


class PrefillPool:
    """The prefill daemons a decode daemon pairs with, and which one takes a prompt.

    ``pick`` gives the healthy daemon with the fewest queued prompt tokens
    (ties in turn) and counts the prompt on it until ``done``. A daemon found
    down (``lost``) leaves the pick; a thread asks every daemon's health
    service each ``interval_s`` and puts it back at its SERVING answer.
    """

    def __init__(self, targets: Sequence[PrefillTarget], interval_s: float = 1.0,
                 timeout_s: float = 2.0) -> None:
        if not targets:
            raise ValueError("a PrefillPool needs at least one prefill daemon")
        self.targets = tuple(targets)
        self._lock = threading.Lock()
        self._turn = 0
        self._interval_s, self._timeout_s = interval_s, timeout_s
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_health, name="lanekv-prefill-health", daemon=True)
        self._watch.start()

    def pick(self, num_tokens: int, exclude: Sequence[PrefillTarget] = ()) -> PrefillTarget:
        """UNAVAILABLE when no healthy daemon outside ``exclude`` is left."""
        with self._lock:
            healthy = [t for t in self.targets if t.healthy and t not in exclude]
            if not healthy:
                down = "; ".join(f"{t.endpoint}: {t.problem or 'tried'}" for t in self.targets)
                raise Refusal(Code.UNAVAILABLE, f"no prefill daemon can take the request ({down})")
            least = min(t.queued_tokens for t in healthy)
            tied = [t for t in healthy if t.queued_tokens == least]
            self._turn += 1
            target = tied[self._turn % len(tied)]
            target.queued_tokens += num_tokens
            return target

    def done(self, target: PrefillTarget, num_tokens: int) -> None:
        with self._lock:
            target.queued_tokens -= num_tokens

    def others(self, exclude: Sequence[PrefillTarget]) -> bool:
        """Whether a healthy daemon outside ``exclude`` is left."""
        with self._lock:
            return any(t.healthy and t not in exclude for t in self.targets)

    def lost(self, target: PrefillTarget, problem: str) -> None:
        with self._lock:
            was, target.healthy, target.problem = target.healthy, False, problem
        if was:
            log.warning("prefill daemon %s leaves the pick: %s", target.endpoint, problem)

    def close(self) -> None:
        self._stop.set()
        self._watch.join(self._timeout_s + 1.0)

    def _watch_health(self) -> None:
        request = health_pb2.HealthCheckRequest(service=PREFILL_SERVICE)
        while not self._stop.wait(self._interval_s):
            for target in self.targets:
                try:
                    status = target.health.Check(request, timeout=self._timeout_s).status
                    serving = status == health_pb2.HealthCheckResponse.SERVING
                    problem = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(status)
                except grpc.RpcError as err:
                    serving, problem = False, f"health check {err.code().name}: {err.details()}"
                if not serving:
                    self.lost(target, problem)
                    continue
                with self._lock:
                    back, target.healthy, target.problem = not target.healthy, True, ""
                if back:
                    log.info("prefill daemon %s is back in the pick", target.endpoint)
