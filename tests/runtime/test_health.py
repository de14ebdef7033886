"""``runtime.status.HealthServicer``: the end of a health Watch never waits on the
lock under which another Watch is being answered (gRPC runs that callback on its
polling thread, which the answer's send is waiting for: the server would stop).
grpc_health's own servicer blocks there, which shows the test can fail. Then the
servicer over a real server: Watches opened and cancelled in a loop while the status
changes, and the server still answers and stops.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from lanekv.runtime.status import HealthServicer

from tests.reliability.kv_cluster import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _watch(servicer, sent: list, block: threading.Event | None = None) -> list:
    """Open a Watch through the non-blocking interface gRPC uses; its end callbacks.
    ``block``: its sends wait for that event, as a send waits for gRPC's polling thread."""
    callbacks: list = []
    context = SimpleNamespace(add_callback=lambda f: callbacks.append(f) or True)

    def send(response):
        if block is not None:
            block.wait()
        sent.append(None if response is None else response.status)

    servicer.Watch(health_pb2.HealthCheckRequest(service=""), context, send_response_callback=send)
    return callbacks


def _end_returns_while_another_watch_is_answered(servicer) -> bool:
    sent_a: list = []
    ended_a = _watch(servicer, sent_a)
    assert sent_a == [SERVING]
    release = threading.Event()
    opening = threading.Thread(target=_watch, args=(servicer, [], release))
    opening.start()  # holds the servicer's lock while its first send waits
    try:
        ender = threading.Thread(target=ended_a[0])  # as gRPC's polling thread runs it
        ender.start()
        ender.join(1.0)
        returned = not ender.is_alive()
    finally:
        release.set()
        opening.join(5)
        ender.join(5)
    return returned


@pytest.mark.timeout(30)
def test_the_end_of_a_watch_does_not_wait_for_a_watch_being_answered():
    servicer = HealthServicer()
    assert _end_returns_while_another_watch_is_answered(servicer)
    # The ended Watch is forgotten once the other is answered: a change reaches the open one only.
    sent_a: list = []
    ended = _watch(servicer, sent_a)
    sent_b: list = []
    _watch(servicer, sent_b)
    ended[0]()
    assert wait_until(lambda: sent_a == [SERVING, None])
    servicer.set("", NOT_SERVING)
    assert sent_a == [SERVING, None] and sent_b == [SERVING, NOT_SERVING]


@pytest.mark.timeout(30)
def test_grpc_healths_own_servicer_waits_there():
    assert not _end_returns_while_another_watch_is_answered(health.HealthServicer())


@pytest.mark.timeout(60)
def test_watches_opened_and_cancelled_in_a_loop_leave_a_server_that_answers_and_stops():
    servicer = HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    errors: list = []
    watches = [0]

    def churn() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
                try:
                    next(call)
                except grpc.RpcError as err:  # a stalled server: DEADLINE_EXCEEDED
                    errors.append(err.code())
                    return
                call.cancel()
                watches[0] += 1

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for thread in threads:
        thread.start()
    try:
        for i in range(200):
            servicer.set("", SERVING if i % 2 else NOT_SERVING)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert reply.status in (SERVING, NOT_SERVING)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    done = server.stop(None)
    assert done.wait(10), "the server did not stop"
    assert errors == [] and watches[0] > 0, (errors, watches)


@pytest.mark.timeout(60)
def test_open_watches_cannot_starve_health_checks_and_time_out():
    """Unauthenticated Watches that fill every Watch slot (from one host and in total) leave
    unary Checks answered, and each Watch ends after ``watch_timeout_s``, freeing its slot."""
    from lanekv.runtime.limits import CallLimits
    from lanekv.runtime.security import SecurityConfig, bind, make_server

    limits = CallLimits(total=4, per_peer=4, open_total=2, open_per_peer=2, watch_total=3, watch_per_peer=3,
                        watch_timeout_s=1.5)
    security = SecurityConfig(token="health-Token_0123456789")  # health stays open without it
    server = make_server(security, max_workers=1, limits=limits)
    servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = bind(server, "127.0.0.1", 0, security)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(3)]
            assert [next(w).status for w in watches] == [SERVING] * 3
            with pytest.raises(grpc.RpcError) as err:
                next(stub.Watch(health_pb2.HealthCheckRequest(), timeout=30))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Watches" in err.value.details()
            for _ in range(10):  # every Watch slot taken; probes' Checks answered all the same
                assert stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
            started = time.monotonic()
            for watch in watches:  # each ends at its lifetime, not the client's 30 s deadline
                with pytest.raises(grpc.RpcError) as err:
                    next(watch)
                assert err.value.code() == grpc.StatusCode.CANCELLED
            assert time.monotonic() - started < 5.0
            assert wait_until(lambda: _watch_answers(stub), 5.0)  # the slots came back
    finally:
        server.stop(None)


def _watch_answers(stub) -> bool:
    watch = stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)
    try:
        return next(watch).status == SERVING
    except grpc.RpcError:
        return False
    finally:
        watch.cancel()
