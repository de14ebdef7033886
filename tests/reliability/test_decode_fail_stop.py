"""A decode daemon whose step fails stops serving instead of failing every request while
it says SERVING.

A failed step used to end the open streams INTERNAL while the loop carried on and
health stayed SERVING; after a persistent device error (a poisoned CUDA context)
every request failed and fronts kept routing to it. Now: health NOT_SERVING for good,
the open streams and new calls end UNAVAILABLE (a front drops the daemon and retries
elsewhere), ``failure()`` says why, and ``lanekv decode``'s serve loop exits 1 with one
line.
"""

from __future__ import annotations

import http.client
import json
import logging
from contextlib import ExitStack
from urllib.parse import urlsplit

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.daemon import serve_until_signal

from tests.checkpoints import write_llama
from tests.lanekv.http.front import running_front
from tests.reliability.kv_cluster import wait_until

pytestmark = pytest.mark.timeout(180)
Code = grpc.StatusCode
PAGE_SIZE = 4
INJECTED = "injected: an illegal memory access was encountered"


def test_a_failed_step_turns_the_daemon_not_serving_and_the_command_exits_1(tmp_path, capsys):
    checkpoint = write_llama(tmp_path / "llama")
    prefill = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=64,
                                         start_timeout_s=120), DaemonConfig(lease_s=60))
    decode, fronts = None, ExitStack()
    try:
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE,
                                           pool_pages=64, device="cpu", prefill_health_interval_s=0.2))
        url = fronts.enter_context(running_front(checkpoint, [decode.endpoint], tmp_path))
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            def status() -> int:
                return health.Check(health_pb2.HealthCheckRequest(service="lanekv.v1.DecodeService"),
                                    timeout=5).status

            def request(n: int) -> lanekv_pb2.GenerateRequest:
                return lanekv_pb2.GenerateRequest(token_ids=lanekv_pb2.TokenIds(ids=[11, 12, 13, 14, 15]),
                                                  max_new_tokens=n)

            assert status() == health_pb2.HealthCheckResponse.SERVING
            assert decode.failure() is None
            assert wait_until(lambda: _get(url, "/health")[0] == 200, 10.0)  # in the front's rotation
            stream = stub.Generate(request(200), timeout=60)
            assert next(stream).token_ids  # the request is in the engine

            def failing_step():
                raise RuntimeError(INJECTED)

            decode.engine.step = failing_step
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            assert err.value.code() == Code.UNAVAILABLE and INJECTED in err.value.details()
            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
            assert "decode step failed: RuntimeError: " + INJECTED == decode.failure()
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request(2), timeout=20))
            assert err.value.code() == Code.UNAVAILABLE
            # A prefill daemon coming back does not make it SERVING again.
            decode._prefill_available(True)
            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
        # The HTTP front took it out of rotation: 503, naming it.
        assert wait_until(lambda: _get(url, "/health")[0] == 503, 10.0)
        assert _get(url, "/health")[1]["decode"][decode.endpoint]["healthy"] is False
        status_code, body = _post(url, "/v1/completions", {"model": "llama", "prompt": [11, 12], "max_tokens": 2})
        assert status_code == 503 and decode.endpoint in body["error"]["message"], body
        fronts.close()
        # ``lanekv decode`` serves through serve_until_signal: it sees the failure and exits 1.
        capsys.readouterr()
        code = serve_until_signal(decode, "banner", None, 1.0, logging.getLogger("test"), "draining",
                                  prog="lanekv decode")
        assert code == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines == [f"lanekv decode: decode step failed: RuntimeError: {INJECTED}; exiting"]
        assert wait_until(lambda: decode.stopping, 5.0)
    finally:
        fronts.close()
        if decode is not None:
            decode.stop(grace_s=0.5)
        prefill.stop()


def _get(url: str, path: str) -> tuple[int, dict]:
    return _call(url, "GET", path, None)


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return _call(url, "POST", path, json.dumps(body))


def _call(url: str, method: str, path: str, body: str | None) -> tuple[int, dict]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()
