"""Open health streams must not starve a server; calls at once are bounded.

With TLS and a token, health stays open (probes carry no token). Each open
Watch used to hold one of the server's worker threads (the interceptors
turned grpc_health's non-blocking Watch into a blocking one), so 20 Watches
on a rank port of 16 workers made every authenticated call wait out its
deadline. Now a Watch holds no thread, open calls are bounded per peer host
and in total (RESOURCE_EXHAUSTED beyond), and authenticated calls keep
their own threads and bounds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.proto import lanekv_pb2 as pb
from lanekv.proto import lanekv_pb2_grpc
from lanekv.runtime.limits import Admission, CallLimits, CallLimitsInterceptor, peer_host
from lanekv.runtime.metrics import Registry
from lanekv.runtime.requests import MalformedRequestInterceptor
from lanekv.runtime.rpc_metrics import lanekv_metrics
from lanekv.runtime.security import OPEN_SERVICES, SecurityConfig, open_channel
from lanekv.runtime.status import HealthServicer
from lanekv.transfer.rank.server import add_transfer_service
from lanekv.transfer.rank.service import KVTransferService

from tests.reliability.kv_cluster import make_agreement, start_servers, status_of, wait_until
from tests.tls import make_certs

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode
TOKEN = "limits-Token_0123456789"
WATCHES = 40  # the 20 on a 16-worker rank port, twice over


@pytest.fixture(scope="module")
def tls_rank(tmp_path_factory) -> Iterator[tuple[str, SecurityConfig, SecurityConfig]]:
    certs = make_certs(tmp_path_factory.mktemp("limits-certs"))
    served = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca, token=TOKEN)
    servers = start_servers(1, 4, security=served)
    try:
        yield servers.endpoints[0], SecurityConfig(tls_ca=certs.ca), SecurityConfig(tls_ca=certs.ca, token=TOKEN)
    finally:
        servers.stop()


def _open_watches(channel: grpc.Channel, count: int, timeout: float = 30) -> tuple[list, list[Code]]:
    """``count`` Watch streams; each one's first answer (SERVING) or refusal code."""
    health = health_pb2_grpc.HealthStub(channel)
    calls, outcomes = [], []
    for _ in range(count):
        call = health.Watch(health_pb2.HealthCheckRequest(), timeout=timeout)
        calls.append(call)
        try:
            first = next(call)
            assert first.status == health_pb2.HealthCheckResponse.SERVING
            outcomes.append(Code.OK)
        except grpc.RpcError as err:
            outcomes.append(err.code())
            assert "open" in err.details(), err.details()
    return calls, outcomes


def test_open_watches_leave_authenticated_calls_served(tls_rank):
    endpoint, no_token, with_token = tls_rank
    limits = CallLimits.for_workers(16)
    with open_channel(endpoint, no_token) as watching, open_channel(endpoint, with_token) as working:
        calls, outcomes = _open_watches(watching, WATCHES)
        try:
            assert outcomes.count(Code.OK) == limits.watch_per_peer, outcomes
            assert outcomes.count(Code.RESOURCE_EXHAUSTED) == WATCHES - limits.watch_per_peer, outcomes
            # Authenticated calls run at once beside the open streams, 20 together.
            kv = lanekv_pb2_grpc.KVTransferStub(working)
            health = health_pb2_grpc.HealthStub(working)
            agreement = make_agreement().encode()
            results: list[tuple[bool, int]] = []

            def work() -> None:
                ok = kv.Handshake(pb.HandshakeRequest(contract=agreement), timeout=5).ok
                results.append((ok, health.Check(health_pb2.HealthCheckRequest(), timeout=5).status))

            threads = [threading.Thread(target=work) for _ in range(20)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(20)
            assert results == [(True, health_pb2.HealthCheckResponse.SERVING)] * 20, results
        finally:
            for call in calls:
                call.cancel()
        # The slots come back when the streams end: new Watches are admitted again.
        again, outcomes = _wait_for_free_slots(watching, limits.watch_per_peer)
        for call in again:
            call.cancel()
        assert outcomes == [Code.OK] * limits.watch_per_peer, outcomes


def _wait_for_free_slots(channel: grpc.Channel, count: int) -> tuple[list, list[Code]]:
    for _ in range(50):
        calls, outcomes = _open_watches(channel, count)
        if outcomes == [Code.OK] * count:
            return calls, outcomes
        for call in calls:
            call.cancel()
        threading.Event().wait(0.1)
    return calls, outcomes


def test_a_watch_holds_no_worker_thread():
    # One thread, every interceptor a daemon installs, limits that admit 40
    # Watches: blocking Watches would hold the thread, and later Watches and the
    # Handshake would wait for it (seen: the 40 never all answer).
    registry = Registry()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=1),
        interceptors=[lanekv_metrics(registry).interceptor(), MalformedRequestInterceptor(),
                      CallLimitsInterceptor(CallLimits(64, 64, WATCHES, WATCHES, WATCHES, WATCHES), OPEN_SERVICES)],
    )
    servers = start_servers(1, 4)
    add_transfer_service(server, KVTransferService(servers.sources[0]))
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls, outcomes = _open_watches(channel, WATCHES, timeout=3)
            try:
                assert outcomes == [Code.OK] * WATCHES, outcomes
                kv = lanekv_pb2_grpc.KVTransferStub(channel)
                request = pb.HandshakeRequest(contract=make_agreement().encode())
                assert status_of(lambda: kv.Handshake(request, timeout=3)) == Code.OK
            finally:
                for call in calls:
                    call.cancel()
        # The metrics count a Watch when it ends.
        assert wait_until(lambda: 'method="Watch",code="CANCELLED"} 40.0' in registry.render())
    finally:
        server.stop(None)
        servers.stop()


def test_admission_bounds_per_peer_and_in_total_and_reserves_for_authenticated():
    admission = Admission(CallLimits(total=4, per_peer=3, open_total=2, open_per_peer=1))
    assert admission.enter("ipv4:10.0.0.1", True) is None
    assert "10.0.0.1 has 1" in admission.enter("ipv4:10.0.0.1", True)  # per peer
    assert admission.enter("ipv4:10.0.0.2", True) is None
    assert "runs 2 calls to open services" in admission.enter("ipv4:10.0.0.3", True)  # in total
    # The open calls took none of the authenticated calls' slots.
    for _ in range(3):
        assert admission.enter("ipv4:10.0.0.1", False) is None
    assert "10.0.0.1 has 3 calls" in admission.enter("ipv4:10.0.0.1", False)
    assert admission.enter("ipv4:10.0.0.2", False) is None
    assert "runs 4 calls" in admission.enter("ipv4:10.0.0.3", False)
    admission.leave("ipv4:10.0.0.1", True)
    assert admission.enter("ipv4:10.0.0.3", True) is None
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]" and peer_host("ipv4:1.2.3.4:80") == "ipv4:1.2.3.4"


def test_a_refused_or_failing_call_gives_its_slot_back():
    limits = CallLimits(total=1, per_peer=1, open_total=1, open_per_peer=1)
    interceptor = CallLimitsInterceptor(limits, ())
    callbacks: list = []
    context = SimpleNamespace(peer=lambda: "ipv4:10.0.0.9:1", add_callback=lambda f: callbacks.append(f) or True,
                              abort=lambda code, message: (_ for _ in ()).throw(RuntimeError(code, message)))

    def failing(request, context):
        raise ValueError("handler bug")

    handler = grpc.unary_unary_rpc_method_handler(failing)
    details = SimpleNamespace(method="/lanekv.v1.KVTransfer/Handshake", invocation_metadata=())
    wrapped = interceptor.intercept_service(lambda _: handler, details).unary_unary
    with pytest.raises(ValueError):
        wrapped(None, context)
    with pytest.raises(RuntimeError) as refused:  # the slot is held until the call ends
        wrapped(None, context)
    assert refused.value.args[0] == Code.RESOURCE_EXHAUSTED
    for callback in callbacks:
        callback()
    assert interceptor.admission.held() == {}
    with pytest.raises(ValueError):
        wrapped(None, context)  # admitted again
