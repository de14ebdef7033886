"""KVTransfer over real gRPC servers on loopback: handshake refusals, fetch, errors, release."""


import threading

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.grpcfetch import client as client_module
from lanekv.transfer.grpcfetch.client import (
    ChecksumError,
    ContractMismatch,
    KVClient,
    RemoteError,
    fetch_kv,
    handshake,
    release,
)
from lanekv.transfer.protocol.wire import WIRE_VERSION
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.service import KVTransferService
from lanekv.transfer.rank.sources import TensorPageSource

from tests.reliability.kv_cluster import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    PAGE_LAYER_BYTES,
    Servers,
    make_agreement,
    rows_of,
    same_bits,
    start_servers,
)

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:The given buffer is not writable"),
]

TIMEOUT = 20.0


@pytest.fixture
def start_cluster():
    """``start(cp_size, num_pages)``: one KVTransfer server per owner rank holding
    request "req" (owner-lane placement), stopped at teardown."""
    started = []

    def start(cp_size: int, num_pages: int = 11) -> Servers:
        started.append(start_servers(cp_size, num_pages))
        return started[-1]

    yield start
    for servers in started:
        servers.stop()


@pytest.fixture
def raw_stub():
    """Generated KVTransfer stubs on channels closed at teardown."""
    channels = []

    def make(endpoint: str) -> lanekv_pb2_grpc.KVTransferStub:
        channels.append(grpc.insecure_channel(endpoint))
        return lanekv_pb2_grpc.KVTransferStub(channels[-1])

    yield make
    for channel in channels:
        channel.close()


def placer(dest: torch.Tensor, log: list | None = None):
    def place(header, tensor):
        if log is not None:
            log.append(header)
        dest[header.layer_start : header.layer_end].index_copy_(
            2, rows_of(list(header.pages)), tensor
        )

    return place


def test_handshake_returns_fingerprint_and_topology(start_cluster):
    cluster = start_cluster(2)
    assert (
        handshake(cluster.endpoints[1], make_agreement(), TIMEOUT) == make_agreement().fingerprint
    )
    with KVClient() as kv:
        contract = kv.handshake(cluster.endpoints[0], make_agreement(), TIMEOUT)
    assert contract.topology.endpoints == (cluster.endpoints[0], cluster.endpoints[1])
    channel = grpc.insecure_channel(cluster.endpoints[0])
    reply = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="lanekv.v1.KVTransfer"), timeout=TIMEOUT
    )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    channel.close()


MISMATCHES = {
    "page_size": 8,
    "kv_dtype": "float16",
    "num_layers": LAYERS + 1,
    "num_kv_heads": HEADS * 2,
    "head_dim": DIM * 2,
    "weights_digest": "x" * 64,
    "rope": {"theta": 500000.0},
    "wire_version": WIRE_VERSION + 1,
    "source_digest": "t" * 64,
}


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_handshake_refuses_each_mismatched_field(start_cluster, raw_stub, field):
    cluster = start_cluster(1)
    theirs = make_agreement(**{field: MISMATCHES[field]})
    with pytest.raises(ContractMismatch) as caught:
        handshake(cluster.endpoints[0], theirs, TIMEOUT)
    assert [d.name.split(".")[0] for d in caught.value.diffs] == [field]
    assert field in str(caught.value)
    # The raw status: FAILED_PRECONDITION, with the field and both values in the message.
    stub = raw_stub(cluster.endpoints[0])
    with pytest.raises(grpc.RpcError) as raw:
        stub.Handshake(lanekv_pb2.HandshakeRequest(contract=theirs.encode()), timeout=TIMEOUT)
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    diff = caught.value.diffs[0]
    assert f"server={diff.theirs!r}" in raw.value.details()
    assert f"caller={diff.ours!r}" in raw.value.details()


def test_handshake_lists_every_differing_field(start_cluster):
    cluster = start_cluster(1)
    theirs = make_agreement(page_size=16, head_dim=32, weights_digest="z")
    with pytest.raises(ContractMismatch) as caught:
        handshake(cluster.endpoints[0], theirs, TIMEOUT)
    assert [d.name for d in caught.value.diffs] == ["head_dim", "page_size", "weights_digest"]
    assert "3 field(s)" in str(caught.value)


def test_stale_fingerprint_gets_no_chunk(start_cluster, raw_stub):
    cluster = start_cluster(1)
    stale = make_agreement(page_size=8).fingerprint
    stub = raw_stub(cluster.endpoints[0])
    received = []
    with pytest.raises(grpc.RpcError) as raw:
        for chunk in stub.FetchKV(
            lanekv_pb2.FetchRequest(request_id="req", fingerprint=stale), timeout=TIMEOUT
        ):
            received.append(chunk)
    assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION and received == []
    placed = []
    with pytest.raises(RemoteError) as caught:
        fetch_kv(cluster.endpoints, "req", stale, lambda h, t: placed.append(h), timeout=TIMEOUT)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION and placed == []
    with pytest.raises(RemoteError) as caught:
        release(cluster.endpoints, "req", stale, TIMEOUT)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION


# (2, 3, 13): pages split within layers; (3, 64, 13): layers grouped; (2, 4, 1): rank 1 holds nothing.
@pytest.mark.parametrize("cp_size, chunk_pages, num_pages", [(2, 3, 13), (3, 64, 13), (2, 4, 1)])
def test_fetch_from_owner_ranks_is_bit_exact(
    start_cluster, monkeypatch, cp_size, chunk_pages, num_pages
):
    cluster = start_cluster(cp_size, num_pages=num_pages)
    fingerprint = handshake(cluster.endpoints[0], make_agreement(), TIMEOUT)
    held = []

    class Budget(client_module.ByteBudget):
        def acquire(self, nbytes):
            ok = super().acquire(nbytes)
            held.append(self._used)
            return ok

    monkeypatch.setattr(client_module, "ByteBudget", Budget)
    dest = torch.full_like(cluster.full, float("nan"))
    log = []
    max_chunk = chunk_pages * PAGE_LAYER_BYTES
    stats = fetch_kv(
        cluster.endpoints, "req", fingerprint, placer(dest, log),
        max_chunk_bytes=max_chunk, max_inflight_bytes=2 * max_chunk, timeout=TIMEOUT,
    )  # fmt: skip
    assert same_bits(dest, cluster.full)
    assert stats.bytes == cluster.full.numel() * 2 and stats.chunks == len(log)
    assert sorted(stats.per_rank) == list(range(cp_size))
    assert {h.rank for h in log} == {p % cp_size for p in range(num_pages)}
    assert all(h.nbytes <= max_chunk for h in log)
    assert all(p % cp_size == h.rank for h in log for p in h.pages)
    assert max(held) <= 2 * max_chunk


def test_fetch_page_and_layer_subset(start_cluster):
    cluster = start_cluster(2)
    fingerprint = make_agreement().fingerprint
    dest = torch.zeros_like(cluster.full)
    with KVClient() as kv:
        kv.fetch(
            cluster.endpoints, "req", fingerprint, placer(dest),
            layer_start=1, layer_end=3, pages={0: [4, 0], 1: [7]}, timeout=TIMEOUT,
        )  # fmt: skip
    rows = rows_of([0, 4, 7])
    assert same_bits(dest[1:3, :, rows], cluster.full[1:3, :, rows])
    dest[1:3, :, rows] = 0
    assert not dest.view(torch.int16).any()


def expect_code(endpoints, code, text="", **fetch_args):
    fingerprint = fetch_args.pop("fingerprint", make_agreement().fingerprint)
    request_id = fetch_args.pop("request_id", "req")
    with pytest.raises(RemoteError) as caught:
        fetch_kv(
            endpoints, request_id, fingerprint, lambda h, t: None, timeout=TIMEOUT, **fetch_args
        )
    assert caught.value.code == code, caught.value
    assert text in caught.value.details


def test_bad_requests_are_refused_and_the_server_keeps_serving(start_cluster, raw_stub):
    cluster = start_cluster(1)
    endpoints = cluster.endpoints
    expect_code(endpoints, grpc.StatusCode.NOT_FOUND, "unknown", request_id="nope")
    with KVClient() as kv:
        for start, end in [(0, LAYERS + 1), (2, 2), (3, 1)]:
            with pytest.raises(RemoteError) as caught:
                kv.fetch(
                    endpoints,
                    "req",
                    make_agreement().fingerprint,
                    lambda h, t: None,
                    layer_start=start,
                    layer_end=end,
                )
            assert (
                caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
                and "layer range" in caught.value.details
            )
        with pytest.raises(RemoteError) as caught:
            kv.fetch(
                endpoints, "req", make_agreement().fingerprint, lambda h, t: None, pages={0: [99]}
            )
        assert (
            caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "99" in caught.value.details
        )
    expect_code(endpoints, grpc.StatusCode.INVALID_ARGUMENT, "max_chunk_bytes", max_chunk_bytes=7)
    stub = raw_stub(endpoints[0])
    with pytest.raises(grpc.RpcError) as raw:
        stub.Handshake(lanekv_pb2.HandshakeRequest(contract=b"\xc1garbage"), timeout=TIMEOUT)
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    dest = torch.zeros_like(cluster.full)
    fetch_kv(endpoints, "req", make_agreement().fingerprint, placer(dest), timeout=TIMEOUT)
    assert same_bits(dest, cluster.full)


def test_corrupted_chunk_is_never_placed(start_cluster, monkeypatch):
    cluster = start_cluster(1)
    frame = KVTransferService.frame

    def corrupt(self, header, data):
        if header.seq == 1:
            data = bytes([data[0] ^ 0x01]) + data[1:]
        return frame(self, header, data)

    monkeypatch.setattr(KVTransferService, "frame", corrupt)
    dest = torch.zeros_like(cluster.full)
    log = []
    with pytest.raises(ChecksumError) as caught:
        fetch_kv(
            cluster.endpoints, "req", make_agreement().fingerprint, placer(dest, log),
            max_chunk_bytes=2 * PAGE_LAYER_BYTES, timeout=TIMEOUT,
        )  # fmt: skip
    assert (caught.value.request_id, caught.value.rank, caught.value.seq) == ("req", 0, 1)
    assert "req" in str(caught.value) and "rank 0" in str(caught.value)
    assert [h.seq for h in log] == [0]


def test_release_frees_pages(start_cluster):
    cluster = start_cluster(2, num_pages=9)
    fingerprint = make_agreement().fingerprint
    assert release(cluster.endpoints, "req", fingerprint, TIMEOUT) == 9
    expect_code(cluster.endpoints, grpc.StatusCode.NOT_FOUND, "released")
    with pytest.raises(RemoteError) as caught:
        release(cluster.endpoints, "req", fingerprint, TIMEOUT)
    assert caught.value.code == grpc.StatusCode.NOT_FOUND
    cluster.sources[0].add("req", [(0, 0)])  # the id can be reused once released
    assert release({0: cluster.endpoints[0]}, "req", fingerprint, TIMEOUT) == 1


def test_release_during_fetch_stops_the_stream(start_cluster):
    cluster = start_cluster(1)
    source = cluster.sources[0]
    read = source.read

    def read_then_release(physical_pages, layer_start, layer_end, after=None):
        out = read(physical_pages, layer_start, layer_end, after)
        if layer_start == 1:  # the pages are freed (and may be reused) under this read
            source.release("req")
        return out

    source.read = read_then_release
    log = []
    dest = torch.zeros_like(cluster.full)
    with pytest.raises(RemoteError) as caught:
        fetch_kv(
            cluster.endpoints, "req", make_agreement().fingerprint, placer(dest, log),
            max_chunk_bytes=11 * PAGE_LAYER_BYTES, timeout=TIMEOUT,
        )  # fmt: skip
    assert caught.value.code == grpc.StatusCode.NOT_FOUND and "released" in caught.value.details
    # Chunks are built a few ahead: the release may land before chunk 0's own
    # ownership check, so chunk 0 may be refused too; nothing read after the
    # release is ever placed.
    assert [h.layer_start for h in log] in ([], [0])


def test_handshake_before_topology_is_unavailable():
    source = TensorPageSource(
        make_agreement(), 0, torch.zeros((LAYERS, 2, PAGE, HEADS, DIM), dtype=torch.bfloat16)
    )
    served = serve(source)
    try:
        with pytest.raises(RemoteError) as caught:
            handshake(f"127.0.0.1:{served.port}", make_agreement(), TIMEOUT)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        served.server.stop(None)


def test_chunks_of_two_ranks_are_placed_at_once_and_a_failed_placement_ends_the_fetch(start_cluster):
    cluster = start_cluster(2)
    fingerprint = make_agreement().fingerprint
    dest = torch.full_like(cluster.full, float("nan"))
    both_inside = threading.Barrier(2, timeout=10)
    inside_together = []
    place = placer(dest)

    def slow_place(header, tensor):
        if header.seq == 0:  # the first chunk of each rank waits for the other rank's first chunk
            both_inside.wait()
            inside_together.append(header.rank)
        place(header, tensor)

    fetch_kv(cluster.endpoints, "req", fingerprint, slow_place, timeout=TIMEOUT)
    assert sorted(inside_together) == [0, 1] and same_bits(dest, cluster.full)

    class Boom(Exception):
        pass

    def failing_place(header, tensor):
        if header.rank == 1:
            raise Boom(f"rank {header.rank} chunk {header.seq}")
        place(header, tensor)

    with pytest.raises(Boom, match="rank 1"):
        fetch_kv(cluster.endpoints, "req", fingerprint, failing_place, timeout=TIMEOUT)


@pytest.mark.parametrize("head", range(HEADS))
def test_fetch_of_a_head_range_sends_and_checksums_only_those_heads(start_cluster, head):
    """A tensor-parallel decode rank's fetch: each chunk holds one KV head of every row,
    its checksum over exactly those bytes (StreamCheck verifies it), nothing else sent."""
    cluster = start_cluster(2, num_pages=5)
    fingerprint = make_agreement().fingerprint
    dest = torch.full_like(cluster.full[:, :, :, head:head + 1], float("nan"))
    log = []
    with KVClient() as kv:
        stats = kv.fetch(cluster.endpoints, "req", fingerprint, placer(dest, log), timeout=TIMEOUT,
                         heads=(head, 1))
    assert same_bits(dest, cluster.full[:, :, :, head:head + 1])
    assert all(h.kv_heads == 1 for h in log)
    assert stats.bytes == cluster.full.numel() * 2 // HEADS


@pytest.mark.parametrize("heads", [(0, 0), (1, HEADS), (HEADS, 1)])
def test_fetch_of_heads_outside_the_row_is_refused(start_cluster, heads):
    cluster = start_cluster(1)
    with pytest.raises(RemoteError) as caught, KVClient() as kv:
        kv.fetch(cluster.endpoints, "req", make_agreement().fingerprint, lambda h, t: None, timeout=TIMEOUT,
                 heads=heads)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"num_kv_heads={HEADS}" in caught.value.details
