"""Operating the daemons: /metrics, request log lines, health while draining, busy ports.

A prefill daemon (CP 2) and a decode daemon serve /metrics on free ports. After
a generation both show it: calls by method and code (the ranks' FetchKV and
Release, reported through their event queue, included), prompt and generated
tokens, KV bytes by owner rank (equal on both sides), pool gauges; refused
calls show up by code and failures by cause. Log lines of a request carry
its id. A second pair is stopped mid-generation: health goes NOT_SERVING, new
calls are refused, the open stream still runs to its end. A busy port makes
``lanekv prefill`` and ``lanekv decode`` exit 1 naming it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.status import TRANSFER_SERVICE
from lanekv.transfer.grpcfetch.client import KVClient, RemoteError

from lanekv.cli import main as lanekv
from tests.checkpoints import write_llama
from tests.daemons import start_pair, stop_pair
from tests.runtime.test_metrics import parse

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
PAGE_SIZE = 4
PAGES_PER_LANE = 32
POOL_PAGES = 160
TIMEOUT_S = 30.0
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 3 pages of 4: both ranks own some
# Greedy on write_llama's weights this prompt runs 900 tokens without an end-of-sequence token.
LONG_PROMPT = [11, 12, 13, 14, 15]
LONG_NEW_TOKENS = 400  # (5 + 399) / 4 = 101 pool pages
GENERATE = "lanekv.v1.DecodeService"
PREFILL = "lanekv.v1.PrefillService"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("operations-llama"))


def _pair(checkpoint, cp_size: int, metrics_port: int | None) -> tuple[PrefillDaemon, DecodeDaemon]:
    return start_pair(
        EngineConfig(str(checkpoint), cp_size=cp_size, page_size=PAGE_SIZE, pages_per_lane=PAGES_PER_LANE,
                     start_timeout_s=120),
        DaemonConfig(lease_s=600, metrics_port=metrics_port),
        pool_pages=POOL_PAGES, metrics_port=metrics_port,
    )


@pytest.fixture(scope="module")
def daemons(checkpoint) -> Iterator[tuple[PrefillDaemon, DecodeDaemon]]:
    prefill, decode = _pair(checkpoint, cp_size=2, metrics_port=0)
    yield prefill, decode
    stop_pair(prefill, decode)


class Scrape:
    """One /metrics page, parsed."""

    def __init__(self, port: int) -> None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=TIMEOUT_S) as reply:
            self.samples = parse(reply.read().decode())

    def __call__(self, name: str, **labels: object) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``."""
        want = {(k, str(v)) for k, v in labels.items()}
        return sum(value for (n, have), value in self.samples.items() if n == name and want <= have)


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def _request(ids: list[int], max_new_tokens: int, **fields) -> lanekv_pb2.GenerateRequest:
    return lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=ids), max_new_tokens=max_new_tokens,
                                      **fields)


def _generate(endpoint: str, request: lanekv_pb2.GenerateRequest) -> list[int]:
    with grpc.insecure_channel(endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=TIMEOUT_S)
        return [t for reply in call for t in reply.token_ids]


def _settled(prefill: PrefillDaemon, decode: DecodeDaemon) -> bool:
    return (prefill.leases.held() == {} and decode.stats().active_requests == 0
            and decode.stats().free_pages == POOL_PAGES)


def test_metrics_show_a_generation(daemons):
    prefill, decode = daemons
    assert _wait_for(lambda: _settled(prefill, decode))
    p0, d0 = Scrape(prefill.metrics_port), Scrape(decode.metrics_port)
    tokens = _generate(decode.endpoint, _request(PROMPT, 6))
    assert 1 <= len(tokens) <= 6
    assert _wait_for(lambda: _settled(prefill, decode))

    def prefill_caught_up() -> bool:  # the ranks' reports arrive through their event queue
        p = Scrape(prefill.metrics_port)
        return (p("lanekv_requests_total", service=TRANSFER_SERVICE, method="Release", code="OK")
                - p0("lanekv_requests_total", service=TRANSFER_SERVICE, method="Release", code="OK") == 2
                and p("lanekv_transfer_seconds_count") - p0("lanekv_transfer_seconds_count") == 2)

    assert _wait_for(prefill_caught_up)
    p, d = Scrape(prefill.metrics_port), Scrape(decode.metrics_port)

    def grew(scrape: Scrape, before: Scrape, name: str, **labels: object) -> float:
        return scrape(name, **labels) - before(name, **labels)

    assert grew(d, d0, "lanekv_requests_total", service=GENERATE, method="Generate", code="OK") == 1
    assert grew(d, d0, "lanekv_request_duration_seconds_count", service=GENERATE, method="Generate") == 1
    assert grew(d, d0, "lanekv_tokens_total", kind="prompt") == len(PROMPT)
    assert grew(d, d0, "lanekv_tokens_total", kind="generated") == len(tokens)
    assert grew(p, p0, "lanekv_requests_total", service=PREFILL, method="PrefillStream", code="OK") == 1
    assert grew(p, p0, "lanekv_tokens_total", kind="prompt") == len(PROMPT)
    assert grew(p, p0, "lanekv_requests_total", service=TRANSFER_SERVICE, method="FetchKV", code="OK") == 2
    # The KV bytes of each owner rank, as the rank sent them and as the decode side placed them.
    for rank in (0, 1):
        sent = grew(p, p0, "lanekv_transfer_bytes_total", rank=rank)
        assert sent > 0 and sent == grew(d, d0, "lanekv_transfer_bytes_total", rank=rank)
    assert grew(d, d0, "lanekv_transfer_seconds_count") == 1
    assert grew(d, d0, "lanekv_transfer_gigabytes_per_second_count") == 1
    # Pool gauges: every page is back after the release.
    assert d("lanekv_pool_pages_free", rank=0) == POOL_PAGES and d("lanekv_pool_pages_used", rank=0) == 0
    for lane in (0, 1):
        assert p("lanekv_pool_pages_free", rank=lane) == PAGES_PER_LANE
        assert p("lanekv_pool_pages_used", rank=lane) == 0


def test_pool_gauges_follow_pages_in_use(daemons):
    prefill, decode = daemons
    channel = grpc.insecure_channel(decode.endpoint)
    call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(_request(LONG_PROMPT, LONG_NEW_TOKENS),
                                                               timeout=TIMEOUT_S)
    try:
        next(call)  # the request's pages are in the pool now
        d = Scrape(decode.metrics_port)
        # The stream grows a page every PAGE_SIZE tokens, so the two gauges are read a moment apart.
        assert d("lanekv_pool_pages_used", rank=0) >= 2 and d("lanekv_pool_pages_free", rank=0) <= POOL_PAGES - 2
        assert d("lanekv_decode_active_requests") == 1
    finally:
        call.cancel()
        channel.close()
    assert _wait_for(lambda: _settled(prefill, decode))
    assert Scrape(decode.metrics_port)("lanekv_failures_total", cause="cancelled") >= 1


def test_refused_calls_show_by_code_and_cause(daemons):
    prefill, decode = daemons
    p0, d0 = Scrape(prefill.metrics_port), Scrape(decode.metrics_port)
    with pytest.raises(grpc.RpcError) as caught:
        _generate(decode.endpoint, _request(PROMPT, 0))
    assert caught.value.code() == Code.INVALID_ARGUMENT
    with grpc.insecure_channel(prefill.endpoint) as channel, pytest.raises(grpc.RpcError) as caught:
        lanekv_pb2_grpc.PrefillServiceStub(channel).Prefill(
            lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=[])), timeout=TIMEOUT_S)
    assert caught.value.code() == Code.INVALID_ARGUMENT
    with KVClient() as kv, pytest.raises(RemoteError) as fetched:
        kv.fetch({1: prefill.topology.endpoints[1]}, "no-such-request", prefill.contract.fingerprint,
                 lambda header, payload: None, timeout=TIMEOUT_S)
    assert fetched.value.code == Code.NOT_FOUND

    d = Scrape(decode.metrics_port)
    refused = dict(service=GENERATE, method="Generate", code="INVALID_ARGUMENT")
    assert d("lanekv_requests_total", **refused) - d0("lanekv_requests_total", **refused) == 1
    assert d("lanekv_failures_total", cause="invalid_argument") - d0("lanekv_failures_total",
                                                                     cause="invalid_argument") == 1
    p = Scrape(prefill.metrics_port)
    refused = dict(service=PREFILL, method="Prefill", code="INVALID_ARGUMENT")
    assert p("lanekv_requests_total", **refused) - p0("lanekv_requests_total", **refused) == 1
    assert p("lanekv_failures_total", cause="invalid_argument") - p0("lanekv_failures_total",
                                                                     cause="invalid_argument") == 1
    not_found = dict(service=TRANSFER_SERVICE, method="FetchKV", code="NOT_FOUND")
    assert _wait_for(lambda: Scrape(prefill.metrics_port)("lanekv_requests_total", **not_found)
                     - p0("lanekv_requests_total", **not_found) == 1)


def test_log_lines_of_a_request_carry_its_id(daemons, caplog):
    prefill, decode = daemons
    caplog.set_level(logging.INFO, logger="lanekv")
    rid = "ops-log-1"
    # A prompt no other test sent: nothing of it is cached, so both ranks' pages move.
    assert _generate(decode.endpoint, _request(list(reversed(PROMPT)), 3, request_id=rid))
    released = f"released request_id={rid} (every rank)"
    assert _wait_for(lambda: any(r.getMessage() == released for r in caplog.records))
    assert _wait_for(lambda: sum(r.getMessage().startswith(f"transfer done request_id={rid} rank=")
                                 for r in caplog.records) == 2)
    lines = [r.getMessage() for r in caplog.records if getattr(r, "request_id", None) == rid]
    assert all(f"request_id={rid} " in line for line in lines)
    for start in ("prefill done", "transfer done", "released", "generate finished"):
        assert any(line.startswith(f"{start} request_id={rid} ") for line in lines), (start, lines)
    # A stream the client leaves says so, with the request's id.
    cancelled = "ops-log-2"
    with grpc.insecure_channel(decode.endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(
            _request(LONG_PROMPT, LONG_NEW_TOKENS, request_id=cancelled), timeout=TIMEOUT_S)
        next(call)
        call.cancel()
    assert _wait_for(lambda: any(
        getattr(r, "request_id", None) == cancelled
        and r.getMessage().startswith(f"generate cancelled request_id={cancelled} ") and "cause=cancelled" in
        r.getMessage() for r in caplog.records))
    assert _wait_for(lambda: _settled(prefill, decode))


def _health(endpoint: str) -> tuple[grpc.Channel, health_pb2_grpc.HealthStub]:
    channel = grpc.insecure_channel(endpoint)
    return channel, health_pb2_grpc.HealthStub(channel)


def _stops_accepting(stub: health_pb2_grpc.HealthStub) -> bool:
    try:
        stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
    except grpc.RpcError as err:
        return err.code() == Code.UNAVAILABLE
    return False


@pytest.fixture(scope="module")
def drained(checkpoint) -> Iterator[tuple[PrefillDaemon, DecodeDaemon]]:
    """A pair of its own: the test stops it (a second stop does nothing)."""
    prefill, decode = _pair(checkpoint, cp_size=1, metrics_port=None)
    yield prefill, decode
    stop_pair(prefill, decode)


def test_stop_says_not_serving_and_drains_open_streams(drained):
    prefill, decode = drained
    channel, health = _health(decode.endpoint)
    watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
    assert next(watch).status == SERVING
    with grpc.insecure_channel(decode.endpoint) as generating:
        call = lanekv_pb2_grpc.DecodeServiceStub(generating).Generate(_request(LONG_PROMPT, LONG_NEW_TOKENS),
                                                                      timeout=TIMEOUT_S)
        tokens = list(next(call).token_ids)
        stopper = threading.Thread(target=decode.stop, kwargs={"grace_s": TIMEOUT_S})
        stopper.start()
        assert next(watch).status == NOT_SERVING
        watch.cancel()  # an open Watch would hold the drain for the whole grace period
        assert _wait_for(lambda: _stops_accepting(health))
        with pytest.raises(grpc.RpcError) as refused:
            _generate(decode.endpoint, _request(PROMPT, 2))
        assert refused.value.code() == Code.UNAVAILABLE
        # The stream that was open when the stop began runs to its end.
        replies = list(call)
        tokens += [t for reply in replies for t in reply.token_ids]
    assert len(tokens) == LONG_NEW_TOKENS and replies[-1].finished
    stopper.join(TIMEOUT_S)
    assert not stopper.is_alive()
    stats = decode.stats()
    assert stats.active_requests == 0 and stats.free_pages == POOL_PAGES
    channel.close()

    channel, health = _health(prefill.endpoint)
    watch = health.Watch(health_pb2.HealthCheckRequest(service=PREFILL), timeout=TIMEOUT_S)
    assert next(watch).status == SERVING
    stopper = threading.Thread(target=prefill.stop)
    stopper.start()
    assert next(watch).status == NOT_SERVING
    watch.cancel()
    stopper.join(TIMEOUT_S)
    assert not stopper.is_alive()
    channel.close()
    decode.stop()  # again: nothing happens
    prefill.stop()


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_busy_port_makes_the_daemons_exit_1_naming_it(checkpoint, busy_port, capsys):
    engine = ["--model", str(checkpoint), "--page-size", str(PAGE_SIZE)]
    decode = ["decode", *engine, "--prefill", "127.0.0.1:1", "--connect-timeout-s", "1"]
    for argv in (
        ["prefill", *engine, "--cp-size", "1", "--port", str(busy_port)],
        ["prefill", *engine, "--cp-size", "1", "--metrics-port", str(busy_port)],
        [*decode, "--port", str(busy_port)],
        [*decode, "--metrics-port", str(busy_port)],
        ["prefill", *engine, "--cp-size", "1", "--transfer-port-base", str(busy_port)],  # rank 0's port
    ):
        assert lanekv(argv) == 1, argv
        err = capsys.readouterr().err
        assert "could not start" in err and f"127.0.0.1:{busy_port}" in err, (argv, err)
