"""Fetches whose ranks' streams are received by receiver processes (``transfer.grpcfetch.receivers``).

Real gRPC servers on loopback, real receiver processes with small slots (so
slots are reused many times, and a chunk larger than a slot comes inline):
bytes equal to the servers' pools, errors arrive as their own classes with
their fields, a failed placement hands the processes back clean, a killed
process fails its fetch at once and is replaced, ranks beyond the idle
processes are received in threads, and closing leaves no process or file.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import lanekv.transfer.grpcfetch.remotefetch as remotefetch_module
import pytest
import torch
from lanekv.runtime.security import SecurityConfig
from lanekv.transfer.grpcfetch import client as client_module
from lanekv.transfer.grpcfetch.client import (
    ChecksumError,
    KVClient,
    RemoteError,
    RetryPolicy,
    TransferError,
)
from lanekv.transfer.grpcfetch.fetch import ByteBudget, Job
from lanekv.transfer.grpcfetch.receivers import ReceiverPool
from lanekv.transfer.grpcfetch.remotefetch import RemoteRankFetch
from lanekv.transfer.grpcfetch.spans import Span
from lanekv.transfer.rank.service import KVTransferService

from tests.reliability.kv_cluster import (
    PAGE_LAYER_BYTES,
    make_agreement,
    placer,
    same_bits,
    start_servers,
)
from tests.reliability.proxy import FaultProxy

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]

SLOT_BYTES = 4 * PAGE_LAYER_BYTES
CHUNK = 2 * PAGE_LAYER_BYTES  # two pages of a layer: many chunks per rank, each in a slot
TIMEOUT = 20.0


@pytest.fixture(scope="module")
def pool():
    receivers = ReceiverPool(2, SecurityConfig(), slot_bytes=SLOT_BYTES, slots=2)
    assert receivers.wait_started(2, 90), "receiver processes did not start"
    yield receivers
    receivers.close()


@pytest.fixture
def cluster():
    servers = start_servers(2, 13)
    yield servers
    servers.stop()


@pytest.fixture
def remote(monkeypatch):
    """Every rank part run by a receiver process, as it is made."""
    made: list[RemoteRankFetch] = []

    class Counted(RemoteRankFetch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(client_module, "RemoteRankFetch", Counted)
    return made


def _fetch(kv: KVClient, cluster, place, **kw):
    return kv.fetch(cluster.endpoints, "req", cluster.fingerprint, place, timeout=TIMEOUT, **kw)


@pytest.mark.parametrize("chunk", [CHUNK, 2 * SLOT_BYTES], ids=["in-slots", "inline"])
def test_fetch_through_receivers_is_bit_exact(pool, cluster, remote, chunk):
    dest, log = torch.full_like(cluster.full, float("nan")), []
    with KVClient(receivers=pool) as kv:
        stats = _fetch(kv, cluster, placer(dest, log), max_chunk_bytes=chunk)
    assert same_bits(dest, cluster.full)
    assert sorted(r.rank for r in remote) == [0, 1]
    assert stats.bytes == cluster.full.numel() * 2
    assert len(set(log)) == len(log) == cluster.full.shape[0] * 13  # every cell (layer, page) placed once
    if chunk == CHUNK:
        assert stats.per_rank[0].chunks > 2 * pool._slots  # slots were reused


def test_errors_come_back_as_their_classes_and_the_receivers_serve_again(pool, cluster, remote, monkeypatch):
    with KVClient(receivers=pool) as kv:
        with pytest.raises(RemoteError) as caught:
            kv.fetch(cluster.endpoints, "no-such-request", cluster.fingerprint, lambda h, t: None, timeout=TIMEOUT)
        assert caught.value.code == grpc.StatusCode.NOT_FOUND and caught.value.rank in (0, 1)
        assert caught.value.endpoint == cluster.endpoints[caught.value.rank]

        frame = KVTransferService.frame

        def corrupt(self, header, data):
            if header.rank == 1 and header.seq == 2:
                data = bytes([data[0] ^ 0x01]) + data[1:]
            return frame(self, header, data)

        monkeypatch.setattr(KVTransferService, "frame", corrupt)
        log: list = []
        with pytest.raises(ChecksumError) as caught:
            _fetch(kv, cluster, placer(torch.zeros_like(cluster.full), log), max_chunk_bytes=CHUNK)
        assert (caught.value.request_id, caught.value.rank, caught.value.seq) == ("req", 1, 2)
        assert (1, 0, 9) not in log and (1, 0, 11) not in log  # rank 1's chunk 2: layer 0, pages 9 and 11
        monkeypatch.setattr(KVTransferService, "frame", frame)
        assert pool.wait_started(2, 30)
        pids = {r.process.pid for r in pool._idle}
        dest = torch.zeros_like(cluster.full)
        _fetch(kv, cluster, placer(dest, []), max_chunk_bytes=CHUNK)
    assert same_bits(dest, cluster.full)
    assert len(remote) == 6 and {r._receiver.process.pid for r in remote[-2:]} == pids


def test_a_failed_placement_hands_the_receivers_back_clean(pool, cluster, remote):
    class Boom(Exception):
        pass

    def failing(header, tensor):
        raise Boom(f"rank {header.rank}")

    assert pool.wait_started(2, 30)
    pids = {r.process.pid for r in pool._idle}
    with KVClient(receivers=pool) as kv:
        with pytest.raises(Boom):
            _fetch(kv, cluster, failing, max_chunk_bytes=CHUNK)
        assert pool.wait_started(2, 30), "the receivers were not handed back"
        assert {r.process.pid for r in pool._idle} == pids  # the same processes: stopped, not replaced
        dest = torch.zeros_like(cluster.full)
        _fetch(kv, cluster, placer(dest, []), max_chunk_bytes=CHUNK)
    assert same_bits(dest, cluster.full) and len(remote) == 4


@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_failed_receiver_hands_the_rest_of_its_rank_to_a_thread(pool, cluster, remote, monkeypatch, caplog,
                                                                   fault):
    """SIGKILL: its socket closes; SIGSTOP: it says nothing for SILENT_S. Either way it is
    killed and replaced, and the rank's cells not yet relayed are fetched in a thread."""
    monkeypatch.setattr(remotefetch_module, "SILENT_S", 1.0)
    assert pool.wait_started(2, 30)
    hit = []

    def place(header, tensor):
        if header.rank == 0 and not hit:
            hit.append(next(r for r in remote if r.rank == 0)._receiver)
            os.kill(hit[0].process.pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        log_place(header, tensor)

    dest, log = torch.zeros_like(cluster.full), []
    log_place = placer(dest, log)
    t0 = time.monotonic()
    with KVClient(receivers=pool) as kv:
        stats = _fetch(kv, cluster, place, max_chunk_bytes=CHUNK, layer_end=cluster.full.shape[0],
                       pages={r: cluster.pages_of(r) for r in (0, 1)})
    assert time.monotonic() - t0 < 10.0  # not the 20 s deadline
    assert same_bits(dest, cluster.full)
    assert len(log) == len(set(log)) == cluster.full.shape[0] * 13  # every cell placed once
    assert (stats.per_rank[0].retries, stats.per_rank[1].retries) == (1, 0)
    assert "receiving the rest in a thread" in caplog.text
    assert hit[0].process.wait(10) == -signal.SIGKILL
    assert pool.wait_started(2, 90), "the failed receiver was not replaced"
    assert hit[0] not in pool._idle


def test_ranks_beyond_the_idle_receivers_are_received_in_threads(cluster, remote):
    one = ReceiverPool(1, SecurityConfig(), slot_bytes=SLOT_BYTES, slots=2)
    try:
        assert one.wait_started(1, 90)
        receiver = one._idle[0]
        dest = torch.zeros_like(cluster.full)
        with KVClient(receivers=one) as kv:
            _fetch(kv, cluster, placer(dest, []), max_chunk_bytes=CHUNK)
        assert same_bits(dest, cluster.full) and len(remote) == 1
    finally:
        one.close()
    assert receiver.process.poll() is not None and one.take() is None
    assert not os.path.exists(receiver._path)


def test_a_client_closes_the_receivers_it_made(cluster):
    kv = KVClient(receivers=1)
    assert kv.receivers.wait_started(1, 90)
    receiver = kv.receivers._idle[0]
    assert not os.path.exists(receiver._path)  # removed once mapped by both processes
    assert kv.handshake(cluster.endpoints[0], make_agreement(), TIMEOUT).fingerprint == cluster.fingerprint
    kv.close()
    assert receiver.process.poll() is not None


def test_a_stalled_stream_is_cut_and_resumed_by_its_receiver(pool, cluster, remote):
    with FaultProxy(cluster.endpoints[1]) as proxy:
        # Rank 1's first connection freezes after about five chunks; the retry's connection is spared.
        proxy.stall_after(5 * (CHUNK + 200), new_connections=True)
        threading.Thread(target=lambda: proxy.faulted.wait(20) and proxy.spare_new_connections(),
                         daemon=True).start()
        dest, log = torch.zeros_like(cluster.full), []
        policy = RetryPolicy(attempts=3, backoff_s=0.02, stall_s=0.3)
        with KVClient(receivers=pool, retry=policy) as kv:
            stats = kv.fetch({0: cluster.endpoints[0], 1: proxy.endpoint}, "req", cluster.fingerprint,
                             placer(dest, log), max_chunk_bytes=CHUNK, timeout=TIMEOUT)
        assert proxy.faulted.is_set() and proxy.accepted >= 2
    assert same_bits(dest, cluster.full)
    assert len(set(log)) == len(log) == cluster.full.shape[0] * 13
    assert (stats.per_rank[0].retries, stats.per_rank[1].retries) == (0, 1)
    assert sorted(r.rank for r in remote) == [0, 1]


def test_a_pool_closed_under_a_fetch_fails_it_instead_of_ending_it_short(cluster):
    own = ReceiverPool(2, SecurityConfig(), slot_bytes=SLOT_BYTES, slots=2)
    assert own.wait_started(2, 90)
    placed = []

    def slow(header, tensor):
        placed.append(header)
        time.sleep(0.05)

    threading.Timer(0.3, own.close).start()
    with KVClient(receivers=own) as kv:
        with pytest.raises(TransferError, match="receiver"):
            _fetch(kv, cluster, slow, max_chunk_bytes=CHUNK)
    # Cut short (rank 0's 7 pages are 4 chunks a layer, rank 1's 6 are 3), and said so above.
    assert 0 < len(placed) < 7 * cluster.full.shape[0]


def test_a_part_stopped_before_it_began_leaves_its_receiver_idle(pool, cluster):
    assert pool.wait_started(2, 30)
    receiver = pool.take()
    job = Job("req", cluster.fingerprint, CHUNK, RetryPolicy(attempts=1), TIMEOUT, None, ByteBudget(1 << 20))
    part = RemoteRankFetch(job, 0, cluster.endpoints[0], Span(0, None, None), None, receiver, pool)
    part.cancel()  # the fetch failed before this part's thread ran
    part.run()
    assert job.ready.empty() and receiver.clean
    part.close()
    assert pool.wait_started(2, 5)
    dest = torch.zeros_like(cluster.full)
    t0 = time.monotonic()
    with KVClient(receivers=pool) as kv:
        _fetch(kv, cluster, placer(dest, []), max_chunk_bytes=CHUNK)
    assert same_bits(dest, cluster.full) and time.monotonic() - t0 < 5.0


def test_a_receiver_that_died_idle_is_passed_over_and_replaced(pool, cluster, remote):
    assert pool.wait_started(2, 30)
    dead = pool._idle[-1]
    os.kill(dead.process.pid, signal.SIGKILL)
    dead.process.wait(10)
    dest = torch.zeros_like(cluster.full)
    with KVClient(receivers=pool) as kv:
        _fetch(kv, cluster, placer(dest, []), max_chunk_bytes=CHUNK)
    assert same_bits(dest, cluster.full)
    assert all(r._receiver is not dead for r in remote)
    assert pool.wait_started(2, 90) and dead not in pool._idle


def test_bad_arguments_hand_the_receivers_back(pool, cluster):
    assert pool.wait_started(2, 30)
    with KVClient(receivers=pool) as kv:
        with pytest.raises(TypeError):
            kv.fetch(cluster.endpoints, "req", cluster.fingerprint, lambda h, t: None, timeout=TIMEOUT,
                     pages={0: [0, 2], 1: 5})
    assert pool.wait_started(2, 5)
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="receivers"):
            KVClient(receivers=bad)


def test_grow_to_starts_more_and_never_shrinks():
    receivers = ReceiverPool(1, SecurityConfig(), slot_bytes=SLOT_BYTES, slots=2)
    try:
        assert receivers.grow_to(3) == 3 and receivers.size == 3
        assert receivers.wait_started(3, 90), "the added receiver processes did not start"
        started = list(receivers._idle)
        assert len({r.process.pid for r in started}) == 3
        assert receivers.grow_to(2) == 3  # never fewer: a fetch may be using them
        assert set(receivers._idle) == set(started)
        with pytest.raises(ValueError, match=r"^count must be an integer >= 0, got count=-1$"):
            receivers.grow_to(-1)
    finally:
        receivers.close()
    assert receivers.grow_to(5) == 3 and not receivers._all  # closed: nothing starts
    assert all(r.process.poll() is not None for r in started)
