"""Sender relays (``transfer.rank.relay``): a rank's FetchKV bytes sent from another process,
checked against the rank's digests, with the rank's refusals passed through and a dead
relay's stream finished by the rank itself."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from lanekv.proto import lanekv_pb2
from lanekv.transfer.grpcfetch.client import KVClient, RemoteError
from lanekv.transfer.protocol.descriptors import Descriptor
from lanekv.transfer.rank.relay import (
    RangeMismatch,
    RelayProcesses,
    RelayService,
    RelaySpec,
    check_relays,
    range_payload,
    serve_relay,
)

from tests.markers import requires_gpu
from tests.reliability.kv_cluster import LAYERS, PAGE, placer, rows_of, same_bits
from tests.transfer.fastpath.rig import fill, shm_rank

pytestmark = pytest.mark.timeout(60)
PAGES = [(0, 5), (1, 2), (2, 7), (3, 0), (4, 3)]  # (logical, physical)


def _filled(pool: torch.Tensor) -> None:
    for layer in range(LAYERS):
        fill(pool, [p for _, p in PAGES], layer, seed=layer + 11)


def _expected(pool: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
    for logical, physical in PAGES:
        out[:, :, logical * PAGE:(logical + 1) * PAGE] = pool[:, :, physical * PAGE:(physical + 1) * PAGE]
    return out


@contextlib.contextmanager
def _relays(endpoint, agreement, count):
    served = []
    try:
        for _ in range(count):
            service = RelayService(0, endpoint, agreement)
            service.attach()
            served.append(serve_relay(service))
        yield served
    finally:
        for s in served:
            s.stop(0.5)


def _count_reads(source, monkeypatch) -> list:
    reads = []
    original = source.read

    def read(*args, **kw):
        reads.append(args)
        return original(*args, **kw)

    monkeypatch.setattr(source, "read", read)
    return reads


def test_check_relays_names_the_field():
    assert check_relays(0) == 0 and check_relays(3) == 3
    for bad in (-1, 9, True, 1.5):
        with pytest.raises(ValueError, match="fetch_relays"):
            check_relays(bad)


def test_relays_carry_every_byte_and_the_rank_sends_none(monkeypatch):
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        _filled(pool)
        source.add("r1", PAGES, capability="cap")
        reads = _count_reads(source, monkeypatch)
        with _relays(endpoint, agreement, 2) as served:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            cells = []
            stats = kv.fetch({0: endpoint}, "r1", agreement.fingerprint, placer(dest, cells), timeout=20,
                             layer_end=LAYERS, pages={0: [p for p, _ in PAGES]}, epoch=":cap",
                             streams_per_rank=2, relays={0: [f"127.0.0.1:{s.port}" for s in served]},
                             max_chunk_bytes=2 * PAGE * 2 * 8 * 2 * 2)
            assert same_bits(dest, _expected(pool))
            assert sorted(cells) == sorted({(0, layer, p) for layer in range(LAYERS) for p, _ in PAGES})
            sent = [s.service.sent_bytes for s in served]
            assert all(n > 0 for n in sent), sent  # both relays carried a stream
            assert sum(sent) == stats.bytes == dest.numel() * dest.element_size()
            assert reads == []  # the rank's own FetchKV read (and sent) no page
            assert stats.retries == 0


def test_the_ranks_refusal_comes_back_through_the_relay():
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        _filled(pool)
        source.add("r1", PAGES, capability="cap")
        with _relays(endpoint, agreement, 1) as served:
            relay = f"127.0.0.1:{served[0].port}"
            with pytest.raises(RemoteError) as err:  # a wrong capability: the rank's answer, word for word
                kv.fetch({0: endpoint}, "r1", agreement.fingerprint, lambda *_: None, timeout=10,
                         epoch=":wrong", relays={0: [relay]})
            assert err.value.code == grpc.StatusCode.NOT_FOUND and "unknown request" in str(err.value)
            stub = grpc.insecure_channel(relay)
            call = stub.unary_stream("/lanekv.v1.KVTransfer/FetchKV")
            request = lanekv_pb2.FetchRequest(request_id="r1", fingerprint=agreement.fingerprint, descriptors=True)
            with pytest.raises(grpc.RpcError) as refused:
                list(call(request.SerializeToString(), timeout=5, metadata=(("lanekv-epoch", ":cap"),)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "descriptors=True" in refused.value.details()
            stub.close()


def test_a_flipped_byte_in_the_mapped_pool_is_caught_before_it_is_sent():
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        _filled(pool)
        source.add("r1", PAGES)
        physical = tuple(p for _, p in PAGES)
        digest = source.digest(physical, 1, 3, request_id="r1")
        descriptor = Descriptor("r1", 0, 0, 1, 3, tuple(p for p, _ in PAGES), physical, digest)
        payload = range_payload(pool, descriptor, PAGE)  # as the rank digested it: it verifies
        assert same_bits(payload, pool[1:3][:, :, rows_of(list(physical))])
        pool.view(torch.uint8)[2, 1, PAGES[2][1] * PAGE].view(-1)[0] ^= 0x10  # one bit of layer 2
        with pytest.raises(RangeMismatch, match=r"layers \[1, 3\)"):
            range_payload(pool, descriptor, PAGE)


def test_a_relay_that_fails_a_digest_hands_the_stream_to_the_rank(monkeypatch):
    # The relay reads something other than what the rank sealed: nothing of that range
    # leaves the relay, and the decode side gets the pages from the rank itself.
    import lanekv.transfer.rank.relay as relay_module

    def damaged(pool, descriptor, page_size):
        raise RangeMismatch("layers [0, 4) read 0x1, the rank sealed them as 0x2")

    monkeypatch.setattr(relay_module, "range_payload", damaged)
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        _filled(pool)
        source.add("r1", PAGES)
        with _relays(endpoint, agreement, 1) as served:
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            stats = kv.fetch({0: endpoint}, "r1", agreement.fingerprint, placer(dest, []), timeout=20,
                             layer_end=LAYERS, pages={0: [p for p, _ in PAGES]},
                             relays={0: [f"127.0.0.1:{served[0].port}"]})
            assert served[0].service.sent_bytes == 0
            assert stats.retries == 1  # the fall back to the rank
            assert same_bits(dest, _expected(pool))


def _relay_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "lanekv.transfer.rank.relay_main"], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


@pytest.mark.timeout(90)
def test_relay_processes_serve_then_a_killed_one_falls_back_and_none_is_left():
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        _filled(pool)
        source.add("r1", PAGES)
        source.add("r2", [(p, q) for p, q in PAGES])  # same pages, another request id
        spec = RelaySpec(0, endpoint, agreement.encode(), kv.security, "127.0.0.1", "127.0.0.1", "cpu")
        relays = RelayProcesses(spec, 2)
        try:
            pids = {p.pid for p in relays.processes}
            pages = {0: [p for p, _ in PAGES]}
            dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=pool.dtype)
            kv.fetch({0: endpoint}, "r1", agreement.fingerprint, placer(dest, []), timeout=30, layer_end=LAYERS,
                     pages=pages, streams_per_rank=2, relays={0: relays.endpoints})
            assert same_bits(dest, _expected(pool))
            relays.processes[0].send_signal(signal.SIGKILL)
            relays.processes[0].wait(10)
            dest.zero_()
            # Received in receiver processes this time: the fallback travels with the stream's part.
            with KVClient(receivers=2) as received:
                assert received.receivers.wait_started(2, 60)
                stats = received.fetch({0: endpoint}, "r2", agreement.fingerprint, placer(dest, []), timeout=30,
                                       layer_end=LAYERS, pages=pages, streams_per_rank=2,
                                       relays={0: relays.endpoints})
                assert received.receivers.taken == 2  # both streams went through receiver processes
            assert same_bits(dest, _expected(pool))
            assert stats.retries >= 1  # the dead relay's stream went to the rank
        finally:
            relays.close()
        assert all(p.poll() is not None for p in relays.processes)
        assert not (pids & _relay_pids())


@pytest.mark.timeout(60)
def test_a_relay_exits_when_its_parent_does(tmp_path):
    # The parent (a stand-in rank) starts a relay, then dies without closing it.
    with shm_rank() as (source, pool, endpoint, agreement, kv):
        spec = RelaySpec(0, endpoint, agreement.encode(), kv.security, "127.0.0.1", "127.0.0.1", "cpu")
        script = (
            "import pickle, sys, os\n"
            "from lanekv.transfer.rank.relay import RelayProcesses\n"
            "relays = RelayProcesses(pickle.loads(sys.stdin.buffer.read()), 1)\n"
            "print(relays.processes[0].pid, flush=True)\n"
            "os._exit(0)\n"
        )
        parent = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(spec), capture_output=True,
                                timeout=60, cwd=os.getcwd())
        assert parent.returncode == 0, parent.stderr.decode()[-2000:]
        pid = int(parent.stdout.split()[0])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and pid in _relay_pids():
            time.sleep(0.1)
        assert pid not in _relay_pids()


@requires_gpu
@pytest.mark.timeout(120)
def test_relay_processes_map_a_gpu_pool_by_cuda_ipc_and_send_its_pages():
    # The GPU path of a relay: CUDA IPC, gather_pages and the digest on the device.
    from lanekv.transfer.protocol.contract import Topology
    from lanekv.transfer.rank.server import serve
    from lanekv.transfer.rank.sources import TensorPageSource

    from tests.reliability.kv_cluster import make_agreement

    agreement = make_agreement(kv_dtype="float16")
    pool = torch.zeros(LAYERS, 2, 8 * PAGE, 2, 8, dtype=torch.float16, device="cuda:0")
    source = TensorPageSource(agreement, 0, pool)
    served = serve(source)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    cpu = pool.cpu()
    for layer in range(LAYERS):
        fill(cpu, [p for _, p in PAGES], layer, seed=layer + 11)
    pool.copy_(cpu)
    torch.cuda.synchronize()
    source.add("g1", PAGES)
    kv = KVClient()
    relays = RelayProcesses(RelaySpec(0, endpoint, agreement.encode(), kv.security, "127.0.0.1", "127.0.0.1",
                                      "cuda:0"), 2)
    try:
        dest = torch.zeros(LAYERS, 2, len(PAGES) * PAGE, 2, 8, dtype=torch.float16)
        stats = kv.fetch({0: endpoint}, "g1", agreement.fingerprint, placer(dest, []), timeout=60, layer_end=LAYERS,
                         pages={0: [p for p, _ in PAGES]}, streams_per_rank=2, relays={0: relays.endpoints})
        assert same_bits(dest, _expected(cpu))
        assert stats.retries == 0
    finally:
        relays.close()
        kv.close()
        served.server.stop(None)
