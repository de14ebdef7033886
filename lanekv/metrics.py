"""Prometheus metrics in the text exposition format (0.0.4), with no dependency.

Each daemon owns a ``Registry``; ``lanekv_metrics`` declares the metric set
both daemons use, ``serve_metrics`` serves ``GET /metrics`` over HTTP, and
``RpcMetricsInterceptor`` counts every gRPC call by method and final status.

    registry = Registry()
    metrics = lanekv_metrics(registry)
    server = make_server(security, 16, interceptors=[metrics.interceptor()])
    metrics.pool_pages_free.labels(rank=0).set_function(pool.free_count)
    endpoint = serve_metrics(registry, "127.0.0.1", 9400)
"""

from __future__ import annotations

import bisect
import http.server
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import grpc

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


class _Metric:
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

    def _new_child(self) -> Any:
        raise NotImplementedError

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

    def __init__(self, address: tuple[str, int], registry: Registry, family: int) -> None:
        self.address_family = family
        self.registry = registry
        super().__init__(address, _Handler)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
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


def serve_metrics(registry: Registry, host: str = "127.0.0.1", port: int = 0) -> MetricsEndpoint:
    """Serve ``GET /metrics`` on a daemon thread (404 elsewhere); port 0 picks a free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        server = _Server((host.strip("[]"), port), registry, family)
    except OSError as err:
        raise OSError(err.errno, f"cannot bind the metrics port {host}:{port}: {err.strerror or err}") from err
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.1}, name="lanekv-metrics", daemon=True
    )
    thread.start()
    return MetricsEndpoint(server, server.server_address[1], thread)


# -- gRPC calls -------------------------------------------------------------

Code = grpc.StatusCode
_HANDLER_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


class RpcMetricsInterceptor(grpc.ServerInterceptor):
    """Counts every call by service, method and final status code, and times it.

    Install it first (outermost) so that it also sees the calls a later
    interceptor refuses. A streaming call is counted when its stream ends: OK
    or the aborted code, or CANCELLED / DEADLINE_EXCEEDED when gRPC stops
    reading it. Unknown methods count as service and method 'unknown', so a
    caller cannot grow the label set.
    """

    def __init__(self, requests: Counter, seconds: Histogram | None = None) -> None:
        if not isinstance(requests, Counter) or requests.labelnames != ("service", "method", "code"):
            raise ValueError(f"requests must be a Counter labelled (service, method, code), got {requests!r}")
        if seconds is not None and (
            not isinstance(seconds, Histogram) or seconds.labelnames != ("service", "method")
        ):
            raise ValueError(f"seconds must be a Histogram labelled (service, method), got {seconds!r}")
        self._requests, self._seconds = requests, seconds

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            self._requests.labels(service="unknown", method="unknown", code=Code.UNIMPLEMENTED.name).inc()
            return None
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        attribute, make = _HANDLER_KINDS[bool(handler.request_streaming), bool(handler.response_streaming)]
        behavior = getattr(handler, attribute)

        def record(code: grpc.StatusCode, start: float) -> None:
            self._requests.labels(service=service, method=method, code=code.name).inc()
            if self._seconds is not None:
                self._seconds.labels(service=service, method=method).observe(time.perf_counter() - start)

        def unary_response(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                response = behavior(request, context)
            except Exception:  # an abort, or a bug gRPC answers with UNKNOWN: counted, then re-raised
                record(_final_code(context, Code.UNKNOWN), start)
                raise
            record(_final_code(context, Code.OK), start)
            return response

        def stream_response(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            start = time.perf_counter()
            try:
                responses = behavior(request, context)
            except Exception:  # as above
                record(_final_code(context, Code.UNKNOWN), start)
                raise
            return _watched(responses, context, lambda code: record(code, start))

        wrapped = stream_response if handler.response_streaming else unary_response
        return make(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def _watched(
    responses: Any, context: grpc.ServicerContext, record: Callable[[grpc.StatusCode], None]
) -> Iterator[Any]:
    """Pass ``responses`` through and record the code the stream ends with."""
    code = Code.UNKNOWN
    try:
        yield from responses
        code = _final_code(context, Code.OK)
    except GeneratorExit:  # gRPC dropped the stream: the client went away or the deadline passed
        code = Code.DEADLINE_EXCEEDED if context.time_remaining() <= 0 else Code.CANCELLED
        raise
    except Exception:  # as in unary_response
        code = _final_code(context, Code.UNKNOWN)
        raise
    finally:
        record(code)


def _final_code(context: grpc.ServicerContext, fallback: grpc.StatusCode) -> grpc.StatusCode:
    """The status the call ends with: the one the handler set or aborted with, else ``fallback``."""
    code = context.code()
    if code is not None:
        return code
    if fallback == Code.OK and not context.is_active():  # finished, but the caller is gone
        return Code.DEADLINE_EXCEEDED if context.time_remaining() <= 0 else Code.CANCELLED
    return fallback


# -- the lanekv metric set --------------------------------------------------

# Calls range from a millisecond (Handshake, Release) to minutes (a long Generate stream).
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)
GBPS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass(frozen=True)
class LanekvMetrics:
    """The metrics both daemons export, under the same names.

    ``failures`` causes are short snake_case words: contract_mismatch,
    checksum, rank_died, out_of_pages, lease_expired, deadline, cancelled.
    ``rank`` labels a prefill CP rank (the owner of the pages moved); the
    decode daemon's single pool is rank 0.
    """

    requests: Counter  # service, method, code
    request_seconds: Histogram  # service, method
    tokens: Counter  # kind: prompt | generated
    transfer_bytes: Counter  # rank
    transfer_seconds: Histogram
    transfer_gbps: Histogram
    failures: Counter  # cause
    pool_pages_used: Gauge  # rank
    pool_pages_free: Gauge  # rank

    def interceptor(self) -> RpcMetricsInterceptor:
        return RpcMetricsInterceptor(self.requests, self.request_seconds)

    def record_transfer(self, bytes_by_rank: dict[int, int], seconds: float) -> None:
        """One request's KV transfer: its bytes from each owner rank and its wall time."""
        for rank, nbytes in bytes_by_rank.items():
            self.transfer_bytes.labels(rank=rank).inc(nbytes)
        self.transfer_seconds.observe(seconds)
        if seconds > 0:
            self.transfer_gbps.observe(sum(bytes_by_rank.values()) / seconds / 1e9)


def lanekv_metrics(registry: Registry) -> LanekvMetrics:
    """Declare the standard metric set in ``registry`` (again: the same objects)."""
    r = registry
    return LanekvMetrics(
        requests=r.counter("lanekv_requests_total", "gRPC calls by final status code",
                           ("service", "method", "code")),
        request_seconds=r.histogram("lanekv_request_duration_seconds",
                                    "gRPC call time, to the end of the stream for streaming calls",
                                    LATENCY_BUCKETS_S, ("service", "method")),
        tokens=r.counter("lanekv_tokens_total", "tokens processed", ("kind",)),
        transfer_bytes=r.counter("lanekv_transfer_bytes_total", "KV bytes moved, by owner rank", ("rank",)),
        transfer_seconds=r.histogram("lanekv_transfer_seconds", "wall time of one request's KV transfer",
                                     LATENCY_BUCKETS_S),
        transfer_gbps=r.histogram("lanekv_transfer_gigabytes_per_second",
                                  "KV transfer throughput of one request (1e9 bytes per second)",
                                  GBPS_BUCKETS),
        failures=r.counter("lanekv_failures_total", "failed requests by cause", ("cause",)),
        pool_pages_used=r.gauge("lanekv_pool_pages_used", "KV pool pages in use", ("rank",)),
        pool_pages_free=r.gauge("lanekv_pool_pages_free", "KV pool pages free", ("rank",)),
    )
