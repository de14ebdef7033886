"""Messages and exits a user sees: ``lanekv generate`` pointed at the wrong kind of port,
a decode daemon waiting for its prefill daemon, the front naming the root cause when a
decode daemon's prefill daemons are down, ``lanekv serve`` and a CP prefill daemon
stopped by SIGTERM (exit 0, no ERROR). Processes on free ports, each with a timeout."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from lanekv.decode import daemon as decode_daemon_module
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.errors import TransferError

from lanekv.cli import main as lanekv
from lanekv.http.backends import Backends, NoBackend
from lanekv.http.config import FrontConfig
from tests.checkpoints import write_llama
from tests.daemons import LONG_LEASE, running_pair

REPO = Path(__file__).resolve().parents[2]
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("exits-llama"), tokenizer=True)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_file(path: Path, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if process.poll() is not None:
            raise RuntimeError(f"exited {process.returncode} before ready: {process.stdout.read()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not ready in {timeout_s}s")
        time.sleep(0.1)
    return path.read_text()


def _stop(process: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, str]:
    try:
        out, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate(timeout=10)
        raise
    return process.returncode, out


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.mark.timeout(180)
def test_generate_says_what_a_wrong_port_is(checkpoint, capsys):
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=16, start_timeout_s=120)
    prefill = PrefillDaemon(engine, LONG_LEASE)
    try:
        assert lanekv(["generate", "--decode", prefill.endpoint, "--ids", "5,6", "--timeout", "10"]) == 1
        err = capsys.readouterr().err
        assert "UNIMPLEMENTED" in err and f"{prefill.endpoint} is a prefill daemon" in err, err
        rank = prefill.topology.endpoints[0]
        assert lanekv(["generate", "--decode", rank, "--ids", "5,6", "--timeout", "10"]) == 1
        assert f"{rank} is a prefill rank's KVTransfer port" in capsys.readouterr().err
    finally:
        prefill.stop()
    http = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        endpoint = f"127.0.0.1:{http.server_address[1]}"
        assert lanekv(["generate", "--decode", endpoint, "--ids", "5,6", "--timeout", "10"]) == 1
        assert f"{endpoint} is an HTTP server" in capsys.readouterr().err
    finally:
        http.shutdown()
        http.server_close()
    assert lanekv(["generate", "--decode", f"127.0.0.1:{_closed_port()}", "--ids", "5", "--timeout", "2"]) == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "HTTP server" not in err and "prefill" not in err


@pytest.mark.timeout(120)
def test_a_decode_daemon_waiting_for_its_prefill_daemon_says_so(checkpoint, caplog, monkeypatch):
    monkeypatch.setattr(decode_daemon_module, "WAIT_LOG_S", 0.5)
    endpoint = f"127.0.0.1:{_closed_port()}"
    config = DecodeConfig(str(checkpoint), endpoint, page_size=PAGE_SIZE, device="cpu", pool_pages=16,
                          connect_timeout_s=2.5)
    with caplog.at_level(logging.INFO, logger="lanekv.decode"), pytest.raises(TransferError):
        DecodeDaemon(config)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for prefill daemon")]
    assert len(waits) >= 2, caplog.text
    assert endpoint in waits[0] and "left of connect_timeout_s" in waits[0]


@pytest.mark.timeout(180)
def test_the_front_names_the_prefill_daemon_behind_a_decode_daemon(checkpoint):
    engine = EngineConfig(str(checkpoint), cp_size=1, page_size=PAGE_SIZE, pages_per_lane=16, start_timeout_s=120)
    with running_pair(engine, pool_pages=16, prefill_health_interval_s=0.2) as (prefill, decode):
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            reply = stub.Status(lanekv_pb2.DecodeStatusRequest(), timeout=5)
            assert reply.serving and not reply.problem and reply.prefills[0].healthy
            prefill.stop()
            deadline = time.monotonic() + 20
            while reply.serving and time.monotonic() < deadline:
                time.sleep(0.1)
                reply = stub.Status(lanekv_pb2.DecodeStatusRequest(), timeout=5)
        assert not reply.serving and prefill.endpoint in reply.problem, reply
        assert not reply.prefills[0].healthy and reply.prefills[0].problem

        async def front_view() -> tuple[str, str]:
            backends = Backends.of(FrontConfig(str(checkpoint), (decode.endpoint,)))
            await backends.start()
            try:
                with pytest.raises(NoBackend) as refused:
                    backends.pick()
                return backends.members[0].problem, refused.value.message
            finally:
                await backends.close()

        problem, message = asyncio.run(front_view())
        assert problem.startswith("NOT_SERVING: no prefill daemon can take a prompt"), problem
        assert f"prefill {prefill.endpoint}" in problem
        assert f"prefill {prefill.endpoint}" in message and "no healthy decode daemon" in message


@pytest.mark.timeout(240)
def test_serve_exits_0_after_a_clean_drain_on_sigterm(checkpoint, tmp_path):
    ready = tmp_path / "serve.ready"
    process = subprocess.Popen(
        [sys.executable, "-m", "lanekv.cli", "serve", "--model", str(checkpoint), "--port", "0",
         "--decode", f"127.0.0.1:{_closed_port()}", "--ready-file", str(ready)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_file(ready, process, 180)
        process.send_signal(signal.SIGTERM)
        code, out = _stop(process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 0, out
    assert "SIGTERM received, draining" in out and "stopped on SIGTERM after draining; exit 0" in out, out


@pytest.mark.timeout(300)
def test_cp_ranks_stopped_by_a_group_sigterm_log_no_error(checkpoint, tmp_path):
    ready = tmp_path / "prefill.ready"
    process = subprocess.Popen(
        [sys.executable, "-m", "lanekv.cli", "prefill", "--model", str(checkpoint), "--cp-size", "2",
         "--device", "cpu", "--page-size", str(PAGE_SIZE), "--pool-pages", "16", "--port", "0",
         "--ready-file", str(ready)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_file(ready, process, 240)
        os.killpg(process.pid, signal.SIGTERM)  # the whole group, as a terminal's Ctrl-C or an orchestrator
        code, out = _stop(process)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert code == 0, out
    assert " ERROR " not in out and "Traceback" not in out, out
    # The ranks ended on the parent's Shutdown, not on the group's signal
    assert "CP ranks stopped: rank 0 (lanekv-cp-rank0" in out and "rank 1 (lanekv-cp-rank1" in out, out
    assert out.count("exited with code 0") == 2 and "SIGTERM)" not in out, out
    assert "prefill KV pool: 16 pages x 4 tokens = 64 tokens" in out, out
