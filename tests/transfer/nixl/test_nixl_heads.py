"""NIXL with a KV head range (a tensor-parallel GQA decode rank's heads), over UCX TCP
between host-memory pools: the rank stages the heads, the decode side reads exactly those
bytes (counted) in few descriptors per layer into a pool of those heads, verified against
the rank's digest; a flipped staged byte, or a full staging region, sends the rank to
gRPC; the staging leases are freed when the calls end. Also the staging allocator."""

from __future__ import annotations

import ctypes
import time

import grpc
import pytest
import torch
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.runtime.metrics import Registry
from lanekv.transfer.connector.base import FetchJob, TransportContext
from lanekv.transfer.connector.registry import make_fetcher
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.nixl import agent as agent_module
from lanekv.transfer.nixl.export import NixlExport
from lanekv.transfer.nixl.runs import PoolRegion, staged_pairs
from lanekv.transfer.nixl.staging import ALIGN_BYTES, StagingArena, StagingFull
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.sources import TensorPageSource

from tests.reliability.kv_cluster import (
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    make_agreement,
    rows_of,
    wait_until,
)

NEEDS_NIXL = pytest.mark.skipif(not agent_module.available(),
                                reason="NIXL is not installed (pip install 'lanekv[nixl]'; make install does)")
PHYSICAL = [6, 1, 2, 3, 9]  # the rank's pages of the request, logical 0..4
SLOTS = [4, 5, 6, 0, 2]  # where the decode pool puts them: runs [4, 7), [0], [2]


def test_staging_leases_are_first_fit_aligned_and_refused_when_full():
    arena = StagingArena(4 * ALIGN_BYTES, torch.device("cpu"))
    a, b = arena.lease(10), arena.lease(ALIGN_BYTES + 1)
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, ALIGN_BYTES, ALIGN_BYTES, 2 * ALIGN_BYTES)
    with pytest.raises(StagingFull, match=rf"{2 * ALIGN_BYTES} bytes asked, {ALIGN_BYTES} of {4 * ALIGN_BYTES} free"):
        arena.lease(2 * ALIGN_BYTES)
    a.release()
    a.release()  # once
    c = arena.lease(ALIGN_BYTES)
    assert c.offset == 0 and arena.held_bytes == 3 * ALIGN_BYTES
    assert c.view((4, 8)).shape == (4, 8)
    with pytest.raises(ValueError, match="lease holds"):
        c.view((ALIGN_BYTES + 1,))
    with pytest.raises(ValueError, match="nbytes=511"):
        StagingArena(511, torch.device("cpu"))


def test_staged_pairs_are_one_block_per_layer_plane_and_run_of_destination_pages():
    local = PoolRegion(10_000, 2, 10 * PAGE, 16)  # 10 pages of 16-byte rows (one head)
    pairs = staged_pairs(500, local, SLOTS, PAGE, 1, 3)
    assert len(pairs) == 2 * 2 * 3  # layers x planes x runs
    rows = len(SLOTS) * PAGE
    # Layer 2 (the second staged), plane 1, the run of page 0 (staged 4th) going to page 0.
    assert ((((1 * 2 + 1) * rows + 3 * PAGE) * 16 + 500, 10_000 + ((2 * 2 + 1) * 10 * PAGE) * 16, PAGE * 16)
            in pairs)
    with pytest.raises(ValueError, match="outside"):
        staged_pairs(0, local, [9, 10], PAGE, 0, 1)


@pytest.fixture
def rank(monkeypatch):
    """One prefill rank (a TensorPageSource offering NIXL) holding request "req"; its export."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    agreement = make_agreement()
    gen = torch.Generator().manual_seed(3)
    pool = torch.randint(-(2**15), 2**15, (LAYERS, 2, 12 * PAGE, HEADS, DIM), generator=gen,
                         dtype=torch.int16).view(torch.bfloat16)
    source = TensorPageSource(agreement, 0, pool)
    source.add("req", list(enumerate(PHYSICAL)))
    exports = []

    def start(staging_bytes=None):
        export = NixlExport(pool, 0, "start-1", staging_bytes=staging_bytes)
        served = serve(source, epoch="start-1", nixl=export)
        source.set_topology(Topology(1, "in_seq", "page_mod_cp", (f"127.0.0.1:{served.port}",)))
        exports.append((export, served))
        return export, f"127.0.0.1:{served.port}", served

    yield agreement, pool, start
    for export, served in exports:
        served.server.stop(None)
        export.close()


def _fetch(agreement, endpoint, heads, registry=None):
    failures = None if registry is None else registry.counter("failures", "f", ("cause",))
    fetcher = make_fetcher(("nixl", "grpc"), TransportContext(KVClient(), agreement, failures))
    dst = torch.full((LAYERS, 2, 8 * PAGE, 1, DIM), -1.0, dtype=torch.bfloat16)
    job = FetchJob("req", agreement.fingerprint, "start-1", (endpoint,), {0: list(range(5))}, LAYERS, PAGE, dst,
                   lambda pages: [SLOTS[p] for p in pages], time.monotonic() + 30, heads=heads)
    try:
        return fetcher.fetch(job), dst, fetcher.transport("nixl")
    finally:
        fetcher.transport("nixl").close()


@pytest.mark.timeout(60)
@NEEDS_NIXL
@pytest.mark.parametrize("head", [0, 1])
def test_a_head_range_reads_only_those_heads_bytes_in_few_descriptors(rank, head, monkeypatch):
    agreement, pool, start = rank
    # Room for 2 of the 4 layers per call (1 / (STAGING_SHARE * 2 ranks) of the region each): two calls.
    layer_bytes = 2 * len(PHYSICAL) * PAGE * DIM * 2
    export, endpoint, _ = start(staging_bytes=4 * 2 * layer_bytes)
    reads = []
    read = agent_module.Agent.read

    def counted(self, remote, memory, pairs, *args):
        reads.append(list(pairs))
        return read(self, remote, memory, pairs, *args)

    monkeypatch.setattr(agent_module.Agent, "read", counted)
    fetched, dst, _ = _fetch(agreement, endpoint, (head, 1))
    assert fetched.paths == {0: "nixl"}
    assert torch.equal(dst[:, :, rows_of(SLOTS)].view(torch.int16),
                       pool[:, :, rows_of(PHYSICAL), head:head + 1].view(torch.int16))
    others = [s for s in range(8) if s not in SLOTS]
    assert bool((dst[:, :, rows_of(others)] == -1).all())  # nothing else written
    # Exactly this head's bytes crossed: half of each row of each page, K and V, every layer.
    assert fetched.stats.bytes == LAYERS * 2 * len(PHYSICAL) * PAGE * 1 * DIM * 2
    assert sum(n for pairs in reads for _, _, n in pairs) == fetched.stats.bytes
    # One block per layer, plane and run of destination pages (three runs), never per row.
    assert sum(len(pairs) for pairs in reads) == LAYERS * 2 * 3
    assert len(reads) == 2  # one sealed range per call: layers [0, 2), then [2, 4)
    assert wait_until(lambda: export._staging.held_bytes == 0)  # every call's lease freed once it ended


@pytest.mark.timeout(60)
@NEEDS_NIXL
def test_a_flipped_staged_byte_or_a_full_staging_region_goes_over_grpc(rank, monkeypatch):
    agreement, pool, start = rank
    export, endpoint, _ = start()
    read, flips = agent_module.Agent.read, []

    def flipping(self, remote, memory, pairs, *args):
        read(self, remote, memory, pairs, *args)
        if not flips:
            flips.append(pairs[0][1] + 3)
            ctypes.c_uint8.from_address(pairs[0][1] + 3).value ^= 0x10

    monkeypatch.setattr(agent_module.Agent, "read", flipping)
    registry = Registry()
    fetched, dst, _ = _fetch(agreement, endpoint, (1, 1), registry)
    assert flips and fetched.paths == {0: "grpc"}  # read, refused by the digest, fetched again
    assert torch.equal(dst[:, :, rows_of(SLOTS)].view(torch.int16),
                       pool[:, :, rows_of(PHYSICAL), 1:2].view(torch.int16))
    failures = registry.counter("failures", "f", ("cause",))
    assert failures.labels(cause="nixl_digest").value == 1
    monkeypatch.setattr(agent_module.Agent, "read", read)

    # A full region: FetchKV refuses RESOURCE_EXHAUSTED in one line, and the fetch takes gRPC.
    held = export.lease(export._staging.nbytes - ALIGN_BYTES)
    stub = lanekv_pb2_grpc.KVTransferStub(grpc.insecure_channel(endpoint))
    request = lanekv_pb2.FetchRequest(request_id="req", fingerprint=agreement.fingerprint, descriptors=True,
                                      nixl=True, head_start=0, head_count=1)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.FetchKV(request, timeout=10))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rank 0: NIXL staging is full" in caught.value.details() and "\n" not in caught.value.details()
    fetched, dst, _ = _fetch(agreement, endpoint, (0, 1), registry)
    assert fetched.paths == {0: "grpc"} and failures.labels(cause="nixl_staging").value == 1
    assert torch.equal(dst[:, :, rows_of(SLOTS)].view(torch.int16),
                       pool[:, :, rows_of(PHYSICAL), 0:1].view(torch.int16))
    held.release()
    assert wait_until(lambda: export._staging.held_bytes == 0)
    export.close()  # the rank stops: its agent (pool and staging registrations) released
    assert export._staging is None and export._agent is None


@pytest.mark.timeout(60)
@NEEDS_NIXL
def test_a_dead_rank_ends_a_head_range_fetch_unavailable_naming_it(rank):
    from lanekv.transfer.connector.base import KVFetchError

    agreement, _, start = rank
    export, endpoint, served = start()
    fetched, _, _ = _fetch(agreement, endpoint, (0, 1))
    assert fetched.paths == {0: "nixl"}
    failures = Registry().counter("failures", "f", ("cause",))
    fetcher = make_fetcher(("nixl", "grpc"), TransportContext(KVClient(), agreement, failures))
    dst = torch.zeros((LAYERS, 2, 8 * PAGE, 1, DIM), dtype=torch.bfloat16)
    job = FetchJob("req", agreement.fingerprint, "start-1", (endpoint,), {0: list(range(5))}, LAYERS, PAGE, dst,
                   lambda pages: [SLOTS[p] for p in pages], time.monotonic() + 20, heads=(0, 1))
    nixl = fetcher.transport("nixl")
    try:
        assert nixl.claim(job, [0])  # attached: the rank's agent is known here
        served.server.stop(None).wait()  # the rank dies (its port and its agent)
        export.close()
        with pytest.raises(KVFetchError) as caught:
            fetcher.fetch(job)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and endpoint in str(caught.value)
    finally:
        nixl.close()
