"""lanekv.runtime.daemon: the skeleton both daemons stand on, against a real gRPC server on loopback."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import threading
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.runtime.daemon import DaemonServer, serve_until_signal
from lanekv.runtime.security import SecurityConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TIMEOUT_S = 10


def _status(endpoint: str, service: str = "") -> int:
    with grpc.insecure_channel(endpoint) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S).status


@pytest.mark.timeout(60)
def test_health_follows_start_not_serving_and_drain():
    node = DaemonServer(SecurityConfig(), "127.0.0.1", 0, 4, metrics_port=0)
    try:
        node.start(("lanekv.v1.Test",))
        assert node.endpoint == f"127.0.0.1:{node.port}" and node.port > 0
        assert _status(node.endpoint) == SERVING and _status(node.endpoint, "lanekv.v1.Test") == SERVING
        node.set_not_serving(("lanekv.v1.Test",))
        assert _status(node.endpoint) == NOT_SERVING and _status(node.endpoint, "lanekv.v1.Test") == NOT_SERVING
        # The interceptor counted those calls, and /metrics serves the registry.
        url = f"http://127.0.0.1:{node.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as reply:
            text = reply.read().decode()
        assert 'method="Check"' in text and 'code="OK"' in text
        assert node.drain(1.0).wait(5.0)
        with pytest.raises(grpc.RpcError):
            _status(node.endpoint)
    finally:
        node.close()
        node.close()  # a second close does nothing


def test_a_busy_port_fails_at_once_and_leaves_no_metrics_endpoint():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            DaemonServer(SecurityConfig(), "127.0.0.1", port, 4, metrics_port=None)


def test_describe_and_banner_name_the_protection_never_the_token():
    node = DaemonServer(SecurityConfig(token="s3cret-token"), "127.0.0.1", 0, 4, metrics_port=None)
    try:
        assert node.describe() == "plaintext + token"
        assert node.banner("lanekv x", "detail") == f"lanekv x serving on {node.endpoint} (detail)"
        assert "s3cret" not in node.describe() + node.banner("lanekv x", "detail")
    finally:
        node.close()


class _Stoppable:
    def __init__(self) -> None:
        self.endpoint = "127.0.0.1:1234"
        self.stopped_with: float | None = None
        self.failed: str | None = None
        self.frozen_while_serving = 0

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped_with = grace_s
        self.frozen_while_serving = gc.get_freeze_count()

    def failure(self) -> str | None:
        return self.failed


def _sigterm_once_handled(before) -> threading.Event:
    """SIGTERM to this process once a handler other than ``before`` is in (a signal sent
    earlier would end the test process), then 0.3 s more; setting the event sends nothing."""
    cancel = threading.Event()

    def send() -> None:
        while signal.getsignal(signal.SIGTERM) is before:
            if cancel.wait(0.01):
                return
        if not cancel.wait(0.3):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True, name="sigterm-sender").start()
    return cancel


@pytest.mark.timeout(30)
def test_serve_until_signal_writes_the_ready_file_and_stops_on_sigterm(tmp_path, capsys):
    daemon, ready = _Stoppable(), tmp_path / "ready"
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    sender = _sigterm_once_handled(saved[signal.SIGTERM])
    try:
        code = serve_until_signal(daemon, "the banner", str(ready), 2.5, logging.getLogger("test"), "draining")
    finally:
        sender.set()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code == 0 and daemon.stopped_with == 2.5
    # start-up's objects were frozen out of collection while it served, and thawed after
    assert daemon.frozen_while_serving > 1000 and gc.get_freeze_count() == 0
    assert ready.read_text() == daemon.endpoint
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary left
    assert "the banner" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_settle_runs_once_after_the_freeze_and_before_the_ready_file(tmp_path):
    daemon, ready = _Stoppable(), tmp_path / "ready"
    seen: list[tuple[int, bool]] = []

    def settle() -> None:
        seen.append((gc.get_freeze_count(), ready.exists()))
        os.kill(os.getpid(), signal.SIGTERM)  # the handlers are in: it drains at once

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = serve_until_signal(daemon, "the banner", str(ready), 2.5, logging.getLogger("test"), "draining",
                                  settle=settle)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code == 0 and len(seen) == 1
    frozen_count, ready_then = seen[0]
    assert frozen_count > 1000 and not ready_then
    assert ready.read_text() == daemon.endpoint


@pytest.mark.timeout(30)
def test_a_failing_settle_is_logged_and_the_daemon_serves_on(tmp_path, caplog):
    daemon, ready = _Stoppable(), tmp_path / "ready"

    def settle() -> None:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        raise RuntimeError("no free pages in lane 0")

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with caplog.at_level(logging.WARNING, logger="test"):
            code = serve_until_signal(daemon, "the banner", str(ready), 2.5, logging.getLogger("test"),
                                      "draining", settle=settle)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code == 0 and ready.read_text() == daemon.endpoint
    assert "settling after the freeze failed: no free pages in lane 0" in caplog.text


@pytest.mark.timeout(30)
def test_a_signal_while_start_up_is_frozen_still_drains(monkeypatch):
    """The handlers come before the freeze (a full collection of a big heap takes a
    while): a SIGTERM then still stops the daemon with its grace, never kills it."""
    import contextlib

    import lanekv.runtime.daemon

    daemon, seen = _Stoppable(), []

    @contextlib.contextmanager
    def freezing():
        seen.append(signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)
        yield 0

    monkeypatch.setattr(lanekv.runtime.daemon, "frozen", freezing)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, lambda *_: seen.append("killed"))  # what the old order would reach
    backstop = threading.Timer(3.0, setattr, (daemon, "failed", "the signal was lost"))
    try:
        backstop.start()
        code = serve_until_signal(daemon, "the banner", None, 2.5, logging.getLogger("test"), "draining")
    finally:
        backstop.cancel()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert "killed" not in seen and callable(seen[0])
    assert code == 0 and daemon.stopped_with == 2.5


@pytest.mark.timeout(30)
def test_serve_until_signal_exits_1_with_one_line_when_the_daemon_fails(tmp_path, capsys):
    daemon = _Stoppable()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    failing = threading.Timer(0.3, setattr, (daemon, "failed", "rank 1 (pid 7) exited\nwith code -9"))
    try:
        failing.start()
        code = serve_until_signal(daemon, "the banner", None, 5.0, logging.getLogger("test"), "draining",
                                  prog="lanekv prefill")
    finally:
        failing.cancel()
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert code == 1 and daemon.stopped_with == 1.0  # a short stop: the open calls were answered already
    assert capsys.readouterr().err.splitlines()[-1] == "lanekv prefill: rank 1 (pid 7) exited; with code -9; exiting"
