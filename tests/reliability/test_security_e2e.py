"""TLS, mutual TLS and the shared token on every port of both daemons, end to end.

A prefill daemon (CP 2: its own port and one KVTransfer port per rank) and a
decode daemon, both serving TLS and requiring the token, in this process over
loopback. A generation through them works: the decode daemon reaches the
prefill daemon and fetches from both ranks over TLS with the token. Prefill,
FetchKV, Release and Generate without the token are UNAUTHENTICATED, a
plaintext client cannot connect at all, and health answers without a token.
A second prefill daemon requires client certificates (mutual TLS) on its port
and its rank's. ``lanekv handshake`` and ``lanekv generate`` take the flags.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.security import SecurityConfig, open_channel
from lanekv.transfer.grpcfetch.client import KVClient, RemoteError

from lanekv.cli import main as lanekv
from lanekv.client_commands import CommandError, fetch_contract
from tests.checkpoints import write_llama
from tests.daemons import running_pair
from tests.tls import CertSet, make_certs

pytestmark = pytest.mark.timeout(60)
Code = grpc.StatusCode
PAGE_SIZE = 4
TIMEOUT_S = 10.0
TOKEN = "e2e-Token_0123456789abcdef"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]  # 3 pages of 4: both ranks own some


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> CertSet:
    return make_certs(tmp_path_factory.mktemp("e2e-certs"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("security-llama"))


@pytest.fixture(scope="module")
def daemon_security(certs) -> SecurityConfig:
    """Both daemons serve with the server certificate; the decode daemon verifies prefill with the CA."""
    return SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca, token=TOKEN)


@pytest.fixture(scope="module")
def client(certs) -> SecurityConfig:
    return SecurityConfig(tls_ca=certs.ca, token=TOKEN)


@pytest.fixture(scope="module")
def daemons(checkpoint, daemon_security):
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=32, start_timeout_s=120)
    with running_pair(engine, DaemonConfig(lease_s=600, security=daemon_security),
                      pool_pages=64, security=daemon_security) as pair:
        yield pair


def _generate(endpoint: str, security: SecurityConfig, max_new_tokens: int = 4) -> tuple[grpc.Call, list]:
    request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT), max_new_tokens=max_new_tokens)
    with open_channel(endpoint, security) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=TIMEOUT_S)
        replies = list(call)
        return call, replies


def _refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args)
    return caught.value


def _prefill(endpoint: str, security: SecurityConfig) -> lanekv_pb2.PrefillReply:
    request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT))
    with open_channel(endpoint, security) as channel:
        return lanekv_pb2_grpc.PrefillServiceStub(channel).Prefill(request, timeout=TIMEOUT_S)


def _fetch(endpoint: str, security: SecurityConfig, fingerprint: str, request_id: str = "absent") -> RemoteError:
    with KVClient(security) as kv, pytest.raises(RemoteError) as caught:
        kv.fetch({0: endpoint}, request_id, fingerprint, lambda header, payload: None, timeout=TIMEOUT_S)
    return caught.value


def test_a_generation_runs_over_tls_with_the_token(daemons, client):
    _, decode = daemons
    call, replies = _generate(decode.endpoint, client, max_new_tokens=4)
    tokens = [t for reply in replies for t in reply.token_ids]
    assert len(tokens) == 4 and replies[-1].finished
    # The decode daemon fetched the KV from the ranks, each behind TLS and the token.
    stats = dict(call.trailing_metadata())
    assert int(stats["lanekv-transfer-bytes"]) > 0


def test_calls_without_the_token_are_unauthenticated(daemons, certs, client):
    prefill, decode = daemons
    no_token = SecurityConfig(tls_ca=certs.ca)
    wrong_token = SecurityConfig(tls_ca=certs.ca, token=TOKEN + "x")
    fingerprint = prefill.contract.fingerprint
    for security in (no_token, wrong_token):
        assert _refused(_prefill, prefill.endpoint, security).code() == Code.UNAUTHENTICATED
        assert _refused(_generate, decode.endpoint, security).code() == Code.UNAUTHENTICATED
        for endpoint in prefill.topology.endpoints:
            assert _fetch(endpoint, security, fingerprint).code == Code.UNAUTHENTICATED
            with KVClient(security) as kv, pytest.raises(RemoteError) as caught:
                kv.release({0: endpoint}, "absent", fingerprint)
            assert caught.value.code == Code.UNAUTHENTICATED
    # With the token, the same fetch reaches the service (which knows no such request).
    assert _fetch(prefill.topology.endpoints[0], client, fingerprint).code == Code.NOT_FOUND
    assert _prefill(prefill.endpoint, client).first_token >= 0


def test_a_plaintext_client_cannot_connect(daemons):
    prefill, decode = daemons
    plaintext = SecurityConfig(token=TOKEN)
    assert _refused(_prefill, prefill.endpoint, plaintext).code() == Code.UNAVAILABLE
    assert _refused(_generate, decode.endpoint, plaintext).code() == Code.UNAVAILABLE
    for endpoint in prefill.topology.endpoints:
        assert _fetch(endpoint, plaintext, prefill.contract.fingerprint).code == Code.UNAVAILABLE


def test_health_answers_without_a_token(daemons, certs):
    prefill, decode = daemons
    tls_only = SecurityConfig(tls_ca=certs.ca)
    for endpoint in (prefill.endpoint, decode.endpoint, *prefill.topology.endpoints):
        with open_channel(endpoint, tls_only) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, endpoint


def test_lanekv_commands_take_the_security_flags(daemons, certs, tmp_path, capsys):
    prefill, decode = daemons
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    where = ["--prefill", prefill.endpoint, "--decode", decode.endpoint]
    flags = ["--tls-ca", certs.ca, "--auth-token-file", str(token_file)]
    assert lanekv(["handshake", *where, *flags]) == 0
    assert capsys.readouterr().out.strip().endswith("compatible")
    assert lanekv(["handshake", *where, "--tls-ca", certs.ca]) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    ids = ",".join(map(str, PROMPT))
    assert lanekv(["generate", "--decode", decode.endpoint, "--ids", ids, "--max-new-tokens", "3", "--print-ids",
                   *flags]) == 0
    assert len(capsys.readouterr().out.split()) == 3
    assert lanekv(["generate", "--decode", decode.endpoint, "--ids", ids, "--auth-token-file",
                   str(tmp_path / "absent")]) == 2
    assert "auth_token_file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mutual(checkpoint, certs):
    """A CP-1 prefill daemon that refuses clients without a certificate from the CA."""
    security = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca,
                              require_client_cert=True, token=TOKEN)
    daemon = PrefillDaemon(
        EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=16, start_timeout_s=120),
        DaemonConfig(security=security),
    )
    yield daemon
    daemon.stop()


def test_mutual_tls_refuses_a_client_without_a_certificate(mutual, certs):
    with_cert = SecurityConfig(tls_ca=certs.ca, tls_cert=certs.client.cert, tls_key=certs.client.key, token=TOKEN)
    without = SecurityConfig(tls_ca=certs.ca, token=TOKEN)
    stranger = SecurityConfig(tls_ca=certs.ca, tls_cert=certs.other_client.cert, tls_key=certs.other_client.key,
                              token=TOKEN)
    for endpoint in (mutual.endpoint, *mutual.topology.endpoints):
        assert fetch_contract(endpoint, TIMEOUT_S, with_cert).fingerprint == mutual.contract.fingerprint
        for refused in (without, stranger):
            with pytest.raises(CommandError, match="UNAVAILABLE"):
                fetch_contract(endpoint, TIMEOUT_S, refused)
    assert _prefill(mutual.endpoint, with_cert).first_token >= 0
    assert _refused(_prefill, mutual.endpoint, without).code() == Code.UNAVAILABLE


def test_open_watches_do_not_starve_the_daemons(daemons, certs, client):
    # The numbers: 20 Watches on a rank port, 40 on the prefill port and
    # 70 on the decode port made authenticated Generate and Check calls time out.
    prefill, decode = daemons
    tls_only = SecurityConfig(tls_ca=certs.ca)
    counts = {decode.endpoint: 70, prefill.endpoint: 40, **dict.fromkeys(prefill.topology.endpoints, 20)}
    channels, calls, refused = [], [], 0
    try:
        for endpoint, count in counts.items():
            channels.append(open_channel(endpoint, tls_only))
            health = health_pb2_grpc.HealthStub(channels[-1])
            for _ in range(count):
                calls.append(health.Watch(health_pb2.HealthCheckRequest(), timeout=30))
                try:
                    next(calls[-1])
                except grpc.RpcError as err:
                    assert err.code() == Code.RESOURCE_EXHAUSTED, (err.code(), err.details())
                    refused += 1
        assert refused == sum(counts.values()) - 4 * len(counts)  # 4 open calls per host and port
        _, replies = _generate(decode.endpoint, client)
        assert sum(len(reply.token_ids) for reply in replies) == 4
        for endpoint in counts:
            with open_channel(endpoint, client) as channel:
                check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == health_pb2.HealthCheckResponse.SERVING, endpoint
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            channel.close()
