"""Both prefix caches stay consistent through a cancelled request and a killed prefill
daemon (a failed fetch: ``test_prefix_admission``), and nothing leaks: after idle the
free pages are the capacity minus what the caches keep, and emptying the caches gives
the whole pool back (``tests.prefix_checks.settled``). ``cached_tokens`` equals the
prompt tokens whose compute was skipped in each case; a request that ends early
admits none of its generated pages, one whose fetch never finished none of its own.

The prefill daemons here sleep once layer 0 of every prefill is written
(``LANEKV_SLOW_LAYER``), so a test can cancel or kill in the middle of one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.cp.rank_worker import SLOW_LAYER_ENV
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2_grpc

from tests.checkpoints import write_llama
from tests.prefix_checks import generate, load_hf, page_bytes, random_ids, reference, settled
from tests.reliability.kv_cluster import free_ports, generate_request, wait_until

REPO = Path(__file__).resolve().parents[2]
Code = grpc.StatusCode
PS = 4
MAX_NEW = 6
SLOW_S = 1.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("consistency-llama"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return load_hf(checkpoint)


def _slow_prefill(checkpoint, cp_size: int) -> PrefillDaemon:
    """A prefill daemon whose ranks sleep ``SLOW_S`` after layer 0 of every prefill."""
    saved = os.environ.get(SLOW_LAYER_ENV)
    os.environ[SLOW_LAYER_ENV] = f"0:{SLOW_S}"  # read by the rank processes it starts
    try:
        return PrefillDaemon(EngineConfig(str(checkpoint), cp_size=cp_size, page_size=PS, pages_per_lane=48,
                                          start_timeout_s=120), DaemonConfig(lease_s=600))
    finally:
        if saved is None:
            del os.environ[SLOW_LAYER_ENV]
        else:
            os.environ[SLOW_LAYER_ENV] = saved


def _quiet(prefill, decode) -> bool:
    return (prefill.cache.held_pages == 0 and prefill.leases.held() == {} and decode.pool.used_count == 0
            and decode.budget.used == 0)


@pytest.mark.timeout(120)
def test_a_request_cancelled_while_decoding_or_prefilling_leaves_the_caches_consistent(checkpoint, hf):
    prefill = _slow_prefill(checkpoint, cp_size=2)
    decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PS, pool_pages=120,
                                       device="cpu", transport="grpc"))
    try:
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            a = random_ids(15, 1)  # three whole pages and three tokens
            assert generate(stub, a, MAX_NEW).tokens == reference(hf, a, MAX_NEW)

            # Cancelled while decoding, after its first reply: the prefill side skipped A's three
            # pages, the decode side holds B's verified prompt pages but none of its reply's.
            b = a[:12] + random_ids(5, 2)
            call = stub.Generate(generate_request(b, 120), timeout=60)
            first = next(call)
            assert first.cached_tokens == 12 and first.prefix_cache_tokens == 16
            out = list(first.token_ids)
            while len(out) < len(b) // PS * PS:  # enough tokens that B + them would fill pages
                out += next(call).token_ids
            call.cancel()
            assert wait_until(lambda: _quiet(prefill, decode))
            assert decode.prefix_cache.peek(b + out) == 4  # B's four whole pages; no generated page

            # Cancelled while its prefill runs (its deadline passes in the sleep): nothing of C
            # enters the decode cache; the prefill side, whose prefill ended, keeps its pages.
            c = a[:8] + random_ids(9, 3)  # two pages shared with A
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(generate_request(c, MAX_NEW), timeout=SLOW_S / 2))
            assert caught.value.code() == Code.DEADLINE_EXCEEDED
            assert wait_until(lambda: _quiet(prefill, decode) and prefill.cache.peek(c) == 4, 30)
            assert decode.prefix_cache.peek(c) == 2
            got = generate(stub, c, MAX_NEW)
            assert got.tokens == reference(hf, c, MAX_NEW)
            assert got.cached_tokens == 16  # four pages skipped on the prefill side
            assert got.moved_bytes == (5 - 2) * page_bytes(decode)  # only the pages after the decode's two
        settled(prefill, decode)
    finally:
        decode.stop(grace_s=1.0)
        prefill.stop()


def _start_cli_prefill(checkpoint, port: int, base: int, ready: Path, log: Path) -> subprocess.Popen:
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "lanekv.cli", "prefill", "--model", str(checkpoint), "--cp-size", "1",
             "--page-size", str(PS), "--pool-pages", "48", "--device", "cpu", "--port", str(port),
             "--transfer-port-base", str(base), "--ready-file", str(ready)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), SLOW_LAYER_ENV: f"0:{SLOW_S}"},
            stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


@pytest.mark.timeout(180)
def test_a_prefill_daemon_killed_mid_request_leaves_the_decode_cache_serving(checkpoint, hf, tmp_path):
    base = free_ports(2)
    port = base + 1
    ready, log = tmp_path / "ready", tmp_path / "prefill.log"
    proc = _start_cli_prefill(checkpoint, port, base, ready, log)
    decode = prefill = None
    try:
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 120), log.read_text()[-2000:]
        assert proc.poll() is None, log.read_text()[-2000:]
        endpoint = ready.read_text().strip()
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), endpoint, page_size=PS, pool_pages=120, device="cpu",
                                           transport="grpc", prefill_health_interval_s=0.2))
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            a = random_ids(15, 11)
            assert generate(stub, a, MAX_NEW).tokens == reference(hf, a, MAX_NEW)
            held = decode.prefix_cache.cached_pages  # A's pages and its reply's
            b = a[:12] + random_ids(6, 12)
            failed: list = []

            def send() -> None:
                try:
                    generate(stub, b, MAX_NEW)
                except grpc.RpcError as err:
                    failed.append(err.code())

            sender = threading.Thread(target=send)
            sender.start()
            time.sleep(SLOW_S / 3)  # in the middle of B's prefill
            os.killpg(proc.pid, signal.SIGKILL)  # the daemon and its rank, at once
            proc.wait(timeout=30)
            sender.join(60)
            assert failed == [Code.UNAVAILABLE]
            assert wait_until(lambda: decode.pool.used_count == 0 and decode.budget.used == 0)
            assert decode.prefix_cache.cached_pages == held and decode.prefix_cache.peek(b) == 3

            # A new prefill daemon on the same ports: its cache is empty, so it computes all of
            # B (cached_tokens 0), and only the pages after the decode side's three move.
            prefill = PrefillDaemon(EngineConfig(str(checkpoint), cp_size=1, page_size=PS, pages_per_lane=48,
                                                 start_timeout_s=120),
                                    DaemonConfig(port=port, transfer_port_base=base, lease_s=600))
            assert wait_until(lambda: decode.prefills.available, 30)
            stale = decode.prefills.picks_on_stale
            got = generate(stub, b, MAX_NEW)
            assert got.tokens == reference(hf, b, MAX_NEW)
            assert got.cached_tokens == 0 and got.moved_bytes == (5 - 3) * page_bytes(decode)
            # The routing memory had A's pages on that address; the reply showed them gone.
            assert decode.prefills.picks_on_stale == stale + 1
        settled(prefill, decode)
    finally:
        if decode is not None:
            decode.stop(grace_s=1.0)
        if prefill is not None:
            prefill.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
