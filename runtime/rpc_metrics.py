"""The lanekv metric set and the gRPC interceptor that counts calls.

``lanekv_metrics`` declares the metrics both daemons use on a ``Registry``
(``runtime.metrics``); ``RpcMetricsInterceptor`` counts every gRPC call by
method and final status code, aborted and streaming calls included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from lanekv.runtime.limits import is_non_blocking, same_kind
from lanekv.runtime.metrics import Counter, Gauge, Histogram, Registry
from lanekv.runtime.status import left_code

log = logging.getLogger(__name__)

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

        def non_blocking_response(request: Any, context: grpc.ServicerContext, *args: Any, **kwargs: Any) -> None:
            # Returns at once (health Watch); the stream ends later, when the call does.
            start = time.perf_counter()
            if not context.add_callback(lambda: record(left_code(context), start)):
                record(left_code(context), start)
            behavior(request, context, *args, **kwargs)

        if not handler.response_streaming:
            wrapped = unary_response
        elif is_non_blocking(behavior):
            wrapped = same_kind(non_blocking_response, behavior)
        else:
            wrapped = stream_response
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
        code = left_code(context)
        raise
    except Exception:  # as in unary_response
        code = _final_code(context, Code.UNKNOWN)
        raise
    finally:
        record(code)


def _final_code(context: grpc.ServicerContext, fallback: grpc.StatusCode) -> grpc.StatusCode:
    """The status the call ends with: the one the handler set or aborted with, else ``fallback``."""
    code = context.code()
    if not context.is_active() and (code == Code.CANCELLED or (code is None and fallback == Code.OK)):
        return left_code(context)  # the caller is gone
    return fallback if code is None else code


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
