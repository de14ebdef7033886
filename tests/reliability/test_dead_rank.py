"""A prefill rank that dies is noticed at once, not by the next Prefill.

A prefill daemon whose rank had died said SERVING until a Prefill met the
dead rank, and orchestrators restart a daemon on its health probe. The
engine now watches its rank processes: within a second of a rank's death
health says NOT_SERVING, every Prefill in flight ends UNAVAILABLE naming the
rank with its pages back in the lanes, and ``lanekv prefill`` exits 1 with one
line naming the rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2 as pb
from lanekv.proto import lanekv_pb2_grpc

from tests.checkpoints import write_llama
from tests.reliability.kv_cluster import wait_until

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]
Code = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_llama(tmp_path_factory.mktemp("dead-rank-llama"))


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"exited {proc.returncode} before serving"
        time.sleep(0.1)
    return path.read_text().strip()


def test_a_killed_rank_turns_health_not_serving_at_once_and_the_command_exits_naming_it(checkpoint, tmp_path):
    ready, log = tmp_path / "ready", tmp_path / "stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lanekv.cli", "prefill", "--model", str(checkpoint), "--cp-size", "2",
             "--page-size", "4", "--pool-pages", "16", "--device", "cpu", "--ready-file", str(ready)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.DEVNULL, stderr=err)
    try:
        endpoint = _wait_for(ready, proc)
        pids = dict(re.findall(r"rank (\d) pid (\d+)", log.read_text()))
        rank1 = int(pids["1"])
        with grpc.insecure_channel(endpoint) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(watch).status == SERVING  # idle: no Prefill will meet the dead rank
            killed = time.monotonic()
            os.kill(rank1, signal.SIGKILL)
            status = next(watch).status
            noticed_s = time.monotonic() - killed
            assert status == NOT_SERVING
            assert noticed_s < 1.0, noticed_s
            watch.cancel()
        assert proc.wait(timeout=60) == 1
        exited_s = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = log.read_text()
    lines = [line for line in stderr.splitlines() if line.startswith("lanekv prefill:")]
    assert lines == [f"lanekv prefill: rank 1 (lanekv-cp-rank1, pid {rank1}) exited with code -9 (SIGKILL); exiting"], \
        stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    print(f"NOT_SERVING {noticed_s * 1e3:.0f} ms after the SIGKILL, exit 1 after {exited_s:.1f} s")


def test_a_prefill_in_flight_when_a_rank_dies_ends_unavailable_with_its_pages_freed(checkpoint):
    engine = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=16, start_timeout_s=120)
    daemon = PrefillDaemon(engine, DaemonConfig(lease_s=600))
    try:
        free = daemon.engine.allocator.free_counts()
        rank1 = daemon.engine.processes[1]
        outcome: dict = {}
        with grpc.insecure_channel(daemon.endpoint) as channel:
            stub = lanekv_pb2_grpc.PrefillServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            def prefill() -> None:
                request = pb.PrefillRequest(token_ids=pb.TokenIds(ids=list(range(3, 40))), request_id="in-flight")
                try:
                    stub.Prefill(request, timeout=60)
                    outcome["code"] = Code.OK
                except grpc.RpcError as err:
                    outcome["code"], outcome["details"] = err.code(), err.details()
                outcome["at"] = time.monotonic()

            os.kill(rank1.pid, signal.SIGSTOP)  # the batch cannot end before the rank dies
            caller = threading.Thread(target=prefill)
            caller.start()
            assert wait_until(lambda: daemon.engine.allocator.free_counts() != free)  # its pages are taken
            killed = time.monotonic()
            os.kill(rank1.pid, signal.SIGKILL)
            caller.join(30)
            assert outcome["code"] == Code.UNAVAILABLE, outcome
            assert "rank 1" in outcome["details"] and "SIGKILL" in outcome["details"], outcome
            assert outcome["at"] - killed < 1.0, outcome["at"] - killed
            print(f"UNAVAILABLE {(outcome['at'] - killed) * 1e3:.0f} ms after the SIGKILL")
            assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == NOT_SERVING
            assert daemon.engine.allocator.free_counts() == free and daemon.leases.held() == {}
            assert "rank 1" in (daemon.failure() or "")
            # Later calls are refused at once, naming the rank.
            with pytest.raises(grpc.RpcError) as later:
                stub.Prefill(pb.PrefillRequest(token_ids=pb.TokenIds(ids=[5, 6, 7])), timeout=10)
            assert later.value.code() == Code.UNAVAILABLE and "rank 1" in later.value.details()
    finally:
        daemon.stop(grace_s=1.0)
