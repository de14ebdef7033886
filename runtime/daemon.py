"""The skeleton both daemons stand on: their gRPC port, health, metrics, drain and close.

A ``DaemonServer`` binds its port and the metrics endpoint when it is built,
so a busy port fails before a model loads or a rank starts; the daemon then
adds its services to ``server`` and calls ``start``. ``drain`` says
NOT_SERVING for good and refuses new calls while open ones finish; ``close``
ends both ports and may be called again. Every port speaks the daemon's
``SecurityConfig`` (TLS, mutual TLS, the token); health stays open.

``serve_until_signal`` is what both command lines do once their daemon is up:
write the ready file (atomically), print the banner, wait for SIGINT or
SIGTERM, then hand over to the daemon's own stop (its drain), with start-up's
objects frozen out of garbage collection meanwhile. A daemon that
can serve no more (``failure()``: a prefill rank died) ends it too: one
line on stderr, a short stop, exit status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.runtime.advertise import advertise_host, is_wildcard, join_host_port
from lanekv.runtime.gcpause import frozen
from lanekv.runtime.metrics import MetricsEndpoint, Registry, serve_metrics
from lanekv.runtime.rpc_metrics import LanekvMetrics, lanekv_metrics
from lanekv.runtime.security import SecurityConfig, bind, make_server
from lanekv.runtime.shmfiles import reclaim_stale
from lanekv.runtime.status import HealthServicer, one_line

log = logging.getLogger("lanekv.daemon")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DaemonServer:
    """One daemon's gRPC server (calls counted into its ``metrics``), health service and
    ``/metrics`` endpoint (``metrics_port`` None: none; 0: a free port). It binds
    ``host``; ``endpoint`` names the host peers are told (``runtime.advertise``:
    ``advertise`` when given, a reachable address for a wildcard bind)."""

    def __init__(self, security: SecurityConfig, host: str, port: int, max_workers: int,
                 metrics_port: int | None, advertise: str | None = None) -> None:
        self.security = security
        self.host = host
        self.advertised = advertise_host(host, advertise)
        if advertise is not None or is_wildcard(host):
            log.info("bound to %r, advertising %s: %s", host, self.advertised.host, self.advertised.why)
        self.registry = Registry()
        self.metrics: LanekvMetrics = lanekv_metrics(self.registry)
        self.metrics_endpoint: MetricsEndpoint | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.server = make_server(security, max_workers, interceptors=[self.metrics.interceptor()])
        try:
            self.port = bind(self.server, host, port, security)
            if metrics_port is not None:  # with the daemon's TLS and token
                self.metrics_endpoint = serve_metrics(self.registry, host, metrics_port, security)
        except BaseException:
            self.close()
            raise
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reclaim_stale()  # /dev/shm files of lanekv daemons that died without removing them

    @property
    def endpoint(self) -> str:
        """``host:port`` as peers dial it (the advertised host)."""
        return join_host_port(self.advertised.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        """The port serving /metrics (the one picked when it was asked for 0), or None."""
        return None if self.metrics_endpoint is None else self.metrics_endpoint.port

    def describe(self) -> str:
        """How the port is protected and where its metrics are, for the start-up line
        (never the token itself)."""
        security = self.security
        tls = "mutual TLS" if security.require_client_cert else "TLS" if security.tls else "plaintext"
        metrics = f", metrics on {self._metrics_url()}" if self.metrics_port else ""
        return f"{tls}{' + token' if security.token else ''}{metrics}"

    def _metrics_url(self) -> str:
        scheme = "https" if self.security.tls else "http"
        return f"{scheme}://{join_host_port(self.advertised.host, self.metrics_port)}/metrics"

    def banner(self, prog: str, detail: str) -> str:
        """The line a command prints once its daemon serves."""
        metrics = f"; metrics: {self._metrics_url()}" if self.metrics_port else ""
        return f"{prog} serving on {self.endpoint} ({detail}){metrics}"

    def start(self, services: Sequence[str]) -> None:
        """Start serving: health says SERVING for the server ("") and each of ``services``."""
        self.server.start()
        self.start_serving(services)

    def start_serving(self, services: Sequence[str]) -> None:
        """Health says SERVING again for the server ("") and each of ``services``
        (ignored once a drain began: its NOT_SERVING is for good)."""
        for service in ("", *services):
            self.health.set(service, _SERVING)

    def set_not_serving(self, services: Sequence[str]) -> None:
        """Health says NOT_SERVING for the server ("") and each of ``services``; calls still reach them."""
        for service in ("", *services):
            self.health.set(service, _NOT_SERVING)

    def drain(self, grace_s: float) -> threading.Event:
        """Every service NOT_SERVING for good, new calls refused; the event is set once
        the open calls ended (or ``grace_s`` passed and they were cancelled).

        An open health Watch is an open call too: it holds the drain for ``grace_s``.
        """
        self.health.enter_graceful_shutdown()
        return self.server.stop(grace_s)

    def close(self) -> None:
        """End the gRPC server and the metrics endpoint now; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.server.stop(None)
        if self.metrics_endpoint is not None:
            self.metrics_endpoint.close()


class Daemon(Protocol):
    """What ``serve_until_signal`` needs of a started daemon."""

    @property
    def endpoint(self) -> str: ...

    def stop(self, grace_s: float = ...) -> None: ...

    def failure(self) -> str | None:
        """Why the daemon can serve no more, or None while it can."""
        ...


# How often serve_until_signal looks at the daemon's failure(), and what a failed
# daemon gives open calls to end (they were told why already: UNAVAILABLE).
_FAILURE_POLL_S = 0.1
_FAILED_GRACE_S = 1.0


def how_it_ended(exitcode: int | None) -> str:
    """How a child process ended, in words: ``exited with code -9 (SIGKILL)``."""
    how = f"exited with code {exitcode}"
    if exitcode is not None and exitcode < 0:
        try:
            how += f" ({signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    return how


def write_atomically(path: Path, text: str) -> None:
    """Readers polling for the file never see it half written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve_until_signal(daemon: Daemon, banner: str, ready_file: str | None, grace_s: float,
                       log: logging.Logger, draining: str, prog: str = "lanekv",
                       settle: Callable[[], None] | None = None) -> int:
    """Write the daemon's endpoint to ``ready_file``, print ``banner``, block until
    SIGINT or SIGTERM, log ``draining`` and stop the daemon (``grace_s`` to drain).
    Returns the command's exit code: 0; 1 when the daemon failed (``failure()``),
    after printing ``<prog>: <failure>; exiting`` on stderr. The process is the
    daemon's alone: what start-up made is frozen out of garbage collection while
    it serves (``runtime.gcpause.frozen``). ``settle()`` runs once after the
    freeze, before the ready file: the first work after a collect-and-freeze runs
    slow, and it takes that instead of the first request."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # first: a signal during the freeze still drains
        signal.signal(sig, lambda *_: stop.set())
    with frozen() as count:
        log.info("garbage collector: froze %d objects", count)
        if settle is not None:
            try:
                settle()
            except Exception as err:  # best effort: the daemon serves anyway (a dead rank shows below)
                log.warning("settling after the freeze failed: %s", one_line(str(err)), exc_info=True)
        return _serve(daemon, stop, banner, ready_file, grace_s, log, draining, prog)


def _serve(daemon: Daemon, stop: threading.Event, banner: str, ready_file: str | None, grace_s: float,
           log: logging.Logger, draining: str, prog: str) -> int:
    if ready_file:
        write_atomically(Path(ready_file), daemon.endpoint)
    print(banner, flush=True)
    failure = None
    while not stop.wait(_FAILURE_POLL_S):
        failure = daemon.failure()
        if failure is not None:
            break
    if failure is not None:
        log.error("exiting: %s", failure)
        daemon.stop(min(grace_s, _FAILED_GRACE_S))
        print(f"{prog}: {one_line(failure)}; exiting", file=sys.stderr, flush=True)
        return 1
    log.info("shutting down: %s", draining)
    daemon.stop(grace_s)
    return 0

