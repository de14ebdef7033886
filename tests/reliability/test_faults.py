"""Faults: broken, stalled and refused streams, dead ranks, killed and restarted daemons.

The first tests run ``KVClient`` against in-process KVTransfer servers, with a
``FaultProxy`` between the client and rank 1: a connection reset mid-stream
and a connection frozen mid-stream are resumed on a fresh connection asking
for only the cells not yet received (each cell is placed once), a path that
stays frozen fails DEADLINE_EXCEEDED within the deadline, a refusal is never
retried, a dead rank fails UNAVAILABLE after a bounded number of tries.

The rest runs real daemons (a CP-2 prefill daemon, a decode daemon in this
process or as a ``lanekv decode`` subprocess) with proxies in front of the
ranks: a stalled rank is resumed with the same tokens, a path frozen for good
fails the call in time, a lease that ends while its stream is frozen ends the
call with ABORTED (NOT_FOUND), a decode daemon killed mid-fetch leaves pages that
its leases free (and a new one serves), a prefill rank killed mid-fetch
fails the call UNAVAILABLE and the prefill daemon says so from then on (and
its health goes NOT_SERVING), and
a restarted prefill daemon on the same ports refuses the old start's
requests (even one whose id it reuses) while the decode daemon serves on.
Each checks that no page is left held on either side.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.decode.config import DecodeConfig
from lanekv.decode.daemon import DecodeDaemon
from lanekv.prefill.daemon import PREFILL_SERVICE, DaemonConfig, PrefillDaemon
from lanekv.prefill.engine_config import EngineConfig
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.security import SecurityConfig
from lanekv.transfer.grpcfetch.client import KVClient, RemoteError, RetryPolicy
from lanekv.transfer.protocol.access import EPOCH_METADATA_KEY, access_ticket
from lanekv.transfer.rank.service import KVTransferService

from tests.checkpoints import write_llama
from tests.reliability.kv_cluster import (
    LAYERS,
    PAGE_LAYER_BYTES,
    free_ports,
    generate_request,
    placer,
    same_bits,
    settled,
    start_servers,
    status_of,
    tokens,
    wait_until,
)
from tests.reliability.proxy import FaultProxy

REPO = Path(__file__).resolve().parents[2]

Code = grpc.StatusCode
NUM_PAGES = 13  # rank 0 holds 7 pages, rank 1 holds 6
CHUNK_BYTES = 2 * PAGE_LAYER_BYTES  # 2 pages of one layer: 3 chunks per layer of rank 1
FAST = RetryPolicy(attempts=3, backoff_s=0.02, stall_s=0.3)
TIMEOUT_S = 10.0


@pytest.fixture
def asked(monkeypatch) -> list[tuple[int, int, int | None, tuple[int, ...]]]:
    """Every FetchKV a server gets: (rank, layer_start, layer_end, pages)."""
    log: list = []
    fetch = KVTransferService.FetchKV

    def logged(self, request, context):
        end = request.layer_end if request.HasField("layer_end") else None
        log.append((self._source.rank, request.layer_start, end, tuple(request.pages)))
        yield from fetch(self, request, context)

    monkeypatch.setattr(KVTransferService, "FetchKV", logged)
    return log


@pytest.fixture
def cluster(asked):
    servers = start_servers(2, NUM_PAGES)  # after ``asked``: a server binds its handlers at start
    yield servers
    servers.stop()


@pytest.fixture
def proxy(cluster):
    with FaultProxy(cluster.endpoints[1]) as fault:
        yield fault


def _cells(requests, rank: int, pages_of_rank: list[int]) -> list[tuple[int, int]]:
    """The cells (layer, page) that ``rank``'s requests asked for, with repeats."""
    return [(layer, page) for r, start, end, pages in requests if r == rank
            for layer in range(start, LAYERS if end is None else end) for page in (pages or pages_of_rank)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fault", ["cut", "stall"])
@pytest.mark.parametrize("named", [True, False], ids=["pages-named", "pages-unnamed"])
def test_broken_or_frozen_stream_resumes_with_only_what_is_missing(cluster, proxy, asked, fault, named):
    endpoints = {0: cluster.endpoints[0], 1: proxy.endpoint}
    dest, log = torch.zeros_like(cluster.full), []
    extra = dict(pages={r: cluster.pages_of(r) for r in (0, 1)}, layer_end=LAYERS) if named else {}
    with KVClient(retry=FAST) as kv:
        kv.handshake(proxy.endpoint, cluster.sources[0].contract(), TIMEOUT_S)  # opens the connection
        # About five chunks of rank 1 get through (layer 0 and part of layer 1),
        # then its connection breaks or freezes.
        getattr(proxy, f"{fault}_after")(5 * (CHUNK_BYTES + 200))
        start = time.monotonic()
        stats = kv.fetch(endpoints, "req", cluster.fingerprint, placer(dest, log),
                         max_chunk_bytes=CHUNK_BYTES, timeout=TIMEOUT_S, **extra)
        elapsed = time.monotonic() - start
    assert same_bits(dest, cluster.full)
    assert len(log) == len(set(log)) == LAYERS * NUM_PAGES  # every cell placed exactly once
    assert proxy.faulted.is_set() and proxy.accepted >= 2  # the retry came on a fresh connection
    assert (stats.per_rank[0].retries, stats.per_rank[1].retries, stats.retries) == (0, 1, 1)
    rank1 = cluster.pages_of(1)
    first, *resumed = [r for r in asked if r[0] == 1]
    assert first == (1, 0, LAYERS if named else None, tuple(rank1) if named else ())
    # The resume asked for what the first stream had not delivered, and no more
    # (named pages), or at most the last layer it had reached again (unnamed).
    again = _cells(resumed, 1, rank1)
    delivered = LAYERS * len(rank1) - len(set(again))
    assert 0 < delivered < LAYERS * len(rank1)
    assert len(again) == len(set(again))
    if named:
        assert len([c for c in log if c[0] == 1]) == delivered + len(again)
    assert [r for r in asked if r[0] == 0] == [(0, 0, LAYERS if named else None,
                                                tuple(cluster.pages_of(0)) if named else ())]
    assert elapsed < (3.0 if fault == "stall" else 2.0)


@pytest.mark.timeout(30)
def test_a_path_frozen_for_good_fails_within_the_deadline(cluster, proxy, asked):
    endpoints = {0: cluster.endpoints[0], 1: proxy.endpoint}
    proxy.stall_after(CHUNK_BYTES, new_connections=True)  # every connection, the retries' too
    log: list = []
    with KVClient(retry=FAST) as kv:
        start = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            kv.fetch(endpoints, "req", cluster.fingerprint, placer(torch.zeros_like(cluster.full), log),
                     max_chunk_bytes=CHUNK_BYTES, timeout=TIMEOUT_S)
        # Three tries of 0.3 s of silence each, not the 10 s deadline.
        assert time.monotonic() - start < 3.0
        assert caught.value.code == Code.DEADLINE_EXCEEDED and caught.value.rank == 1
        assert "stalled" in str(caught.value) and "after 3 tries" in str(caught.value)
        assert len(log) == len(set(log))
        # Without retries and with a stall limit past the deadline, the deadline ends it.
        start = time.monotonic()
        with pytest.raises(RemoteError) as caught:
            kv.fetch(endpoints, "req", cluster.fingerprint, lambda h, t: None, timeout=1.0,
                     retry=RetryPolicy(attempts=1, stall_s=60.0))
        assert caught.value.code == Code.DEADLINE_EXCEEDED and time.monotonic() - start < 3.0


@pytest.mark.timeout(30)
def test_refusals_fail_at_once_and_a_dead_rank_after_bounded_tries(asked):
    # A retry would wait 0.5 s and be seen by the server as a second FetchKV.
    patient = RetryPolicy(attempts=5, backoff_s=0.5)
    token = "t0ken-" + "x" * 32
    cluster = start_servers(1, 4, epoch="start-2")
    locked = start_servers(1, 4, security=SecurityConfig(token=token))
    try:
        cases = [
            (cluster.endpoints, dict(request_id="nobody"), Code.NOT_FOUND, "unknown request"),
            (cluster.endpoints, dict(fingerprint="0" * 64), Code.FAILED_PRECONDITION, "fingerprint"),
            (cluster.endpoints, dict(pages={0: [99]}), Code.INVALID_ARGUMENT, "99"),
            (cluster.endpoints, dict(epoch="start-1"), Code.FAILED_PRECONDITION, "restarted"),
            (locked.endpoints, {}, Code.UNAUTHENTICATED, ""),
        ]
        with KVClient(retry=patient) as kv:
            for endpoints, args, code, text in cases:
                asked.clear()
                args = {"request_id": "req", "fingerprint": cluster.fingerprint, **args}
                start = time.monotonic()
                with pytest.raises(RemoteError) as caught:
                    kv.fetch(endpoints, args.pop("request_id"), args.pop("fingerprint"), lambda h, t: None,
                             timeout=TIMEOUT_S, **args)
                assert caught.value.code == code and text in caught.value.details, (args, caught.value)
                assert time.monotonic() - start < 0.5 and len(asked) <= 1, (code, asked)
            # The same start's epoch is served.
            dest, log = torch.zeros_like(cluster.full), []
            kv.fetch(cluster.endpoints, "req", cluster.fingerprint, placer(dest, log), epoch="start-2")
            assert same_bits(dest, cluster.full)

        # Nothing listens at rank 1 any more: UNAVAILABLE after three quick tries; rank 0's stream is not held up.
        locked.stop()
        endpoints = {0: cluster.endpoints[0], 1: locked.endpoints[0]}
        with KVClient(retry=RetryPolicy(attempts=3, backoff_s=0.05)) as kv:
            start = time.monotonic()
            with pytest.raises(RemoteError) as caught:
                kv.fetch(endpoints, "req", cluster.fingerprint, lambda h, t: None, timeout=TIMEOUT_S)
            assert caught.value.code == Code.UNAVAILABLE and caught.value.rank == 1
            assert "after 3 tries" in str(caught.value) and time.monotonic() - start < 2.0
    finally:
        cluster.stop()
        locked.stop()


# -- real daemons ------------------------------------------------------------------

PAGE_SIZE = 4
PROMPT = list(range(20, 60))  # 10 pages of 4: 5 on each rank, in 3 chunks per layer
NEW_TOKENS = 6
LEASE_S = 3.0
# Greedy on write_llama's weights this prompt runs long without an end-of-sequence token.
LONG_PROMPT = [11, 12, 13, 14, 15]
# Two pages of one layer of write_llama (2 KV heads x head_dim 16, float32).
DAEMON_CHUNK_BYTES = 2 * (2 * PAGE_SIZE * 2 * 16 * 4)


def _prefill_daemon(checkpoint, **config) -> PrefillDaemon:
    return PrefillDaemon(
        EngineConfig(str(checkpoint), cp_size=2, page_size=PAGE_SIZE, pages_per_lane=64, start_timeout_s=120),
        DaemonConfig(**{"lease_s": LEASE_S, **config}),
    )


def _decode_daemon(checkpoint, prefill: PrefillDaemon) -> DecodeDaemon:
    return DecodeDaemon(DecodeConfig(
        str(checkpoint), prefill.endpoint, page_size=PAGE_SIZE, pool_pages=160, device="cpu", page_wait_s=1.0,
        transport="grpc",  # the faults are injected into the gRPC streams
        fetch_chunk_bytes=DAEMON_CHUNK_BYTES, fetch_attempts=3, stall_timeout_s=0.5, release_timeout_s=1.0,
        prefix_cache=False,  # the prompts repeat, and every run must move every page through the faults
    ))


def _behind_proxies(prefill: PrefillDaemon) -> list[FaultProxy]:
    """Proxies in front of the ranks, named in every Prefill reply from now on."""
    proxies = [FaultProxy(endpoint) for endpoint in prefill.topology.endpoints]
    prefill.topology = dataclasses.replace(prefill.topology, endpoints=tuple(p.endpoint for p in proxies))
    return proxies


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("faults-llama"))


@pytest.fixture(scope="module")
def pair(checkpoint):
    prefill = _prefill_daemon(checkpoint)
    proxies = _behind_proxies(prefill)
    decode = _decode_daemon(checkpoint, prefill)
    channel = grpc.insecure_channel(decode.endpoint)
    yield prefill, decode, proxies, lanekv_pb2_grpc.DecodeServiceStub(channel)
    channel.close()
    decode.stop(grace_s=1.0)
    prefill.stop()
    for proxy in proxies:
        proxy.close()


@pytest.fixture(scope="module")
def expected(pair) -> list[int]:
    """The tokens of PROMPT, generated with no fault."""
    return tokens(pair[3], generate_request(PROMPT, NEW_TOKENS))


@pytest.mark.timeout(60)
def test_a_stalled_rank_is_resumed_with_the_same_tokens(pair, expected, caplog):
    prefill, decode, proxies, stub = pair
    free = prefill.engine.allocator.free_counts()
    caplog.set_level(logging.INFO, logger="lanekv.decode")
    # The decode daemon's connection to rank 1 freezes after about two chunks.
    proxies[1].stall_after(2 * DAEMON_CHUNK_BYTES)
    assert tokens(stub, generate_request(PROMPT, NEW_TOKENS, request_id="stalled")) == expected
    proxies[1].thaw()
    assert proxies[1].faulted.is_set() or proxies[1].accepted >= 2
    done = [r.getMessage() for r in caplog.records if r.getMessage().startswith("transfer done request_id=stalled ")]
    assert len(done) == 1 and " retries=1 " in done[0], done
    assert wait_until(lambda: settled(decode, prefill, free))


@pytest.mark.timeout(60)
def test_a_rank_frozen_for_good_fails_the_call_in_time_and_leaks_nothing(pair, expected):
    prefill, decode, proxies, stub = pair
    free = prefill.engine.allocator.free_counts()
    proxies[1].stall_after(DAEMON_CHUNK_BYTES, new_connections=True)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        tokens(stub, generate_request(PROMPT, NEW_TOKENS), timeout=20)
    # Three tries of 0.5 s of silence, far inside the call's 20 s.
    assert caught.value.code() == Code.UNAVAILABLE and time.monotonic() - start < 5.0
    assert "rank 1" in caught.value.details() and "stalled" in caught.value.details()
    # The decode pages are back at once; the prefill pages of rank 1 when the lease ends.
    assert decode.stats().free_pages == decode.stats().total_pages
    assert wait_until(lambda: settled(decode, prefill, free), LEASE_S + 5)
    proxies[1].thaw()
    assert tokens(stub, generate_request(PROMPT, NEW_TOKENS)) == expected
    assert wait_until(lambda: settled(decode, prefill, free))


@pytest.mark.timeout(60)
def test_a_lease_that_expires_mid_fetch_ends_the_call_with_aborted(pair, expected, checkpoint):
    prefill, _, proxies, _ = pair
    free = prefill.engine.allocator.free_counts()
    # A decode daemon that waits out a silent stream longer than the lease lasts.
    patient = DecodeDaemon(dataclasses.replace(pair[1].config, stall_timeout_s=LEASE_S + 1.0))
    channel = grpc.insecure_channel(patient.endpoint)
    try:
        stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
        proxies[1].stall_after(DAEMON_CHUNK_BYTES, new_connections=True)
        outcome: list = []
        call = threading.Thread(target=lambda: outcome.append(
            status_of(lambda: tokens(stub, generate_request(PROMPT, NEW_TOKENS), timeout=30), details=True)))
        call.start()
        assert wait_until(lambda: proxies[1].faulted.is_set())
        proxies[1].spare_new_connections()  # the retry gets through, after the lease has ended
        call.join(30)
        code, details = outcome[0]
        assert code == Code.ABORTED and "NOT_FOUND" in details and "rank 1" in details, details
        assert wait_until(lambda: settled(patient, prefill, free))
        assert prefill.engine.allocator.free_counts() == free
    finally:
        proxies[1].thaw()
        channel.close()
        patient.stop(grace_s=1.0)


@pytest.mark.timeout(120)
def test_a_decode_daemon_killed_mid_fetch_leaves_pages_the_leases_free(pair, expected, checkpoint, tmp_path):
    prefill, _, proxies, _ = pair
    free = prefill.engine.allocator.free_counts()

    def start_decode(name: str) -> tuple[subprocess.Popen, str]:
        ready = tmp_path / name
        proc = subprocess.Popen(
            [sys.executable, "-m", "lanekv.cli", "decode", "--model", str(checkpoint), "--prefill", prefill.endpoint,
             "--page-size", str(PAGE_SIZE), "--device", "cpu", "--pool-pages", "160", "--ready-file", str(ready),
             "--transport", "grpc"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert wait_until(lambda: ready.exists() or proc.poll() is not None, 60), "decode did not start"
        assert proc.poll() is None, proc.communicate(timeout=10)[1]
        return proc, ready.read_text().strip()

    proc, endpoint = start_decode("first")
    try:
        for proxy in proxies:  # both ranks freeze a little way into the fetch
            proxy.stall_after(DAEMON_CHUNK_BYTES, new_connections=True)
        outcome: list[grpc.StatusCode] = []
        with grpc.insecure_channel(endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            call = threading.Thread(target=lambda: outcome.append(
                status_of(lambda: tokens(stub, generate_request(PROMPT, NEW_TOKENS), timeout=30))))
            call.start()
            assert wait_until(lambda: proxies[0].faulted.is_set() and proxies[1].faulted.is_set())
            assert len(prefill.leases.held()) == 1  # its pages are pinned, mid-fetch
            proc.kill()
            proc.wait(10)
            call.join(10)
        assert outcome == [Code.UNAVAILABLE]
        # Nobody releases them: the lease frees every page.
        assert wait_until(lambda: prefill.leases.held() == {}, LEASE_S + 5)
        assert prefill.engine.allocator.free_counts() == free
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    for proxy in proxies:
        proxy.thaw()
    proc, endpoint = start_decode("second")
    try:
        with grpc.insecure_channel(endpoint) as channel:
            stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
            assert tokens(stub, generate_request(PROMPT, NEW_TOKENS)) == expected
        assert wait_until(lambda: prefill.leases.held() == {} and prefill.engine.allocator.free_counts() == free)
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.timeout(120)
def test_a_prefill_rank_killed_mid_fetch_fails_the_call_and_the_daemon_says_so(checkpoint):
    before = {child.pid for child in multiprocessing.active_children()}
    prefill = _prefill_daemon(checkpoint)
    rank1 = [c for c in multiprocessing.active_children() if c.pid not in before and c.name == "lanekv-cp-rank1"]
    proxies = _behind_proxies(prefill)
    decode = _decode_daemon(checkpoint, prefill)
    channel = grpc.insecure_channel(decode.endpoint)
    stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
    try:
        assert len(rank1) == 1
        # A request that is decoding already: its KV is here, it runs to its end.
        running = stub.Generate(generate_request(LONG_PROMPT, 200), timeout=60)
        first = next(running)
        proxies[1].stall_after(DAEMON_CHUNK_BYTES, new_connections=True)
        outcome: list[grpc.StatusCode] = []
        failing = threading.Thread(target=lambda: outcome.append(
            status_of(lambda: tokens(stub, generate_request(PROMPT, NEW_TOKENS), timeout=30))))
        start = time.monotonic()
        failing.start()
        assert wait_until(lambda: proxies[1].faulted.is_set())
        rank1[0].kill()
        failing.join(30)
        assert outcome and outcome[0] in (Code.UNAVAILABLE, Code.ABORTED) and time.monotonic() - start < 10
        rest = [t for reply in running for t in reply.token_ids]
        assert len(first.token_ids) + len(rest) == 200
        assert wait_until(lambda: decode.stats().free_pages == decode.stats().total_pages
                          and decode.stats().active_requests == 0)
        # The prefill daemon knows: every Prefill, direct or through the decode daemon, is UNAVAILABLE.
        with grpc.insecure_channel(prefill.endpoint) as direct:
            prefill_stub = lanekv_pb2_grpc.PrefillServiceStub(direct)
            request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT))
            with pytest.raises(grpc.RpcError) as caught:
                prefill_stub.Prefill(request, timeout=30)
            assert caught.value.code() == Code.UNAVAILABLE and "lanekv-cp-rank1" in caught.value.details()
            health = health_pb2_grpc.HealthStub(direct).Check(
                health_pb2.HealthCheckRequest(service=PREFILL_SERVICE), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as caught:
            tokens(stub, generate_request(PROMPT, NEW_TOKENS))
        assert caught.value.code() == Code.UNAVAILABLE
        assert decode.stats().free_pages == decode.stats().total_pages
    finally:
        channel.close()
        decode.stop(grace_s=1.0)
        prefill.stop()
        for proxy in proxies:
            proxy.close()


@pytest.mark.timeout(120)
def test_a_restarted_prefill_daemon_refuses_the_old_start(checkpoint):
    port, base = free_ports(1), free_ports(2)
    ports = dict(port=port, transfer_port_base=base, lease_s=60.0)
    old = _prefill_daemon(checkpoint, **ports)
    decode = _decode_daemon(checkpoint, old)
    channel = grpc.insecure_channel(decode.endpoint)
    stub = lanekv_pb2_grpc.DecodeServiceStub(channel)
    new = None
    try:
        want = tokens(stub, generate_request(PROMPT, NEW_TOKENS))
        reply, old_epoch = _prefill_with_epoch(old.endpoint, "reused-id")
        assert old_epoch == old.epoch
        old_ticket = access_ticket(old_epoch, reply.capability)  # what a decode daemon of the old start holds
        endpoints = dict(enumerate(reply.endpoints))
        old.stop()
        new = _prefill_daemon(checkpoint, **ports)
        assert new.epoch != old_epoch and list(new.topology.endpoints) == list(reply.endpoints)
        with KVClient() as kv:
            # The new start never saw the id, and says so either way.
            with pytest.raises(RemoteError) as caught:
                kv.fetch(endpoints, "reused-id", reply.contract_fingerprint, lambda h, t: None, epoch=old_ticket)
            assert caught.value.code == Code.FAILED_PRECONDITION and "restarted" in caught.value.details
            with pytest.raises(RemoteError) as caught:
                kv.fetch(endpoints, "reused-id", reply.contract_fingerprint, lambda h, t: None)
            assert caught.value.code == Code.NOT_FOUND
            # The new start reuses the id: the old start's callers still get none of its pages.
            again, new_epoch = _prefill_with_epoch(new.endpoint, "reused-id")
            placed: list = []
            with pytest.raises(RemoteError) as caught:
                kv.fetch(endpoints, "reused-id", reply.contract_fingerprint, lambda h, t: placed.append(h),
                         epoch=old_ticket)
            assert caught.value.code == Code.FAILED_PRECONDITION and placed == []
            with pytest.raises(RemoteError) as caught:
                kv.release(endpoints, "reused-id", reply.contract_fingerprint, epoch=old_ticket)
            assert caught.value.code == Code.FAILED_PRECONDITION and "reused-id" in new.leases.held()
            new_ticket = access_ticket(new_epoch, again.capability)
            stats = kv.fetch(endpoints, "reused-id", again.contract_fingerprint, lambda h, t: None, epoch=new_ticket)
            assert stats.chunks > 0
            kv.release(endpoints, "reused-id", again.contract_fingerprint, epoch=new_ticket)
            assert wait_until(lambda: new.leases.held() == {})
        # The decode daemon serves on through the new start (once its channel reconnects).
        assert wait_until(lambda: status_of(lambda: tokens(stub, generate_request(PROMPT, 1))) == Code.OK)
        assert tokens(stub, generate_request(PROMPT, NEW_TOKENS)) == want
    finally:
        channel.close()
        decode.stop(grace_s=1.0)
        old.stop()
        if new is not None:
            new.stop()


def _prefill_with_epoch(endpoint: str, request_id: str) -> tuple[lanekv_pb2.PrefillReply, str | None]:
    with grpc.insecure_channel(endpoint) as channel:
        request = lanekv_pb2.PrefillRequest(token_ids=lanekv_pb2.TokenIds(ids=PROMPT), request_id=request_id)
        reply, call = lanekv_pb2_grpc.PrefillServiceStub(channel).Prefill.with_call(request, timeout=30)
    return reply, dict(call.trailing_metadata()).get(EPOCH_METADATA_KEY)
