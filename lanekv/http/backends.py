"""The decode daemons behind the front: channels, health, and which one takes a request.

Each daemon gets one ``grpc.aio`` channel speaking the front's security
config (TLS as configured; the token rides as ``authorization: Bearer``
metadata on every call, over plaintext and TLS alike). A background task asks
each daemon's health service (``lanekv.v1.DecodeService``) every
``health_interval_s``: a daemon that does not answer SERVING leaves the
rotation (one whose checks time out, only once ``SLOW_CHECKS_TO_LEAVE`` in a
row have: busy is not gone), and comes back at its next SERVING answer. A Generate call that
finds a daemon UNAVAILABLE takes it out at once too.

``pick`` hands a request to the healthy daemon with the fewest running
requests (ties in turn), or, given the prompt, to the one remembered to have
seen the longest prefix of it (its prefix cache likely holds it) among those
within ``ROUTE_SLACK`` running requests of the least busy; a daemon that
answers NOT_SERVING is asked why (``DecodeService.Status``: e.g. its prefill
daemons are down), and that root cause is its problem in ``/health`` and in a
503. ``NoBackend`` says why none can take it: none is healthy (503) or every
healthy one is full (429). Only the event loop's thread touches the counts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lanekv.decode.prefix.route import PrefixMemory, routed_hit
from lanekv.http.config import FrontConfig
from lanekv.http.errors import APIError
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.security import AUTH_METADATA_KEY, SecurityConfig
from lanekv.runtime.status import SLOW_CHECKS_TO_LEAVE, grpc_options, slow_checks_after

log = logging.getLogger("lanekv.http")
DECODE_SERVICE = lanekv_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
# A daemon busier than the least busy by more than this many running requests is
# not picked for its prefix: load wins past it.
ROUTE_SLACK = 4
# The front does not know the daemons' page size: it remembers prompts in blocks of this many tokens.
ROUTE_BLOCK_TOKENS = 16


def aio_channel(endpoint: str, security: SecurityConfig) -> grpc.aio.Channel:
    """An asyncio channel to ``endpoint``, TLS when ``security`` says so (the token goes
    in each call's metadata: see ``call_metadata``)."""
    options = grpc_options()
    if not security.tls:
        return grpc.aio.insecure_channel(endpoint, options=options)

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(security.tls_ca), private_key=read(security.tls_key),
        certificate_chain=read(security.tls_cert))
    if security.tls_server_name:
        options.append(("grpc.ssl_target_name_override", security.tls_server_name))
    return grpc.aio.secure_channel(endpoint, credentials, options=options)


def call_metadata(security: SecurityConfig) -> tuple[tuple[str, str], ...]:
    return ((AUTH_METADATA_KEY, f"Bearer {security.token}"),) if security.token else ()


@dataclass(eq=False)
class Backend:
    """One decode daemon as the front sees it."""

    endpoint: str
    # Made on the event loop that serves (grpc.aio channels belong to one loop).
    channel: grpc.aio.Channel | None = None
    stub: lanekv_pb2_grpc.DecodeServiceStub | None = None
    health: health_pb2_grpc.HealthStub | None = None
    healthy: bool = False
    running: int = 0
    served: int = 0  # requests handed to it so far
    problem: str = "not asked yet"  # why it is out of rotation
    slow_checks: int = 0  # health checks in a row that timed out (runtime.status.SLOW_CHECKS_TO_LEAVE)
    # Prompts handed to it (a hint of what its prefix cache holds).
    memory: PrefixMemory = field(default_factory=lambda: PrefixMemory("lanekv-front", ROUTE_BLOCK_TOKENS))


class NoBackend(APIError):
    pass


@dataclass(eq=False)
class Backends:
    config: FrontConfig
    members: list[Backend] = field(default_factory=list)
    _turn: int = 0
    _watch: asyncio.Task | None = None
    picks: int = 0
    picks_on_hit: int = 0  # picks of a daemon remembered to have seen a prefix of the prompt
    picks_on_stale: int = 0  # replies showing a remembered prefix was evicted there (then forgotten)

    @classmethod
    def of(cls, config: FrontConfig) -> Backends:
        return cls(config, [Backend(endpoint) for endpoint in config.decode_endpoints])

    async def start(self) -> None:
        """Open the channels, ask every daemon once, then keep asking in the background."""
        for member in self.members:
            member.channel = aio_channel(member.endpoint, self.config.security)
            member.stub = lanekv_pb2_grpc.DecodeServiceStub(member.channel)
            member.health = health_pb2_grpc.HealthStub(member.channel)
        await self.check_all()
        self._watch = asyncio.get_running_loop().create_task(self._watch_health())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            try:
                await self._watch
            except asyncio.CancelledError:
                pass
        for member in self.members:
            if member.channel is not None:
                await member.channel.close(grace=None)

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self.config.security)

    def pick(self, exclude: Sequence[Backend] = (), prompt_ids: Sequence[int] | None = None) -> Backend:
        """The healthy daemon, not in ``exclude``, with the fewest running requests; with
        ``prompt_ids``, the one with the longest remembered prefix among those within
        ``ROUTE_SLACK`` of the fewest."""
        healthy = [m for m in self.members if m.healthy and m not in exclude]
        if not healthy:
            why = "; ".join(f"{m.endpoint}: {m.problem}" for m in self.members if not m.healthy)
            raise NoBackend(503, f"no healthy decode daemon ({why or 'all tried'})",
                            code="no_healthy_backend")
        free = [m for m in healthy if m.running < self.config.max_running_per_decode]
        if not free:
            raise NoBackend(429, f"every decode daemon is full ({self.config.max_running_per_decode} "
                            "running requests each); retry later", code="server_full")
        least = min(m.running for m in free)
        seen = {id(m): 0 if prompt_ids is None else routed_hit(m.memory.cached_tokens(prompt_ids), len(prompt_ids))
                for m in free}
        near = [m for m in free if m.running <= least + ROUTE_SLACK]
        best = max((seen[id(m)], -m.running) for m in near)
        tied = [m for m in near if (seen[id(m)], -m.running) == best]
        self._turn = (self._turn + 1) % len(self.members)
        chosen = tied[self._turn % len(tied)]
        chosen.running += 1
        chosen.served += 1
        self.picks += 1
        self.picks_on_hit += seen[id(chosen)] > 0
        return chosen

    def remember(self, member: Backend, prompt_ids: Sequence[int]) -> None:
        """``member`` took this prompt: its prefix cache likely holds its pages now."""
        member.memory.remember(prompt_ids)

    def observe(self, member: Backend, prompt_ids: Sequence[int], held_tokens: int) -> None:
        """``member``'s first reply: its prefix cache holds the first ``held_tokens`` of the
        prompt (``GenerateReply.prefix_cache_tokens``). Those are remembered and the rest of
        the prompt forgotten, so a prefix it evicted stops steering picks to it."""
        self.picks_on_stale += member.memory.observe(prompt_ids, held_tokens)

    def done(self, member: Backend) -> None:
        member.running -= 1

    def lost(self, member: Backend, problem: str) -> None:
        """``member`` failed a call as if it were gone: out of rotation until it says SERVING."""
        if member.healthy:
            log.warning("decode daemon %s leaves the rotation: %s", member.endpoint, problem)
        member.healthy, member.problem = False, problem

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(m) for m in self.members))

    async def _check(self, member: Backend) -> None:
        request = health_pb2.HealthCheckRequest(service=DECODE_SERVICE)
        code = None
        try:
            reply = await member.health.Check(request, timeout=self.config.health_timeout_s,
                                              metadata=self.metadata)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            problem = "" if serving else health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            if not serving:
                problem = await self._why_not_serving(member, problem)
        except grpc.aio.AioRpcError as err:
            code, serving, problem = err.code(), False, f"health check {err.code().name}: {err.details()}"
        member.slow_checks = slow = slow_checks_after(code, member.slow_checks)
        if 0 < slow < SLOW_CHECKS_TO_LEAVE:  # busy, not gone: it stays where it is for now
            log.warning("decode daemon %s: health check %d of %d in a row timed out", member.endpoint,
                        slow, SLOW_CHECKS_TO_LEAVE)
            return
        if slow:
            problem += f" ({slow} checks in a row)"
        if serving and not member.healthy:
            log.info("decode daemon %s is in rotation", member.endpoint)
        elif not serving:
            self.lost(member, problem)
        member.healthy, member.problem = serving, problem

    async def _why_not_serving(self, member: Backend, status: str) -> str:
        """A daemon's health said ``status`` (not SERVING): its own account of why (the
        prefill daemons behind it), from ``DecodeService.Status`` when it answers."""
        if member.stub is None:
            return status
        try:
            reply = await member.stub.Status(lanekv_pb2.DecodeStatusRequest(),
                                             timeout=self.config.health_timeout_s, metadata=self.metadata)
        except grpc.aio.AioRpcError:
            return status  # an older daemon, or one going away: the health status is all there is
        return f"{status}: {reply.problem}" if reply.problem else status

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # keep watching: one bad round must not end the checks
                log.exception("decode health round failed")
