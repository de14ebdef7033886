"""The decode daemon's calls to its prefill daemons: one ``PrefillStream`` per Generate.

``PrefillClient.stream`` starts ``PrefillService.PrefillStream``; the
``PrefillCall``'s ``started`` returns the first message (the pages, as soon as
every owner rank can stream them) and a thread of its own waits for the last
one (the first token), so the KV fetch runs while the prefill does;
``check_manifest`` holds the first message to our contract, the request and
the prefill topology. Every failure is a ``Refusal`` with the status the
Generate call ends with.

``PrefillPool`` holds the prefill daemons of a decode daemon (xPyD): it picks
the healthy one with the fewest queued prompt tokens for each prompt, takes
one found down out of the pick, and puts it back once its health service
says SERVING and its handshake (its ranks included) accepts ours again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.decode.prefix.route import PrefixMemory, pick_cost, routed_hit
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.status import SLOW_CHECKS_TO_LEAVE, Refusal, slow_checks_after
from lanekv.transfer.errors import TransferError
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.manifest import Manifest

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
               timeout_s: float, cached_pages: int = 0, skip_prefix_cache: bool = False,
               prompt_logprobs: int | None = None) -> PrefillCall:
        """Start the prefill of a prompt (``sampling`` forwarded as the client gave it;
        ``cached_pages``: leading whole pages we hold, which we will not fetch;
        ``skip_prefix_cache``: its prefix cache neither serves nor keeps the prompt;
        ``prompt_logprobs``: top tokens of each prompt token's logprob, None: none)."""
        request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=token_ids), request_id=request_id,
                                            cached_pages=cached_pages, skip_prefix_cache=skip_prefix_cache,
                                            prompt_logprobs=prompt_logprobs or 0,
                                            has_prompt_logprobs=prompt_logprobs is not None)
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
        self._closed = False  # we cancelled the call (close)
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

    def written(self, timeout_s: float) -> bool | None:
        """Wait up to ``timeout_s`` for the last message: True once it came (every rank
        has written every layer), False if the call failed, None if it is still running."""
        try:
            self._done.result(timeout=timeout_s)
        except FutureTimeout:
            return None
        except Exception:  # noqa: BLE001 - the failure itself is reported by done()
            return False
        return True

    def raise_if_failed(self) -> None:
        """Raise the prefill's own failure, if it fails within a few seconds."""
        try:
            self._done.result(timeout=_PREFILL_VERDICT_S)
        except FutureTimeout:
            pass

    def close(self) -> None:
        self._closed = True
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
            if err.code() == Code.CANCELLED and not self._closed:
                # Not ours: the prefill daemon's server cut the call (it is stopping). Our
                # client did not leave, so it must not read CANCELLED; it is the daemon's
                # loss, which another prefill daemon (or its next start) may not have.
                raise Refusal(Code.UNAVAILABLE, f"prefill daemon {self._endpoint} cancelled the call "
                              f"(stopping?): {err.details()}") from err
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


def relays_of(reply: lanekv_pb2.PrefillReply) -> tuple[tuple[str, ...], ...]:
    """Each owner rank's sender relays the reply names (``PrefillReply.relays``; none from an
    older prefill), checked: one entry per rank, each endpoint 'host:port'."""
    relays = tuple(tuple(r.endpoints) for r in reply.relays)
    if relays and len(relays) != len(reply.endpoints):
        raise Refusal(Code.FAILED_PRECONDITION, f"prefill named relays of {len(relays)} ranks, "
                      f"its endpoints {len(reply.endpoints)}")
    for rank, endpoints in enumerate(relays):
        for endpoint in endpoints:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit() or not 1 <= int(port) <= 65535 or len(endpoint) > 1024:
                raise Refusal(Code.FAILED_PRECONDITION,
                              f"prefill named relay {endpoint!r:.80} of rank {rank}: not 'host:port'")
    return relays


# -- xPyD: several prefill daemons ---------------------------------------------

# Failures of one prefill daemon (or of the fetch from its ranks) that another
# may not have: a request that failed so before any token was sent is retried
# on another one, while its deadline lasts (a rank's stream that stalled reads
# DEADLINE_EXCEEDED). Not CANCELLED (the client left) nor INVALID_ARGUMENT,
# OUT_OF_RANGE or ALREADY_EXISTS (the request's fault: every daemon refuses it).
RETRY_CODES = frozenset({Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.ABORTED, Code.INTERNAL,
                         Code.UNKNOWN, Code.DATA_LOSS, Code.FAILED_PRECONDITION, Code.NOT_FOUND,
                         Code.DEADLINE_EXCEEDED})
# Failures that say the daemon itself is gone or no longer ours: out of the pick at once.
LOST_CODES = frozenset({Code.UNAVAILABLE, Code.FAILED_PRECONDITION})


@dataclass(eq=False)
class PrefillTarget:
    """One prefill daemon of the decode daemon, as the pool tracks it (guarded by the pool's lock)."""

    client: PrefillClient
    topology: Topology | None  # its ranks (each daemon has its own); None: not handshaken yet
    health: health_pb2_grpc.HealthStub
    healthy: bool = True
    queued_tokens: int = 0  # prompt tokens sent to it whose prefill has not ended
    retried: int = 0  # requests that failed on it before a token and went to another daemon
    problem: str = ""  # why it is out of the pick
    slow_checks: int = 0  # health checks in a row that timed out (it leaves at SLOW_CHECKS_TO_LEAVE)
    memory: PrefixMemory | None = None  # the prompt pages sent to it (decode.prefix.route); None: no routing by prefix
    epoch: str | None = None  # the start the topology is from (its first Prefill after a handshake says)

    def __post_init__(self) -> None:
        if self.topology is None:
            self.healthy = False
            self.problem = self.problem or "not handshaken yet"

    @property
    def endpoint(self) -> str:
        return self.client.endpoint


# Handshakes with a prefill daemon and each of its ranks; its topology, or a
# TransferError (ContractMismatch when it refuses our contract) or OSError.
Rejoin = Callable[[str], Topology]


class PrefillPool:
    """The prefill daemons a decode daemon pairs with, and which one takes a prompt.

    ``pick`` gives the healthy daemon with the fewest queued prompt tokens
    (ties in turn) and counts the prompt on it until ``done``. A daemon found
    down (``lost``) leaves the pick; a thread asks every daemon's health
    service each ``interval_s`` (a check that times out counts only once
    ``SLOW_CHECKS_TO_LEAVE`` do in a row), and one that says SERVING while out of the
    pick handshakes again (``rejoin``: its topology may have changed with a
    restart) before it is back. None of these calls raises but ``pick``.
    ``on_available(bool)`` hears when the pick turns empty and when a daemon is
    back in it (the decode daemon's own health follows).
    """

    def __init__(self, targets: Sequence[PrefillTarget], interval_s: float = 1.0,
                 timeout_s: float = 2.0, rejoin: Rejoin | None = None,
                 on_available: Callable[[bool], None] | None = None) -> None:
        if not targets:
            raise ValueError("a PrefillPool needs at least one prefill daemon")
        if not interval_s > 0 or not timeout_s > 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s!r} and {timeout_s!r}")
        if rejoin is None and any(t.topology is None for t in targets):
            raise ValueError("a prefill daemon without a topology needs a rejoin handshake")
        self.targets = tuple(targets)
        self._lock = threading.Lock()
        self._turn = 0
        self.picks = 0  # picks made
        self.picks_on_hit = 0  # picks of a daemon remembered to hold a prefix of the prompt
        self.picks_on_stale = 0  # replies showing a remembered prefix was evicted there (then forgotten)
        self._interval_s, self._timeout_s, self._rejoin = interval_s, timeout_s, rejoin
        self._on_available = on_available
        self._available = self.available
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_health, name="lanekv-prefill-health", daemon=True)
        self._watch.start()

    def pick(self, num_tokens: int, exclude: Sequence[PrefillTarget] = (),
             token_ids: Sequence[int] | None = None) -> PrefillTarget:
        """The daemon to prefill ``num_tokens`` prompt tokens, counted on it until ``done``;
        a ``Refusal`` UNAVAILABLE naming each daemon's problem when no healthy one
        outside ``exclude`` is left. With ``token_ids``, a daemon remembered to hold a
        prefix of the prompt counts that much less work (``decode.prefix.route.pick_cost``)."""
        cached = {}
        if token_ids is not None:
            cached = {id(t): routed_hit(t.memory.cached_tokens(token_ids), len(token_ids))
                      for t in self.targets if t.memory is not None}
        with self._lock:
            healthy = [t for t in self.targets if t.healthy and t not in exclude]
            if not healthy:
                down = "; ".join(f"{t.endpoint}: {t.problem or 'failed this request'}" for t in self.targets)
                raise Refusal(Code.UNAVAILABLE, f"no prefill daemon can take the request ({down})")
            costs = [pick_cost(t.queued_tokens, num_tokens, cached.get(id(t), 0)) for t in healthy]
            least = min(costs)
            tied = [t for t, cost in zip(healthy, costs) if cost == least]
            self._turn += 1
            target = tied[self._turn % len(tied)]
            target.queued_tokens += num_tokens
            self.picks += 1
            self.picks_on_hit += cached.get(id(target), 0) > 0
            return target

    def states(self) -> list[tuple[str, bool, str]]:
        """Each daemon's ``(endpoint, in the pick, why not)``, in the configured order."""
        with self._lock:
            return [(t.endpoint, t.healthy, t.problem) for t in self.targets]

    @property
    def available(self) -> bool:
        """Whether any daemon is in the pick."""
        with self._lock:
            return any(t.healthy for t in self.targets)

    def _report(self) -> None:
        """Tell ``on_available`` when the pick turns empty, or no longer is."""
        with self._lock:
            now = any(t.healthy for t in self.targets)
            changed, self._available = now != self._available, now
        if changed and self._on_available is not None:
            self._on_available(now)

    def observed(self, target: PrefillTarget, stale: bool) -> None:
        """A reply of ``target`` said what its cache holds of a prompt; ``stale``: less
        than we remembered (``PrefixMemory.observe`` forgot the rest)."""
        with self._lock:
            self.picks_on_stale += stale

    def done(self, target: PrefillTarget, num_tokens: int) -> None:
        """The prefill of ``num_tokens`` sent to ``target`` ended (answered or failed)."""
        with self._lock:
            target.queued_tokens -= num_tokens

    def retried(self, target: PrefillTarget) -> None:
        """A request that failed on ``target`` goes to another daemon."""
        with self._lock:
            target.retried += 1

    def others(self, exclude: Sequence[PrefillTarget]) -> bool:
        """Whether a healthy daemon outside ``exclude`` is left."""
        with self._lock:
            return any(t.healthy and t not in exclude for t in self.targets)

    def lost(self, target: PrefillTarget, problem: str) -> None:
        """``target`` failed as if it were gone: out of the pick until its health says SERVING."""
        with self._lock:
            was, target.healthy, target.problem = target.healthy, False, problem
        if was:
            log.warning("prefill daemon %s leaves the pick: %s", target.endpoint, problem)
            self._report()

    def topology_of(self, target: PrefillTarget, epoch: str | None) -> Topology:
        """``target``'s topology for its start ``epoch`` (a Prefill's ``lanekv-epoch``).

        The one held, if it came from that start (the first start seen after a
        handshake is taken to be the handshake's); for another start (the daemon
        restarted under the same address, perhaps laid out otherwise) a new
        handshake's. A ``Refusal`` UNAVAILABLE when that handshake fails."""
        with self._lock:
            topology, known = target.topology, target.epoch
            if epoch is None or known == epoch or self._rejoin is None or topology is None:
                return topology
            if known is None:
                target.epoch = epoch
                return topology
        log.warning("prefill daemon %s restarted (start %s, was %s): handshaking with its new start",
                    target.endpoint, epoch[:12], known[:12])
        try:
            topology = self._rejoin(target.endpoint)
        except (TransferError, OSError) as err:
            problem = f"restarted, and its handshake failed: {err}".splitlines()[0]
            self.lost(target, problem)
            raise Refusal(Code.UNAVAILABLE, f"prefill daemon {target.endpoint} {problem}") from err
        with self._lock:
            target.topology, target.epoch = topology, epoch
        return topology

    def close(self) -> None:
        self._stop.set()
        self._watch.join(2 * self._timeout_s + 1.0)

    def check(self, target: PrefillTarget) -> None:
        """Ask ``target``'s health once; out of the pick unless SERVING, back after a handshake."""
        request = health_pb2.HealthCheckRequest(service=PREFILL_SERVICE)
        code = None
        try:
            status = target.health.Check(request, timeout=self._timeout_s).status
            serving = status == health_pb2.HealthCheckResponse.SERVING
            problem = "" if serving else f"health {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}"
        except grpc.RpcError as err:
            code, serving, problem = err.code(), False, f"health check {err.code().name}: {err.details()}"
        with self._lock:
            slow = target.slow_checks = slow_checks_after(code, target.slow_checks)
        if 0 < slow < SLOW_CHECKS_TO_LEAVE:
            log.warning("prefill daemon %s: health check %d of %d in a row timed out (%.1f s); it stays "
                        "in the pick", target.endpoint, slow, SLOW_CHECKS_TO_LEAVE, self._timeout_s)
            return
        if not serving:
            self.lost(target, problem + (f" ({slow} checks in a row)" if slow else ""))
            return
        with self._lock:
            if target.healthy:
                return
            before = target.problem
        topology = target.topology
        if self._rejoin is not None:
            try:
                topology = self._rejoin(target.endpoint)
            except (TransferError, OSError) as err:
                problem = f"handshake: {err}".splitlines()[0]
                with self._lock:
                    target.problem = problem
                if problem != before:
                    log.error("prefill daemon %s stays out of the pick: %s", target.endpoint, problem)
                return
        with self._lock:
            target.topology, target.healthy, target.problem = topology, True, ""
            target.epoch = None  # the next Prefill names the start this handshake reached
        log.info("prefill daemon %s is in the pick (cp %d)", target.endpoint, topology.cp_size)
        self._report()

    def _watch_health(self) -> None:
        while not self._stop.wait(self._interval_s):
            for target in self.targets:
                if self._stop.is_set():
                    return
                try:
                    self.check(target)
                except Exception:  # keep watching: one bad round must not end the checks
                    log.exception("prefill health check of %s failed", target.endpoint)
