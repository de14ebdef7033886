"""lanekv.runtime.metrics: exposition text, counters and histograms, the HTTP endpoint, the RPC interceptor."""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.runtime.metrics import CONTENT_TYPE, Registry, serve_metrics
from lanekv.runtime.rpc_metrics import lanekv_metrics
from lanekv.runtime.security import SecurityConfig, bind, make_server, open_channel
from lanekv.runtime.status import HealthServicer

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode
TIMEOUT_S = 5.0

# The text format 0.0.4, line by line.
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_PAIR = r'[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
_VALUE = r"NaN|[+-]Inf|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
SAMPLE = re.compile(rf"(?P<name>{_NAME})(?:\{{(?P<labels>{_PAIR}(?:,{_PAIR})*)\}})? (?P<value>{_VALUE})")
HELP = re.compile(rf"# HELP (?P<name>{_NAME}) (?:[^\\\n]|\\[\\n])*")
TYPE = re.compile(rf"# TYPE (?P<name>{_NAME}) (?P<kind>counter|gauge|histogram|summary|untyped)")
PAIR = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    """Samples keyed by (name, labels); fails on any line outside the format."""
    assert text.endswith("\n")
    kinds: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if m := TYPE.fullmatch(line):
            kinds[m["name"]] = m["kind"]
            continue
        if HELP.fullmatch(line):
            continue
        m = SAMPLE.fullmatch(line)
        assert m, f"not an exposition line: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", m["name"]) if m["name"] not in kinds else m["name"]
        assert family in kinds, f"sample {line!r} before its TYPE line"
        labels = frozenset((k, _unescape(v)) for k, v in PAIR.findall(m["labels"] or ""))
        key = (m["name"], labels)
        assert key not in samples, f"sample {line!r} twice"
        samples[key] = float(m["value"])
    return samples


def L(**labels: str) -> frozenset:
    return frozenset(labels.items())


def test_render_is_exposition_text_with_escaped_labels() -> None:
    registry = Registry()
    requests = registry.counter("t_requests_total", "calls\nby code, a \\ backslash", ("method", "code"))
    odd = 'a"b\\c\nd}{,='
    requests.labels(method=odd, code="OK").inc(2)
    requests.labels(method="Fetch", code="NOT_FOUND").inc()
    registry.counter("t_empty_total", "never used", ("cause",))
    level = registry.gauge("t_level", "a level")
    level.set(7)
    level.dec(2.5)
    free = [10]
    registry.gauge("t_free", "evaluated at scrape", ("rank",)).labels(rank=0).set_function(lambda: free[0])
    latency = registry.histogram("t_seconds", "latency", (0.1, 1.0, 10.0), ("method",))
    for value in (0.001, 0.1, 0.1, 0.5, 2.0, 100.0):
        latency.labels(method="Fetch").observe(value)
    samples = parse(registry.render())
    assert samples[("t_requests_total", L(method=odd, code="OK"))] == 2
    assert samples[("t_requests_total", L(method="Fetch", code="NOT_FOUND"))] == 1
    assert samples[("t_level", L())] == 4.5
    assert samples[("t_free", L(rank="0"))] == 10
    free[0] = 3
    assert parse(registry.render())[("t_free", L(rank="0"))] == 3
    buckets = {le: samples[("t_seconds_bucket", L(method="Fetch", le=le))] for le in ("0.1", "1.0", "10.0", "+Inf")}
    assert buckets == {"0.1": 3, "1.0": 4, "10.0": 5, "+Inf": 6}  # 'le' is inclusive and cumulative
    assert samples[("t_seconds_count", L(method="Fetch"))] == 6
    assert samples[("t_seconds_sum", L(method="Fetch"))] == pytest.approx(102.701)
    assert "# TYPE t_empty_total counter" in registry.render()


def test_counts_add_up_across_threads() -> None:
    registry = Registry()
    counter = registry.counter("t_total", "n", ("worker",))
    plain = registry.counter("t_plain_total", "n")
    histogram = registry.histogram("t_size", "n", (1.0, 2.0))
    threads, per_thread = 4, 2000

    def work(worker: int) -> None:
        for i in range(per_thread):
            counter.labels(worker=worker % 2).inc()
            plain.inc(0.5)
            histogram.observe(i % 3)

    pool = [threading.Thread(target=work, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(30)
    samples = parse(registry.render())
    assert samples[("t_total", L(worker="0"))] + samples[("t_total", L(worker="1"))] == threads * per_thread
    assert plain.value == threads * per_thread / 2
    snapshot = histogram.snapshot()
    assert snapshot.count == threads * per_thread == samples[("t_size_bucket", L(le="+Inf"))]
    assert snapshot.sum == sum(i % 3 for i in range(per_thread)) * threads


def test_a_failing_gauge_function_drops_only_its_sample() -> None:
    registry = Registry()
    gauge = registry.gauge("t_pages", "pages", ("rank",))
    gauge.labels(rank=0).set_function(lambda: 1 / 0)
    gauge.labels(rank=1).set(5)
    samples = parse(registry.render())
    assert ("t_pages", L(rank="0")) not in samples and samples[("t_pages", L(rank="1"))] == 5


def test_declaration_errors_name_the_problem() -> None:
    registry = Registry()
    with pytest.raises(ValueError, match="name"):
        registry.counter("bad-name", "x")
    with pytest.raises(ValueError, match="label"):
        registry.counter("t_total", "x", ("bad-label",))
    with pytest.raises(ValueError, match="twice"):
        registry.counter("t_total", "x", ("a", "a"))
    with pytest.raises(ValueError, match="le"):
        registry.histogram("t_h", "x", (1.0,), ("le",))
    with pytest.raises(ValueError, match="buckets"):
        registry.histogram("t_h", "x", (2.0, 1.0))
    counter = registry.counter("t_total", "x", ("code",))
    assert registry.counter("t_total", "again", ("code",)) is counter
    with pytest.raises(ValueError, match="already declared"):
        registry.gauge("t_total", "x", ("code",))
    with pytest.raises(ValueError, match="labels must be"):
        counter.labels(cause="x")
    with pytest.raises(AttributeError, match="labels"):
        counter.inc()
    with pytest.raises(ValueError, match="only goes up"):
        counter.labels(code="OK").inc(-1)
    with pytest.raises(ValueError, match="NaN"):
        registry.histogram("t_h", "x", (1.0,)).observe(float("nan"))


def test_lanekv_metric_set_is_declared_once_and_records_transfers() -> None:
    registry = Registry()
    metrics = lanekv_metrics(registry)
    assert lanekv_metrics(registry) == metrics  # the same objects: both daemons may call it
    metrics.record_transfer({0: 3_000_000_000, 1: 1_000_000_000}, 2.0)
    metrics.tokens.labels(kind="generated").inc(5)
    samples = parse(registry.render())
    assert samples[("lanekv_transfer_bytes_total", L(rank="0"))] == 3e9
    assert samples[("lanekv_transfer_gigabytes_per_second_sum", L())] == 2.0
    assert samples[("lanekv_transfer_seconds_count", L())] == 1
    assert samples[("lanekv_tokens_total", L(kind="generated"))] == 5


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, "", ""


def test_http_endpoint_serves_metrics_and_404s_elsewhere() -> None:
    registry = Registry()
    registry.counter("t_total", "n").inc(3)
    endpoint = serve_metrics(registry, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        status, content_type, body = _get(f"{base}/metrics")
        assert (status, content_type) == (200, CONTENT_TYPE)
        assert parse(body)[("t_total", L())] == 3
        assert _get(f"{base}/metrics?debug=1")[0] == 200
        assert _get(f"{base}/")[0] == 404 and _get(f"{base}/metricsx")[0] == 404
        with pytest.raises(OSError, match=f"127.0.0.1:{endpoint.port}"):
            serve_metrics(registry, "127.0.0.1", endpoint.port)
    finally:
        endpoint.close()
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", endpoint.port), timeout=1):
        pass


# -- the RPC interceptor ----------------------------------------------------

TOKEN = "metrics-test-token"
SERVICE = "lanekv.test.Calls"


def _slow(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    # Blind to cancellation: gRPC has to drop the stream for the call to end early.
    for _ in range(500):
        yield b"tick"
        time.sleep(0.01)


def _abort_midway(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first"
    context.abort(Code.RESOURCE_EXHAUSTED, "out of pages")


def _not_found(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.set_code(Code.NOT_FOUND)
    context.set_details("no such request")
    return b""


def _raise(request: bytes, context: grpc.ServicerContext) -> bytes:
    raise ValueError("a bug")


def _calls_handler() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Ok": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Invalid": grpc.unary_unary_rpc_method_handler(
            lambda request, context: context.abort(Code.INVALID_ARGUMENT, "bad")),
        "NotFound": grpc.unary_unary_rpc_method_handler(_not_found),
        "Raise": grpc.unary_unary_rpc_method_handler(_raise),
        "Stream": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request] * 4)),
        "AbortMidway": grpc.unary_stream_rpc_method_handler(_abort_midway),
        "Slow": grpc.unary_stream_rpc_method_handler(_slow),
        "Sum": grpc.stream_unary_rpc_method_handler(lambda requests, context: b"".join(requests)),
        "Chat": grpc.stream_stream_rpc_method_handler(lambda requests, context: (r.upper() for r in requests)),
    })


def _eventually(check, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the interceptor never recorded the call"
        time.sleep(0.01)


def test_interceptor_counts_every_call_by_final_code() -> None:
    registry = Registry()
    metrics = lanekv_metrics(registry)
    config = SecurityConfig(token=TOKEN)
    server = make_server(config, max_workers=8, interceptors=[metrics.interceptor()])
    server.add_generic_rpc_handlers((_calls_handler(),))
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = bind(server, "127.0.0.1", 0, config)
    server.start()

    def count(method: str, code: Code, service: str = SERVICE) -> float:
        return metrics.requests.labels(service=service, method=method, code=code.name).value

    try:
        with open_channel(f"127.0.0.1:{port}", config) as channel:
            def call(method: str, kind: str = "unary_unary", request=b"x", **kw):
                return getattr(channel, kind)(f"/{SERVICE}/{method}")(request, timeout=TIMEOUT_S, **kw)

            assert call("Ok") == b"x" and call("Ok") == b"x"
            assert list(call("Stream", "unary_stream")) == [b"x"] * 4
            assert call("Sum", "stream_unary", iter([b"a", b"b"])) == b"ab"
            assert list(call("Chat", "stream_stream", iter([b"a", b"b"]))) == [b"A", b"B"]
            for method, kind in (("Invalid", "unary_unary"), ("NotFound", "unary_unary"),
                                 ("Raise", "unary_unary"), ("AbortMidway", "unary_stream"),
                                 ("Missing", "unary_unary")):
                with pytest.raises(grpc.RpcError):
                    result = call(method, kind)
                    list(result) if kind == "unary_stream" else result
            stream = call("Slow", "unary_stream")
            assert next(stream) == b"tick"
            stream.cancel()
            with pytest.raises(grpc.RpcError) as caught:
                list(channel.unary_stream(f"/{SERVICE}/Slow")(b"x", timeout=0.3))
            assert caught.value.code() == Code.DEADLINE_EXCEEDED
        with grpc.insecure_channel(f"127.0.0.1:{port}") as bare:  # no token
            with pytest.raises(grpc.RpcError):
                bare.unary_unary(f"/{SERVICE}/Ok")(b"x", timeout=TIMEOUT_S)
            health_pb2_grpc.HealthStub(bare).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)

        assert count("Ok", Code.OK) == 2
        assert count("Stream", Code.OK) == 1
        assert count("Sum", Code.OK) == 1 and count("Chat", Code.OK) == 1
        assert count("Invalid", Code.INVALID_ARGUMENT) == 1
        assert count("NotFound", Code.NOT_FOUND) == 1
        assert count("Raise", Code.UNKNOWN) == 1
        assert count("AbortMidway", Code.RESOURCE_EXHAUSTED) == 1
        assert count("unknown", Code.UNIMPLEMENTED, service="unknown") == 1
        assert count("Ok", Code.UNAUTHENTICATED) == 1  # counted before the token check refused it
        assert count("Check", Code.OK, service="grpc.health.v1.Health") == 1
        _eventually(lambda: count("Slow", Code.CANCELLED) == 1 and count("Slow", Code.DEADLINE_EXCEEDED) == 1)
        timed = metrics.request_seconds.labels(service=SERVICE, method="Ok").snapshot()
        assert timed.count == 3 and timed.sum >= 0  # two served, one refused
        samples = parse(registry.render())
        assert samples[("lanekv_requests_total", L(service=SERVICE, method="Ok", code="OK"))] == 2
    finally:
        server.stop(None)
