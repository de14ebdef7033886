"""Prometheus metrics in the text exposition format (0.0.4), with no dependency.

Each daemon owns a ``Registry``; ``serve_metrics`` serves ``GET /metrics``
over HTTP, or, given the daemon's ``SecurityConfig``, with its TLS
(HTTPS; client certificates when it requires them) and its token
(``Authorization: Bearer <token>``, else 401). The metric set both daemons
use and the interceptor that counts gRPC calls are in ``runtime.rpc_metrics``.

    registry = Registry()
    metrics = lanekv_metrics(registry)
    server = make_server(security, 16, interceptors=[metrics.interceptor()])
    metrics.pool_pages_free.labels(rank=0).set_function(pool.free_count)
    endpoint = serve_metrics(registry, "127.0.0.1", 9400)
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import http.server
import logging
import math
import re
import socket
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from lanekv.runtime.security import SecurityConfig

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: Sequence[tuple[str, str]], value: float) -> str:
    if not labels:
        return f"{name} {_fmt(value)}"
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return f"{name}{{{body}}} {_fmt(value)}"


class CounterChild:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock, self._value = lock, 0.0

    def inc(self, amount: float = 1.0) -> None:
        if not (math.isfinite(amount) and amount >= 0):
            raise ValueError(f"a counter only goes up: amount must be finite and >= 0, got amount={amount!r}")
        with self._lock:
            self._value += amount

    @property
    def value(self) -> float:
        with self._lock:
            return self._value


class GaugeChild:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock, self._value = lock, 0.0
        self._function: Callable[[], float] | None = None

    def set(self, value: float) -> None:
        with self._lock:
            self._value, self._function = float(value), None

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.inc(-amount)

    def set_function(self, function: Callable[[], float]) -> None:
        """Read the value from ``function`` at every scrape (e.g. a pool's free pages)."""
        if not callable(function):
            raise TypeError(f"function must be callable, got function={function!r}")
        with self._lock:
            self._function = function

    @property
    def value(self) -> float:
        with self._lock:
            value, function = self._value, self._function
        # Outside the lock: the function may take locks of its own (a pool's).
        return float(function()) if function is not None else value


class HistogramSnapshot(NamedTuple):
    buckets: tuple[tuple[float, int], ...]  # (upper bound, cumulative count), the last bound +Inf
    sum: float
    count: int


class HistogramChild:
    def __init__(self, lock: threading.Lock, bounds: tuple[float, ...]) -> None:
        self._lock, self._bounds = lock, bounds  # bounds end with +Inf
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            raise ValueError("cannot observe NaN")
        i = bisect.bisect_left(self._bounds, value)  # the first bound >= value ('le')
        with self._lock:
            self._counts[i] += 1
            self._sum += value

    @contextmanager
    def time(self) -> Iterator[None]:
        """Observe the seconds the ``with`` block takes."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(time.perf_counter() - start)

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip(self._bounds, counts):
            running += n
            cumulative.append((bound, running))
        return HistogramSnapshot(tuple(cumulative), total, running)


class _Metric(ABC):
    """A metric family: one child per combination of label values.

    An unlabelled metric has one child, and forwards the child's methods
    (``counter.inc()``, ``gauge.set_function(f)``, ``histogram.observe(x)``) to it.
    """

    kind = ""
    _forwarded: frozenset[str] = frozenset()

    def __init__(self, name: str, description: str, labels: Sequence[str]) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"name must match {_NAME.pattern}, got name={name!r}")
        labels = tuple(labels)
        for label in labels:
            if not isinstance(label, str) or not _LABEL.match(label) or label.startswith("__"):
                raise ValueError(f"{name}: label names must match {_LABEL.pattern} without a leading __, got {label!r}")
        if len(set(labels)) != len(labels):
            raise ValueError(f"{name}: labels {list(labels)} name a label twice")
        self.name, self.description, self.labelnames = name, description, labels
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], Any] = {}
        if not labels:
            self._children[()] = self._new_child()

    @abstractmethod
    def _new_child(self) -> Any:
        """A fresh child of this metric's kind."""

    def labels(self, **values: object) -> Any:
        """The child of these label values (created at first use); values are turned into str."""
        if set(values) != set(self.labelnames):
            raise ValueError(f"{self.name}: labels must be {list(self.labelnames)}, got {sorted(values)}")
        key = tuple(str(values[label]) for label in self.labelnames)
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self._new_child()
            return child

    def __getattr__(self, attribute: str) -> Any:
        if attribute not in type(self)._forwarded:
            raise AttributeError(f"{type(self).__name__} has no attribute {attribute!r}")
        if self.labelnames:
            raise AttributeError(f"{self.name} has labels {list(self.labelnames)}: call .labels(...) first")
        return getattr(self._children[()], attribute)

    def _items(self) -> list[tuple[tuple[tuple[str, str], ...], Any]]:
        with self._lock:
            items = sorted(self._children.items())
        return [(tuple(zip(self.labelnames, key)), child) for key, child in items]

    def samples(self) -> list[str]:
        return [_sample(self.name, labels, child.value) for labels, child in self._items()]

    def same_as(self, other: _Metric) -> bool:
        return type(self) is type(other) and self.labelnames == other.labelnames


class Counter(_Metric):
    kind = "counter"
    _forwarded = frozenset({"inc", "value"})

    def _new_child(self) -> CounterChild:
        return CounterChild(self._lock)


class Gauge(_Metric):
    kind = "gauge"
    _forwarded = frozenset({"set", "inc", "dec", "set_function", "value"})

    def _new_child(self) -> GaugeChild:
        return GaugeChild(self._lock)

    def samples(self) -> list[str]:
        lines = []
        for labels, child in self._items():
            try:
                lines.append(_sample(self.name, labels, child.value))
            except Exception:  # a failing callback drops its sample, never the whole scrape
                log.exception("metric %s%s: the gauge function failed", self.name, dict(labels))
        return lines


class Histogram(_Metric):
    kind = "histogram"
    _forwarded = frozenset({"observe", "time", "snapshot"})

    def __init__(self, name: str, description: str, buckets: Sequence[float], labels: Sequence[str]) -> None:
        bounds = [float(b) for b in buckets]
        if not bounds or any(not math.isfinite(b) for b in bounds) or bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be finite and strictly increasing, got buckets={list(buckets)!r}")
        if "le" in labels:
            raise ValueError(f"{name}: 'le' is the bucket label of a histogram; pick another label name")
        self.bounds = (*bounds, math.inf)
        super().__init__(name, description, labels)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self._lock, self.bounds)

    def samples(self) -> list[str]:
        lines = []
        for labels, child in self._items():
            snap = child.snapshot()
            for bound, count in snap.buckets:
                lines.append(_sample(f"{self.name}_bucket", (*labels, ("le", _fmt(bound))), count))
            lines.append(_sample(f"{self.name}_sum", labels, snap.sum))
            lines.append(_sample(f"{self.name}_count", labels, snap.count))
        return lines

    def same_as(self, other: _Metric) -> bool:
        return super().same_as(other) and self.bounds == getattr(other, "bounds", None)


class Registry:
    """The metrics of one daemon; declaring a metric again with the same shape returns it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, _Metric] = {}

    def counter(self, name: str, description: str, labels: Sequence[str] = ()) -> Counter:
        return self._register(Counter(name, description, labels))

    def gauge(self, name: str, description: str, labels: Sequence[str] = ()) -> Gauge:
        return self._register(Gauge(name, description, labels))

    def histogram(
        self, name: str, description: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        return self._register(Histogram(name, description, buckets, labels))

    def _register(self, metric: Any) -> Any:
        with self._lock:
            known = self._metrics.get(metric.name)
            if known is None:
                self._metrics[metric.name] = metric
                return metric
        if not known.same_as(metric):
            raise ValueError(
                f"metric {metric.name} is already declared as a {known.kind} with labels {list(known.labelnames)}"
            )
        return known

    def render(self) -> str:
        """Every metric in the text exposition format, in the order declared."""
        with self._lock:
            metrics = list(self._metrics.values())
        lines = []
        for metric in metrics:
            description = metric.description.replace("\\", "\\\\").replace("\n", "\\n")
            lines += [f"# HELP {metric.name} {description}", f"# TYPE {metric.name} {metric.kind}"]
            lines += metric.samples()
        return "\n".join(lines) + "\n"


# -- HTTP endpoint ----------------------------------------------------------


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a slow scraper never holds up close()

    def __init__(self, address: tuple[str, int], registry: Registry, family: int,
                 security: SecurityConfig) -> None:
        self.address_family = family
        self.registry = registry
        self.expected = None if security.token is None else _digest(f"Bearer {security.token}")
        super().__init__(address, _Handler)
        self.tls = _tls_context(security)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, address = super().get_request()
        if self.tls is not None:
            # The handshake runs in the request's thread (do_handshake_on_connect
            # off), so a client that never completes one holds up no one else.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            request.settimeout(10.0)
            try:
                request.do_handshake()
            except (OSError, ssl.SSLError) as err:
                log.debug("metrics %s: TLS handshake failed: %s", client_address, err)
                return
        super().finish_request(request, client_address)


def _tls_context(security: SecurityConfig) -> ssl.SSLContext | None:
    if not security.tls:
        return None
    if security.tls_cert is None:
        raise ValueError(f"serving /metrics over TLS needs tls_cert and tls_key; only tls_ca={security.tls_ca!r} is given")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.require_client_cert:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(security.tls_ca)
    return context


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        expected = self.server.expected
        if expected is not None:
            given = self.headers.get_all("Authorization") or []
            if len(given) != 1 or not hmac.compare_digest(_digest(given[0]), expected):
                self.send_response(401, "the daemon's token is required")
                self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        if urlsplit(self.path).path != "/metrics":
            self.send_error(404, "only /metrics is served here")
            return
        body = self.server.registry.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        log.debug("metrics %s: " + format, self.address_string(), *args)


class MetricsEndpoint(NamedTuple):
    server: http.server.ThreadingHTTPServer
    port: int
    thread: threading.Thread

    def close(self, timeout_s: float = 5.0) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout_s)


def serve_metrics(
    registry: Registry, host: str = "127.0.0.1", port: int = 0, security: SecurityConfig | None = None
) -> MetricsEndpoint:
    """Serve ``GET /metrics`` on a daemon thread (404 elsewhere); port 0 picks a free port.

    With ``security`` (the daemon's): HTTPS when it has TLS, and 401 without
    its token when it has one. None: plain HTTP, open to anyone who can reach
    ``host`` (bind it to an address only the scraper reaches).
    """
    security = SecurityConfig() if security is None else security
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        server = _Server((host.strip("[]"), port), registry, family, security)
    except OSError as err:
        raise OSError(err.errno, f"cannot bind the metrics port {host}:{port}: {err.strerror or err}") from err
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="lanekv-metrics", daemon=True
    )
    thread.start()
    return MetricsEndpoint(server, server.server_address[1], thread)


class PrefixMetrics(NamedTuple):
    """A daemon's prefix-cache metrics (``side``: prefill or decode): prompt tokens looked
    up and found, the hit rate, pages evicted, and (decode) KV bytes a hit did not move."""

    lookup_tokens: Any
    hit_tokens: Any
    bytes_not_moved: Any

    @classmethod
    def on(cls, registry: Registry, side: str, evicted: Callable[[], float]) -> PrefixMetrics:
        lookup = registry.counter("lanekv_prefix_cache_lookup_tokens_total",
                                  "prompt tokens looked up in the prefix cache", ("side",)).labels(side=side)
        hit = registry.counter("lanekv_prefix_cache_hit_tokens_total",
                               "prompt tokens found in the prefix cache (whole pages)", ("side",)).labels(side=side)
        registry.gauge("lanekv_prefix_cache_hit_rate", "hit tokens / looked-up tokens since start",
                       ("side",)).labels(side=side).set_function(
            lambda: hit.value / lookup.value if lookup.value else 0.0)
        registry.gauge("lanekv_prefix_cache_evicted_pages", "cached pages evicted since start (LRU, idle only)",
                       ("side",)).labels(side=side).set_function(evicted)
        moved = registry.counter("lanekv_prefix_cache_kv_bytes_not_moved_total",
                                 "KV bytes a decode-side hit kept from moving", ("side",)).labels(side=side)
        return cls(lookup, hit, moved)
