"""The metrics agree on how a call ended, and /metrics speaks the daemon's TLS and token.

A client's deadline reaches the server as a cancellation a little before the
server's own copy of the deadline passes (the timeout is measured from when
each side saw the call), so calls that ran out of time were counted as
CANCELLED by the call counter and as ``deadline`` failures by the daemon (8
expiries: CANCELLED 6, DEADLINE_EXCEEDED 2, failures{cause="deadline"} 8).
Both now take the daemon's verdict, which uses one rule
(``runtime.status.left_code``). /metrics was plain HTTP without the
token even when every gRPC port required TLS and the token.
"""

from __future__ import annotations

import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.metrics import Registry, serve_metrics
from lanekv.runtime.security import SecurityConfig
from lanekv.runtime.status import DEADLINE_SLACK_S, Refusal, left_code, refusals

from tests.checkpoints import write_llama
from tests.daemons import start_pair, stop_pair
from tests.reliability.kv_cluster import wait_until
from tests.reliability.test_operations import GENERATE, LONG_NEW_TOKENS, LONG_PROMPT, Scrape
from tests.tls import make_certs

pytestmark = pytest.mark.timeout(120)
Code = grpc.StatusCode
EXPIRIES = 8
POOL_PAGES = 8 * 110  # every long generation fits at once


@pytest.fixture(scope="module")
def daemons(tmp_path_factory) -> Iterator[tuple[PrefillDaemon, DecodeDaemon]]:
    checkpoint = write_llama(tmp_path_factory.mktemp("agree-llama"))
    prefill, decode = start_pair(
        EngineConfig(str(checkpoint), cp_size=1, page_size=4, pages_per_lane=64, start_timeout_s=120),
        DaemonConfig(lease_s=600, metrics_port=0), pool_pages=POOL_PAGES, metrics_port=0,
    )
    yield prefill, decode
    stop_pair(prefill, decode)


def _long(endpoint: str, timeout: float, codes: list, cancel_after: int | None = None) -> None:
    request = lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=LONG_PROMPT),
                                         max_new_tokens=LONG_NEW_TOKENS)
    with grpc.insecure_channel(endpoint) as channel:
        call = lanekv_pb2_grpc.DecodeServiceStub(channel).Generate(request, timeout=timeout)
        try:
            for seen, _ in enumerate(call):
                if cancel_after is not None and seen >= cancel_after:
                    call.cancel()
        except grpc.RpcError as err:
            codes.append(err.code())
            return
    codes.append(Code.OK)


def _counts(decode: DecodeDaemon) -> tuple[float, float, float, float]:
    s = Scrape(decode.metrics_port)
    return (s("lanekv_requests_total", service=GENERATE, method="Generate", code="DEADLINE_EXCEEDED"),
            s("lanekv_requests_total", service=GENERATE, method="Generate", code="CANCELLED"),
            s("lanekv_failures_total", cause="deadline"), s("lanekv_failures_total", cause="cancelled"))


def test_deadline_expiries_and_cancellations_are_counted_alike(daemons):
    prefill, decode = daemons
    before = _counts(decode)
    codes: list = []
    # Deadlines that end the calls while they decode, 8 at once as in the report.
    threads = [threading.Thread(target=_long, args=(decode.endpoint, 0.6 + 0.05 * i, codes))
               for i in range(EXPIRIES)]
    threads.append(threading.Thread(target=_long, args=(decode.endpoint, 60, codes, 3)))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(code.name for code in codes) == ["CANCELLED"] + ["DEADLINE_EXCEEDED"] * EXPIRIES
    assert wait_until(lambda: decode.stats().active_requests == 0 and prefill.leases.held() == {})

    def deltas() -> tuple[float, ...]:
        return tuple(after - was for after, was in zip(_counts(decode), before))

    # calls DEADLINE_EXCEEDED, calls CANCELLED, failures deadline, failures cancelled
    assert wait_until(lambda: deltas() == (EXPIRIES, 1, EXPIRIES, 1)), deltas()


def _get(url: str, context: ssl.SSLContext | None = None, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, ""


def test_metrics_take_the_daemons_tls_and_token(tmp_path):
    certs = make_certs(tmp_path)
    registry = Registry()
    registry.counter("lanekv_probe_total", "a probe").inc()
    security = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca,
                              token="metrics-Token_01234567")
    endpoint = serve_metrics(registry, "127.0.0.1", 0, security)
    try:
        verified = ssl.create_default_context(cafile=certs.ca)
        url = f"https://127.0.0.1:{endpoint.port}/metrics"
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext gets no page
            _get(f"http://127.0.0.1:{endpoint.port}/metrics")
        assert _get(url, verified) == (401, "")
        assert _get(url, verified, token="wrong-token")[0] == 401
        status, body = _get(url, verified, token=security.token)
        assert status == 200 and "lanekv_probe_total 1.0" in body
    finally:
        endpoint.close()
    mutual = SecurityConfig(tls_cert=certs.server.cert, tls_key=certs.server.key, tls_ca=certs.ca,
                            require_client_cert=True)
    endpoint = serve_metrics(registry, "127.0.0.1", 0, mutual)
    try:
        url = f"https://127.0.0.1:{endpoint.port}/metrics"
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            _get(url, ssl.create_default_context(cafile=certs.ca))  # no client certificate
        with_cert = ssl.create_default_context(cafile=certs.ca)
        with_cert.load_cert_chain(certs.client.cert, certs.client.key)
        assert _get(url, with_cert)[0] == 200
    finally:
        endpoint.close()


class _Left:
    """A servicer context whose client has gone: gRPC sets no code, expiry or cancellation."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.status = None

    def code(self):
        return self.status

    def set_code(self, code) -> None:
        self.status = code

    def time_remaining(self):
        return self.remaining


@pytest.mark.parametrize(("remaining", "expected"), [
    (-0.2, Code.DEADLINE_EXCEEDED),  # the server's copy of the deadline has passed too
    (0.3, Code.DEADLINE_EXCEEDED),  # the client's clock ran out first: it started the call earlier
    (DEADLINE_SLACK_S + 0.5, Code.CANCELLED),  # the client left well before its deadline
    (None, Code.CANCELLED),  # no deadline at all
])
def test_a_left_call_is_judged_by_its_deadline(remaining, expected):
    assert left_code(_Left(remaining)) == expected


def test_the_first_verdict_on_a_call_is_kept():
    # Every count asks at its own moment; a call judged CANCELLED stays so when its
    # deadline passes a little later, and the other way round.
    left = _Left(DEADLINE_SLACK_S + 0.01)
    assert left_code(left) == Code.CANCELLED
    left.remaining = 0.0
    assert left_code(left) == Code.CANCELLED
    expired = _Left(0.0)
    assert left_code(expired) == Code.DEADLINE_EXCEEDED
    expired.remaining = 30.0
    assert left_code(expired) == Code.DEADLINE_EXCEEDED


class _Aborted(Exception):
    pass


class _Aborting(_Left):
    def abort(self, code, details):
        self.status = code
        raise _Aborted(details)


@pytest.mark.parametrize(("remaining", "expected"), [(0.2, Code.DEADLINE_EXCEEDED), (30.0, Code.CANCELLED)])
def test_a_handlers_cancelled_takes_the_deadline_verdict(remaining, expected):
    # The decode pipeline ends a call its client left with Refusal(CANCELLED); the call
    # ends with the same verdict the counters give it.
    context = _Aborting(remaining)
    with pytest.raises(_Aborted), refusals(context):
        raise Refusal(Code.CANCELLED, "the client went away")
    assert context.status == expected and left_code(context) == expected
    other = _Aborting(0.2)
    with pytest.raises(_Aborted), refusals(other):
        raise Refusal(Code.UNAVAILABLE, "stopping")
    assert other.status == Code.UNAVAILABLE
