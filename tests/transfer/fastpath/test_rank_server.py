"""One in-process KVTransfer rank server and the fast path's attach to it.

A FetchKV that starts before any layer is written gets each layer once it is,
bytes equal; a failed prefill is ABORTED; releasing one request of a batch
leaves the others streaming; AttachPool refuses another host, another
contract, another prefill start and a transport it lacks.
"""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
import torch
from lanekv.proto import lanekv_pb2, lanekv_pb2_grpc
from lanekv.transfer.errors import RemoteError
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.grpcfetch.client import KVClient
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.descriptors import (
    SHM,
    SHM_DIR,
    PoolHandle,
    host_id,
    remove_shared_pool,
    shared_cpu_pool,
)
from lanekv.transfer.rank.progress import LayerProgress
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.sources import TensorPageSource

from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, rows_of
from tests.transfer.fastpath.rig import fill

Code = grpc.StatusCode
U64 = (1 << 64) - 1




def test_fetch_started_before_the_prefill_gets_each_layer_once_written(rank):
    source, pool, endpoint, agreement, kv = rank
    pages = [(p, 7 - p) for p in range(5)]  # logical p at physical 7 - p
    progress = LayerProgress(LAYERS)
    source.add("req", pages, progress)
    arrived: list[tuple[int, float]] = []
    dest = torch.zeros(LAYERS, 2, 5 * PAGE, 2, 8, dtype=torch.float16)

    def place(header, tensor):
        arrived.append((header.layer_start, time.monotonic()))
        dest[header.layer_start:header.layer_end].index_copy_(2, rows_of(header.pages), tensor)

    fetch = threading.Thread(target=kv.fetch, args=({0: endpoint}, "req", agreement.fingerprint, place),
                             kwargs=dict(timeout=30, max_chunk_bytes=5 * 2 * PAGE * 2 * 8 * 2))  # a layer a chunk
    fetch.start()
    written = {}
    for layer in range(LAYERS):
        time.sleep(0.15)
        assert [a for a in arrived if a[0] >= layer] == [], f"layer {layer} arrived before it was written"
        fill(pool, [p for _, p in pages], layer)
        written[layer] = time.monotonic()
        progress.layer_written(layer)
    fetch.join(30)
    assert sorted(layer for layer, _ in arrived) == list(range(LAYERS))
    assert all(t >= written[layer] for layer, t in arrived)
    assert torch.equal(dest, pool[:, :, rows_of([p for _, p in pages])])


def test_fetch_of_a_prefill_that_fails_is_aborted(rank):
    source, _, endpoint, agreement, kv = rank
    progress = LayerProgress(LAYERS)
    source.add("req", [(0, 0)], progress)
    progress.layer_written(0)
    threading.Timer(0.2, progress.fail, args=("rank 0: out of memory",)).start()
    stub = lanekv_pb2_grpc.KVTransferStub(kv.channel(endpoint))
    request = lanekv_pb2.FetchRequest(request_id="req", fingerprint=agreement.fingerprint, max_chunk_bytes=1 << 20)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.FetchKV(request, timeout=30))
    assert err.value.code() == Code.ABORTED and "out of memory" in err.value.details()


def test_attach_pool_refuses_other_hosts_contracts_and_transports(rank):
    _, _, endpoint, agreement, kv = rank
    stub = lanekv_pb2_grpc.KVTransferStub(kv.channel(endpoint))
    cases = [
        (dict(host_id="elsewhere/0", transports=[SHM]), Code.FAILED_PRECONDITION, "host"),
        (dict(host_id=host_id(), transports=[SHM], fingerprint="0" * 64), Code.FAILED_PRECONDITION, "fingerprint"),
        (dict(host_id=host_id(), transports=["cuda_ipc"]), Code.FAILED_PRECONDITION, "'shm'"),
        (dict(host_id=host_id(), transports=["x"] * 9), Code.INVALID_ARGUMENT, "transports"),
    ]
    for fields, code, words in cases:
        request = lanekv_pb2.AttachRequest(**{"fingerprint": agreement.fingerprint, **fields})
        with pytest.raises(grpc.RpcError) as err:
            stub.AttachPool(request, timeout=10)
        assert err.value.code() == code and words in err.value.details(), fields
    reply = stub.AttachPool(lanekv_pb2.AttachRequest(fingerprint=agreement.fingerprint, host_id=host_id(),
                                                     transports=["cuda_ipc", SHM]), timeout=10)
    assert PoolHandle.decode(reply.handle).transport == SHM


def test_a_new_prefill_start_is_attached_again_and_an_old_one_refused():
    path = SHM_DIR / f"lanekv-test-{uuid.uuid4().hex}"
    agreement = make_agreement(kv_dtype="float16")
    pool = shared_cpu_pool(path, (LAYERS, 2, 8 * PAGE, 2, 8), torch.float16, 0.0)
    source = TensorPageSource(agreement, 0, pool, shared_path=path)
    served = serve(source, epoch="start-2")
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    try:
        with KVClient() as kv:
            fast = FastPath(kv, agreement, transports=[SHM])
            assert fast.pool(endpoint, "start-1", 10) is None  # refused: pages of another start
            assert fast.transport(endpoint) == "grpc"
            assert fast.pool(endpoint, "start-2", 10) is not None  # a new epoch asks again
            assert fast.transport(endpoint) == SHM
    finally:
        served.server.stop(None)
        remove_shared_pool(path)


def test_a_rank_on_another_host_is_read_over_grpc(rank, monkeypatch):
    _, _, endpoint, agreement, kv = rank
    monkeypatch.setattr("lanekv.transfer.fastpath.client.host_id", lambda: "elsewhere/0")
    fast = FastPath(kv, agreement, transports=[SHM])
    assert fast.pool(endpoint, None, 10) is None and fast.transport(endpoint) == "grpc"


def test_releasing_one_request_of_a_prefill_batch_leaves_the_others_streaming(rank):
    source, pool, endpoint, agreement, kv = rank
    progress = LayerProgress(LAYERS)  # one prefill batch writes both requests
    source.add("a", [(0, 0), (1, 1)], progress)
    source.add("b", [(0, 2), (1, 3)], progress)
    dest = torch.zeros(LAYERS, 2, 2 * PAGE, 2, 8, dtype=torch.float16)
    outcome: dict[str, object] = {}

    def fetch(rid, place):
        try:
            outcome[rid] = kv.fetch({0: endpoint}, rid, agreement.fingerprint, place, timeout=30)
        except Exception as err:  # noqa: BLE001 - checked below
            outcome[rid] = err

    def place_b(header, tensor):
        dest[header.layer_start:header.layer_end].index_copy_(2, rows_of(header.pages), tensor)

    threads = [threading.Thread(target=fetch, args=("a", lambda h, t: None)),
               threading.Thread(target=fetch, args=("b", place_b))]
    for thread in threads:
        thread.start()
    fill(pool, [0, 1, 2, 3], 0)
    progress.layer_written(0)
    time.sleep(0.2)
    source.release("a")  # its client went away mid-prefill
    threads[0].join(5)
    assert isinstance(outcome.get("a"), RemoteError), outcome  # a's stream ends at once
    for layer in range(1, LAYERS):
        fill(pool, [0, 1, 2, 3], layer)
        progress.layer_written(layer)
    threads[1].join(30)
    assert not isinstance(outcome.get("b"), Exception), outcome["b"]
    assert torch.equal(dest, pool[:, :, rows_of([2, 3])])
