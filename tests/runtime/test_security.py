"""lanekv.runtime.security against real gRPC servers on loopback: TLS, mutual TLS, the token, binding."""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.runtime.security import (
    SecurityConfig,
    add_security_args,
    bind,
    make_server,
    open_channel,
)
from lanekv.runtime.status import HealthServicer
from lanekv.transfer.grpcfetch.client import KVClient

from tests.tls import CertSet, make_certs

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode
TIMEOUT_S = 5.0
TOKEN = "s3cret-Token_0123456789"
ECHO = "/lanekv.test.Echo/Echo"
REPEAT = "/lanekv.test.Echo/Repeat"


def _echo_handler() -> grpc.GenericRpcHandler:
    # No (de)serializers: requests and replies are raw bytes.
    return grpc.method_handlers_generic_handler("lanekv.test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Repeat": grpc.unary_stream_rpc_method_handler(lambda request, context: iter([request] * 3)),
    })


@contextmanager
def serving(config: SecurityConfig) -> Iterator[int]:
    """A server with the echo service and the health service; yields its port."""
    server = make_server(config, max_workers=4)
    server.add_generic_rpc_handlers((_echo_handler(),))
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = bind(server, "127.0.0.1", 0, config)
    server.start()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        yield port
    finally:
        server.stop(None)


def echo(port: int, config: SecurityConfig, payload: bytes = b"ping") -> bytes:
    with open_channel(f"127.0.0.1:{port}", config) as channel:
        return channel.unary_unary(ECHO)(payload, timeout=TIMEOUT_S)


def refused(port: int, config: SecurityConfig, method: str = ECHO) -> grpc.RpcError:
    with open_channel(f"127.0.0.1:{port}", config) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            if method == REPEAT:
                list(channel.unary_stream(REPEAT)(b"x", timeout=TIMEOUT_S))
            else:
                channel.unary_unary(method)(b"x", timeout=TIMEOUT_S)
    return caught.value


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_certs(tmp_path_factory.mktemp("certs"))


def test_plaintext_round_trip() -> None:
    with serving(SecurityConfig()) as port:
        assert echo(port, SecurityConfig(), b"hello") == b"hello"


def test_tls_client_with_the_ca_talks_others_fail(certs: CertSet) -> None:
    server = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key)
    with serving(server) as port:
        assert echo(port, SecurityConfig(tls_ca=certs.ca), b"over tls") == b"over tls"
        assert refused(port, SecurityConfig()).code() == Code.UNAVAILABLE  # plaintext to a TLS port
        assert refused(port, SecurityConfig(tls_ca=certs.other_ca)).code() == Code.UNAVAILABLE
        # A certificate names 127.0.0.1 and localhost only.
        assert refused(port, SecurityConfig(tls_ca=certs.ca, tls_server_name="elsewhere")).code() == Code.UNAVAILABLE
        assert echo(port, SecurityConfig(tls_ca=certs.ca, tls_server_name="localhost")) == b"ping"


def test_mutual_tls_needs_a_client_certificate_from_the_ca(certs: CertSet) -> None:
    server = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca,
                            require_client_cert=True)
    with serving(server) as port:
        assert refused(port, SecurityConfig(tls_ca=certs.ca)).code() == Code.UNAVAILABLE
        stranger = SecurityConfig(tls_ca=certs.ca, tls_cert=certs.other_client.cert, tls_key=certs.other_client.key)
        assert refused(port, stranger).code() == Code.UNAVAILABLE
        client = SecurityConfig(tls_ca=certs.ca, tls_cert=certs.client.cert, tls_key=certs.client.key)
        assert echo(port, client, b"mutual") == b"mutual"


def test_token_refusals_name_the_problem_and_the_server_keeps_serving() -> None:
    with serving(SecurityConfig(token=TOKEN)) as port:
        missing = refused(port, SecurityConfig())
        assert missing.code() == Code.UNAUTHENTICATED and "missing" in missing.details()
        wrong = refused(port, SecurityConfig(token=TOKEN + "x"))
        assert wrong.code() == Code.UNAUTHENTICATED and "wrong token" in wrong.details()
        assert TOKEN not in wrong.details()
        stream = refused(port, SecurityConfig(), REPEAT)
        assert stream.code() == Code.UNAUTHENTICATED and REPEAT in stream.details()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(ECHO)(b"x", timeout=TIMEOUT_S, metadata=[("authorization", TOKEN)])
            assert "not a 'Bearer <token>'" in caught.value.details()
            # Liveness probes carry no token.
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert refused(port, SecurityConfig(token=TOKEN), "/lanekv.test.Echo/Nope").code() == Code.UNIMPLEMENTED
        assert echo(port, SecurityConfig(token=TOKEN), b"after refusals") == b"after refusals"
        with open_channel(f"127.0.0.1:{port}", SecurityConfig(token=TOKEN)) as channel:
            assert list(channel.unary_stream(REPEAT)(b"r", timeout=TIMEOUT_S)) == [b"r"] * 3


def test_token_over_tls_rides_in_call_credentials(certs: CertSet) -> None:
    server = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, token=TOKEN)
    with serving(server) as port:
        assert echo(port, SecurityConfig(tls_ca=certs.ca, token=TOKEN)) == b"ping"
        assert refused(port, SecurityConfig(tls_ca=certs.ca)).code() == Code.UNAUTHENTICATED


def test_health_is_answered_while_streams_hold_every_worker() -> None:
    # A prefill daemon's PrefillStream calls wait for their batch on a thread
    # each; when they outnumbered the pool's threads, a health check queued
    # behind them, timed out, and its caller took the daemon for dead. Every
    # call the limits admit has a thread: 12 held streams on a 2-worker server
    # (13 calls admitted) leave health, and a 13th call, answered at once.
    import threading

    from lanekv.runtime.limits import CallLimits

    release, running = threading.Event(), threading.Semaphore(0)

    def hold(request, context):
        running.release()
        release.wait(30)
        yield request

    held, limits = 12, CallLimits(total=13, per_peer=13, open_total=2, open_per_peer=2)
    server = make_server(SecurityConfig(), max_workers=2, limits=limits)  # 4 threads before
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("lanekv.test.Hold", {
        "Hold": grpc.unary_stream_rpc_method_handler(hold)}), _echo_handler()))
    checker = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    port = bind(server, "127.0.0.1", 0, SecurityConfig())
    server.start()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            streams = [channel.unary_stream("/lanekv.test.Hold/Hold")(b"x", timeout=30) for _ in range(held)]
            try:
                assert all(running.acquire(timeout=10) for _ in range(held))  # each on a thread
                stub = health_pb2_grpc.HealthStub(channel)
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                assert status == health_pb2.HealthCheckResponse.SERVING
                assert channel.unary_unary(ECHO)(b"ping", timeout=2) == b"ping"
            finally:
                release.set()
            assert all(list(stream) == [b"x"] for stream in streams)
    finally:
        release.set()
        server.stop(None)


def test_bind_names_a_busy_port() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        server = make_server(SecurityConfig(), max_workers=1)
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            bind(server, "127.0.0.1", port, SecurityConfig())


def test_make_server_does_not_share_a_port_with_another_server() -> None:
    with serving(SecurityConfig()) as port:
        second = make_server(SecurityConfig(), max_workers=1)
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            bind(second, "127.0.0.1", port, SecurityConfig())


def test_bind_warns_about_plaintext_off_loopback(caplog: pytest.LogCaptureFixture, certs: CertSet) -> None:
    caplog.set_level(logging.WARNING, logger="lanekv.runtime.security")
    server = make_server(SecurityConfig(), max_workers=1)
    bind(server, "127.0.0.1", 0, SecurityConfig())
    assert not caplog.records
    bind(server, "0.0.0.0", 0, SecurityConfig(token=TOKEN))
    assert "without TLS" in caplog.text and "auth token" in caplog.text
    server.stop(None)
    with pytest.raises(ValueError, match="tls_cert"):
        bind(make_server(SecurityConfig(), max_workers=1), "127.0.0.1", 0, SecurityConfig(tls_ca=certs.ca))


@pytest.mark.parametrize("fields, field", [
    (dict(tls_cert="CERT"), "tls_key"),
    (dict(tls_key="KEY"), "tls_cert"),
    (dict(tls_cert="CERT", tls_key="KEY", require_client_cert=True), "require_client_cert"),
    (dict(tls_cert="/nonexistent/server.pem", tls_key="KEY"), "tls_cert"),
    (dict(tls_ca="CERT", tls_cert="KEY", tls_key="KEY"), "tls_cert"),  # a key is not a certificate
    (dict(tls_ca="DIR"), "tls_ca"),
    (dict(tls_cert=""), "tls_cert"),
    (dict(require_client_cert="yes"), "require_client_cert"),
    (dict(tls_server_name="localhost"), "tls_server_name"),
    (dict(token=""), "token"),
    (dict(token="two words"), "token"),
    (dict(token="caf\u00e9"), "token"),
    (dict(token="x" * 5000), "token"),
])
def test_config_errors_name_the_field(certs: CertSet, tmp_path, fields: dict, field: str) -> None:
    paths = {"CERT": certs.server.cert, "KEY": certs.server.key, "DIR": str(tmp_path)}
    fields = {k: paths.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises((ValueError, TypeError), match=field):
        SecurityConfig(**fields)


def test_config_repr_hides_the_token(certs: CertSet) -> None:
    config = SecurityConfig(tls_ca=certs.ca, token=TOKEN)
    assert TOKEN not in repr(config) and TOKEN not in repr(replace(config, tls_server_name="localhost"))
    assert config.tls and not SecurityConfig(token=TOKEN).tls


def test_from_args_reads_the_token_from_a_file_or_the_environment(certs: CertSet, tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_security_args(parser)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    args = parser.parse_args(["--tls-cert", certs.server.cert, "--tls-key", certs.server.key,
                              "--tls-ca", certs.ca, "--tls-require-client-cert",
                              "--auth-token-file", str(token_file)])
    config = SecurityConfig.from_args(args)
    assert config.token == TOKEN and config.require_client_cert and config.tls_ca == certs.ca
    from_env = SecurityConfig.from_args(parser.parse_args(["--auth-token-env", "LANEKV_T"]), {"LANEKV_T": TOKEN})
    assert from_env.token == TOKEN and not from_env.tls
    assert SecurityConfig.from_args(argparse.Namespace()) == SecurityConfig()
    with pytest.raises(ValueError, match="auth_token_env"):
        SecurityConfig.from_args(parser.parse_args(["--auth-token-env", "LANEKV_T"]), {})
    with pytest.raises(ValueError, match="auth_token_file"):
        SecurityConfig.from_args(parser.parse_args(["--auth-token-file", str(tmp_path / "absent")]))
    token_file.write_text("\n")
    with pytest.raises(ValueError, match="auth_token_file"):
        SecurityConfig.from_args(parser.parse_args(["--auth-token-file", str(token_file)]))
    with pytest.raises(ValueError, match="auth_token_file"):
        SecurityConfig.from_args(parser.parse_args(["--auth-token-file", "f", "--auth-token-env", "E"]))


@pytest.mark.parametrize("tls", [False, True])
def test_direct_channels_carry_the_token(certs: CertSet, tls: bool) -> None:
    # The fast path's descriptor streams run on KVClient.channel(direct=True)
    # (gRPC's single-threaded unary-stream mode): the token rides there too.
    server = SecurityConfig(token=TOKEN, **(dict(tls_cert=certs.server.cert, tls_key=certs.server.key) if tls else {}))
    with serving(server) as port:
        for token, works in ((TOKEN, True), (None, False)):
            client = SecurityConfig(token=token, **(dict(tls_ca=certs.ca) if tls else {}))
            with KVClient(client) as kv:
                call = kv.channel(f"127.0.0.1:{port}", direct=True).unary_stream(REPEAT)(b"d", timeout=TIMEOUT_S)
                if works:
                    assert list(call) == [b"d"] * 3
                else:
                    with pytest.raises(grpc.RpcError) as caught:
                        list(call)
                    assert caught.value.code() == Code.UNAUTHENTICATED
