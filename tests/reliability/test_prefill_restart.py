"""A prefill daemon restarted under the same ports, mid-traffic: the decode daemon does not
keep what it learned from the old start.

The decode daemon learns a prefill daemon's topology at its handshake (which rank owns
which page, where a page lies in a rank's pool) and maps each rank's pool over the fast
path. A new start under the same ports may lay its pool out otherwise (here: fewer pages
per lane) and has a new pool file. Each Prefill names the start it ran on (its epoch):
a start other than the one the topology came from makes the decode daemon handshake
again before it reads the pages, and the fast path attaches the new pool. Requests in
flight when the old start goes may fail (UNAVAILABLE); every later one generates the
tokens it generated before. The decode daemon's prefix cache is off: every request goes
through the prefill daemon and its ranks' pages.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2_grpc

from tests.checkpoints import write_llama
from tests.reliability.kv_cluster import generate_request, wait_until

pytestmark = pytest.mark.timeout(300)
Code = grpc.StatusCode
PAGE_SIZE = 4
PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45], [7, 8, 9, 10, 11, 12, 13], [100, 3, 200, 4, 50, 60, 70, 80]]
NEW_TOKENS = 5


def _free_ports(count: int) -> list[int]:
    """``count`` consecutive free ports (the ranks' base + r), then one more (the parent)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return list(range(base, base + count))
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports")


def _prefill(checkpoint, ports: list[int], pages_per_lane: int, cp_size: int = 2) -> PrefillDaemon:
    engine = EngineConfig(str(checkpoint), cp_size=cp_size, page_size=PAGE_SIZE, pages_per_lane=pages_per_lane,
                          start_timeout_s=120)
    return PrefillDaemon(engine, DaemonConfig(port=ports[2], transfer_port_base=ports[0], lease_s=60))


def _generate(stub, prompt) -> list[int]:
    return [t for reply in stub.Generate(generate_request(prompt, NEW_TOKENS), timeout=60) for t in reply.token_ids]


def test_a_prefill_daemon_restarted_on_the_same_ports_is_used_as_its_new_start(tmp_path):
    checkpoint = write_llama(tmp_path / "llama")
    ports = _free_ports(3)
    prefill = _prefill(checkpoint, ports, pages_per_lane=64)
    decode = None
    try:
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE, pool_pages=200,
                                           device="cpu", prefill_health_interval_s=0.2, prefix_cache=False))
        assert decode.fastpath is not None  # transport "auto": the shared-memory fast path on this host
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            expected = [_generate(stub, p) for p in PROMPTS]
            old_epoch = prefill.epoch
            outcomes: list[tuple[float, Code, list[int] | None, int]] = []
            stop = threading.Event()

            def traffic() -> None:
                i = 0
                while not stop.is_set():
                    k = i % len(PROMPTS)
                    try:
                        got, code = _generate(stub, PROMPTS[k]), Code.OK
                    except grpc.RpcError as err:
                        got, code = None, err.code()
                    outcomes.append((time.monotonic(), code, got, k))
                    i += 1

            sender = threading.Thread(target=traffic)
            sender.start()
            try:
                assert wait_until(lambda: len(outcomes) >= 3, 60)
                prefill.stop()
                # The new start lays its pool out otherwise: the old topology's pages would be wrong.
                prefill = _prefill(checkpoint, ports, pages_per_lane=48)
                assert prefill.epoch != old_epoch
                restarted = time.monotonic()
                assert wait_until(lambda: sum(t > restarted and c == Code.OK for t, c, _, _ in outcomes) >= 6, 120)
            finally:
                stop.set()
                sender.join(90)
            for _, code, got, k in outcomes:
                assert code in (Code.OK, Code.UNAVAILABLE), code
                if code == Code.OK:
                    assert got == expected[k]
            # Once the new start answered one request, every later one succeeds.
            first_ok = next(i for i, (t, c, _, _) in enumerate(outcomes) if t > restarted and c == Code.OK)
            assert all(c == Code.OK for _, c, _, _ in outcomes[first_ok:]), [c for _, c, _, _ in outcomes]
            assert [_generate(stub, p) for p in PROMPTS] == expected
            paths = decode.fastpath.transport(prefill.topology.endpoints[0])
            assert paths != "grpc", paths  # the fast path attached the new start's pool
    finally:
        if decode is not None:
            decode.stop(grace_s=0.5)
        prefill.stop()


def test_a_restart_between_health_checks_is_told_by_the_epoch(tmp_path):
    """The restart happens between two health checks (none runs during this test) and
    lays the pages out otherwise (cp 2 -> 1: other owners, other places in the pools):
    only the epoch of the next Prefill can tell, and the decode daemon handshakes again."""
    checkpoint = write_llama(tmp_path / "llama")
    ports = _free_ports(3)
    prefill = _prefill(checkpoint, ports, pages_per_lane=64)
    decode = None
    try:
        decode = DecodeDaemon(DecodeConfig(str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE, pool_pages=200,
                                           device="cpu", prefill_health_interval_s=3600, prefix_cache=False))
        with grpc.insecure_channel(decode.endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            expected = [_generate(stub, p) for p in PROMPTS]
            prefill.stop()
            prefill = _prefill(checkpoint, ports, pages_per_lane=64, cp_size=1)
            assert [_generate(stub, p) for p in PROMPTS] == expected
            target = decode.prefills.targets[0]
            assert target.epoch == prefill.epoch and target.topology.cp_size == 1
    finally:
        if decode is not None:
            decode.stop(grace_s=0.5)
        prefill.stop()
