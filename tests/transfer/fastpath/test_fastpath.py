"""The same-host fast path and layer-wise streaming, piece by piece.

- ``kv_digest`` against a plain-Python sum, across block boundaries, and what
  it must notice (one changed word, two swapped pages);
- ``copy_pages`` against ``gather_pages``/``scatter_pages``;
- handles and descriptors: round trips, and hostile bytes refused with ValueError;
- ``LayerProgress``: waits until a layer is written, fails, times out;
- one in-process KVTransfer server: a FetchKV that starts before any layer is
  written gets each layer once it is, bytes equal; a failed prefill is ABORTED;
  AttachPool refuses another host, another contract and a transport it lacks;
  the fast path copies a /dev/shm pool with digests equal, and a wrong digest
  is a ``DigestMismatch``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from types import SimpleNamespace

import grpc
import msgpack
import pytest
import torch

import kernels.page_digest as page_digest_module
import transfer.protocol.descriptors as fastpath
from kernels.page_copy import gather_pages, scatter_pages
from kernels.page_digest import PageDigest, kv_digest
from proto import lanekv_pb2, lanekv_pb2_grpc
from runtime.status import Refusal
from tests.markers import GPU_CASE, requires_gpu
from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, rows_of
from transfer.connector.base import Coverage, FetchJob, Route
from transfer.connector.fastpath import FastPathTransport
from transfer.errors import CorruptChunk, RemoteError
from transfer.fastpath.client import DigestMismatch, FastPath
from transfer.fastpath.copyorder import CopyOrder
from transfer.fastpath.poolcopy import copy_pages, page_runs
from transfer.fastpath.rangecopy import copy_groups
from transfer.grpcfetch.client import KVClient, TransferError
from transfer.protocol.contract import Topology
from transfer.protocol.descriptors import (
    SHM,
    SHM_DIR,
    Descriptor,
    PoolHandle,
    host_id,
    remove_shared_pool,
    shared_cpu_pool,
)
from transfer.protocol.wire import frame_chunk
from transfer.rank.progress import LayerProgress, PrefillFailed
from transfer.rank.service import KVTransferService, serve
from transfer.rank.sources import TensorPageSource

Code = grpc.StatusCode
U64 = (1 << 64) - 1


def _python_digest(t: torch.Tensor) -> int:
    words = t.reshape(-1).view(torch.uint8).view(torch.int32).tolist()
    weight = 0x9E3779B97F4A7C15
    return sum(w * (((i * weight) & U64) | 1) for i, w in enumerate(words)) & U64


def test_kv_digest_is_the_weighted_word_sum_across_blocks(monkeypatch):
    t = torch.randint(-(2**31), 2**31 - 1, (1000,), dtype=torch.int32)
    want = _python_digest(t)
    assert kv_digest(t) == want
    monkeypatch.setattr(page_digest_module, "_DIGEST_BLOCK", 96)  # many blocks, a ragged last one
    assert kv_digest(t) == want
    assert kv_digest(t.view(torch.bfloat16)) == want  # bytes, not values


def test_kv_digest_notices_one_word_and_swapped_pages():
    pages = torch.randn(4, 2, 8, dtype=torch.float16)
    base = kv_digest(pages)
    flipped = pages.clone()
    flipped.view(torch.int16)[2, 1, 3] ^= 1
    assert kv_digest(flipped) != base
    assert kv_digest(pages[[1, 0, 2, 3]].contiguous()) != base
    with pytest.raises(ValueError, match="contiguous"):
        kv_digest(pages.transpose(0, 1))


def test_shm_room_counts_free_bytes(tmp_path):
    assert fastpath.shm_room(SHM_DIR) > 0
    assert fastpath.shm_room(tmp_path / "missing") == 0


def test_page_runs_group_consecutive_pairs():
    assert page_runs([3, 4, 5, 9, 10], [0, 1, 7, 8, 9]) == [(3, 0, 2), (5, 7, 1), (9, 8, 2)]
    assert page_runs([], []) == []
    assert page_runs((7, 8, 9, 10), [0, 1, 2, 3]) == [(7, 0, 4)]  # one run, found without a loop
    assert page_runs([7, 8, 9, 10], [0, 1, 3, 4]) == [(7, 0, 2), (9, 3, 2)]
    assert page_runs([7, 9, 8, 10], [0, 1, 2, 3]) == [(7, 0, 1), (9, 1, 1), (8, 2, 1), (10, 3, 1)]


def test_copy_groups_cut_the_last_group_in_halves():
    assert copy_groups(0, 32, 8, 2) == [(0, 8), (8, 16), (16, 24), (24, 28), (28, 30), (30, 32)]
    assert copy_groups(0, 32, 8, 8) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert copy_groups(4, 7, 8, 2) == [(4, 7)]  # three layers: no half of two
    assert copy_groups(0, 9, 8, 1) == [(0, 8), (8, 9)]
    assert copy_groups(3, 3, 8, 2) == []
    for start, end, size, last_min in [(0, 32, 8, 2), (0, 61, 7, 3), (5, 6, 1, 1), (0, 40, 32, 1)]:
        groups = copy_groups(start, end, size, last_min)
        assert [a for a, _ in groups[1:]] == [b for _, b in groups[:-1]]  # contiguous, in order
        assert groups[0][0] == start and groups[-1][1] == end
    with pytest.raises(ValueError, match="size"):
        copy_groups(0, 8, 0, 2)


@pytest.mark.parametrize("src_pages,dst_pages", [
    ([0, 1, 2], [5, 6, 7]), ([4, 1, 3], [0, 2, 6]), ([2], [2]),
    ([9, 1, 7, 3, 5, 0], [0, 2, 4, 6, 8, 10]),  # more runs than are copied one by one
])
def test_copy_pages_equals_gather_then_scatter(src_pages, dst_pages):
    src = torch.randn(3, 2, 12 * PAGE, 2, 4)
    dst = torch.zeros(3, 2, 12 * PAGE, 2, 4)
    want = dst.clone()
    buf = gather_pages(src, torch.tensor(src_pages), PAGE, 1, 3)
    scatter_pages(buf, want, torch.tensor(dst_pages), PAGE, 1, 3)
    copy_pages(src, src_pages, dst, dst_pages, PAGE, 1, 3)
    assert torch.equal(dst, want)
    with pytest.raises(ValueError, match="2 source pages but 1"):
        copy_pages(src, [0, 1], dst, [0], PAGE, 0, 1)


def test_handle_and_descriptor_round_trip():
    handle = PoolHandle(SHM, (2, 2, 8, 2, 4), "float16", path=str(SHM_DIR / "lanekv-x"))
    assert PoolHandle.decode(handle.encode()) == handle
    d = Descriptor("req", 1, 3, 0, 2, (4, 6), (1, 0), U64)
    assert Descriptor.decode(d.encode()) == d
    announced = dataclasses.replace(d, digest=None)
    assert Descriptor.decode(announced.encode()) == announced
    # A seal is the announcement's exact encoding with a digest, nothing else.
    assert announced.sealed_by(d.encode()) == d
    for other in (dataclasses.replace(d, physical=(0, 1)), dataclasses.replace(d, seq=4), announced):
        assert announced.sealed_by(other.encode()) is None
    assert announced.sealed_by(b"\xc1 not msgpack") is None


@pytest.mark.parametrize("changes,match", [
    (dict(transport="nvlink"), "transport"),
    (dict(path="/etc/passwd"), "path"),
    (dict(shape=[1, 2, 3]), "shape"),
    (dict(dtype="int4"), "dtype"),
    (dict(storage_offset=-1), "storage_offset"),
])
def test_hostile_handles_are_refused(changes, match):
    raw = dict(transport=SHM, shape=[2, 2, 8, 2, 4], dtype="float16", path=str(SHM_DIR / "lanekv-x"),
               device_uuid="", ipc=[], storage_offset=0)
    raw.update(changes)
    with pytest.raises(ValueError, match=match):
        PoolHandle.decode(msgpack.packb(raw))


@pytest.mark.parametrize("changes,match", [
    (dict(pages=[1, 2], physical=[0]), "physical"),
    (dict(layer_end=0), "layer_end"),
    (dict(digest=-1), "digest"),
    (dict(pages=[]), "pages"),
    (dict(extra=1), "unknown keys"),
])
def test_hostile_descriptors_are_refused(changes, match):
    raw = dict(request_id="r", rank=0, seq=0, layer_start=0, layer_end=1, pages=[1], physical=[0], digest=5)
    raw.update(changes)
    with pytest.raises(ValueError, match=match):
        Descriptor.decode(msgpack.packb(raw))


def test_layer_progress_waits_fails_and_times_out():
    progress = LayerProgress(3)
    with pytest.raises(TimeoutError, match="layer 0 not written"):
        progress.wait(1, 0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(progress.wait(2, 5.0)))
    waiter.start()
    progress.layer_written(0)
    time.sleep(0.05)
    assert got == []  # layer 1 is not written yet
    progress.layer_written(1)
    waiter.join(5)
    assert got == [(2, None)]  # two layers written, no device event on the CPU
    with pytest.raises(ValueError, match="in order"):
        progress.layer_written(0)
    with pytest.raises(PrefillFailed, match="released"):
        progress.wait(3, 5.0, alive=lambda: False)
    progress.fail("rank 1: boom")
    with pytest.raises(PrefillFailed, match="boom"):
        progress.wait(3, 5.0)
    assert progress.wait(2, 0.0) == (2, None)  # written layers stay readable


# -- one in-process server ------------------------------------------------------------


@pytest.fixture
def rank():
    """A rank-0 server of a cp=1 layout whose pool lives in /dev/shm; request "req" holds 5 pages."""
    path = SHM_DIR / f"lanekv-test-{uuid.uuid4().hex}"
    agreement = make_agreement(kv_dtype="float16")
    pool = shared_cpu_pool(path, (LAYERS, 2, 8 * PAGE, 2, 8), torch.float16, 0.0)
    source = TensorPageSource(agreement, 0, pool, shared_path=path)
    served = serve(source)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    kv = KVClient()
    try:
        yield source, pool, endpoint, agreement, kv
    finally:
        kv.close()
        served.server.stop(None)
        remove_shared_pool(path)


def _fill(pool: torch.Tensor, physical: list[int], layer: int, seed: int | None = None) -> None:
    g = torch.Generator().manual_seed(layer if seed is None else seed)
    pool[layer, :, rows_of(physical)] = torch.randn(2, len(physical) * PAGE, 2, 8, generator=g).half()


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
        _fill(pool, [p for _, p in pages], layer)
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


def test_fast_path_copies_a_shared_pool_and_checks_digests(rank, monkeypatch):
    source, pool, endpoint, agreement, kv = rank
    pages = [(p, (3 * p) % 8) for p in range(5)]
    for layer in range(LAYERS):
        _fill(pool, [p for _, p in pages], layer)
    source.add("req", pages)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    assert shared is not None and fast.transport(endpoint) == SHM
    assert shared.data_ptr() != pool.data_ptr()  # a second mapping of the same file
    dst = torch.full((LAYERS, 2, 12 * PAGE, 2, 8), -1.0, dtype=torch.float16)
    slot = {logical: 11 - logical for logical, _ in pages}
    copied = []
    stats = fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [p for p, _ in pages], dst,
                       lambda ps: [slot[p] for p in ps], lambda ps, a, b: copied.append((tuple(ps), a, b)),
                       epoch=None, timeout=30)
    # The prefill was done: one descriptor covers every layer.
    assert stats.chunks == 1 and copied == [(tuple(p for p, _ in pages), 0, LAYERS)]
    want = pool[:, :, rows_of([phys for _, phys in pages])]
    assert torch.equal(dst[:, :, rows_of([slot[p] for p, _ in pages])], want)
    # A digest that does not match what was copied is caught.
    class WrongDigest(PageDigest):  # on the decode side only: the rank digests with PageDigest too
        def total(self, first=None, last=None):
            return torch.tensor(12345)

    monkeypatch.setattr("transfer.fastpath.rangecopy.PageDigest", WrongDigest)
    with pytest.raises(DigestMismatch, match="digest"):
        fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, lambda ps: [0], lambda *a: None,
                   epoch=None, timeout=30)


def _early_fetch(rank, monkeypatch, pages, expect):
    """Fetch "req" (``pages``: (logical, physical), their layers not written yet) with
    ``expect``; once the fetch reads its stream, look at the destination, then write
    every layer. The destination, what it held then, the fetch's error."""
    source, pool, endpoint, agreement, kv = rank
    progress = LayerProgress(LAYERS)
    for layer in range(LAYERS):
        _fill(pool, [p for _, p in pages], layer)
    source.add("req", pages, progress)
    reading, receive = threading.Event(), FastPath._receive
    monkeypatch.setattr(FastPath, "_receive", lambda *args: (reading.set(), receive(*args))[1])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.full((LAYERS, 2, len(pages) * PAGE, 2, 8), -1.0, dtype=torch.float16)
    logical = [p for p, _ in pages]  # page i goes to slot i here
    errors = []

    def fetch():
        try:
            fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, logical, dst,
                       lambda ps: [logical.index(p) for p in ps], lambda *a: None, epoch=None, timeout=30,
                       expect=expect)
        except Exception as err:  # noqa: BLE001 - looked at by the test
            errors.append(err)

    fetching = threading.Thread(target=fetch)
    fetching.start()
    assert reading.wait(10)
    before = dst.clone()
    for layer in range(LAYERS):
        progress.layer_written(layer)
    fetching.join(30)
    return dst, before, errors


def test_pages_of_a_finished_prefill_are_copied_before_the_announcement(rank, monkeypatch):
    pool = rank[1]
    pages = [(p, 7 - p) for p in range(4)]
    dst, before, errors = _early_fetch(rank, monkeypatch, pages, [7 - p for p, _ in pages])
    want = pool[:, :, rows_of([phys for _, phys in pages])]
    assert errors == []
    assert torch.equal(before, want), "not copied until the rank announced the layers"
    assert torch.equal(dst, want)


def test_pages_expected_elsewhere_are_copied_again_from_where_the_rank_says(rank, monkeypatch, caplog):
    pool = rank[1]
    pages = [(p, 7 - p) for p in range(4)]
    for layer in range(LAYERS):  # other bytes where the caller wrongly expects the pages
        _fill(pool, [0, 1, 2, 3], layer, seed=100 + layer)
    with caplog.at_level(logging.INFO, logger="lanekv.transfer"):
        dst, before, errors = _early_fetch(rank, monkeypatch, pages, [p for p, _ in pages])
    assert errors == []  # the ranges copied again are checked on their own
    assert torch.equal(before, pool[:, :, rows_of([0, 1, 2, 3])])  # the early copy took the wrong places
    assert torch.equal(dst, pool[:, :, rows_of([phys for _, phys in pages])])
    assert any("copying again" in r.getMessage() for r in caplog.records)


def test_an_early_copy_of_pages_not_yet_written_fails_the_digest(rank, monkeypatch):
    source, pool, endpoint, agreement, kv = rank
    source.add("req", [(p, p) for p in range(3)])  # the caller says "written" too soon
    written, reading = threading.Event(), threading.Event()
    ready, receive = source.ready, FastPath._receive
    # The rank announces once the test has written the pages; the fetch copied them before.
    monkeypatch.setattr(source, "ready", lambda *args: (written.wait(10), ready(*args))[1])
    monkeypatch.setattr(FastPath, "_receive", lambda *args: (reading.set(), receive(*args))[1])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8, dtype=torch.float16)
    errors = []

    def fetch():
        try:
            fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], dst, list, lambda *a: None,
                       epoch=None, timeout=30, expect=[0, 1, 2])
        except Exception as err:  # noqa: BLE001 - looked at below
            errors.append(err)

    fetching = threading.Thread(target=fetch)
    fetching.start()
    assert reading.wait(10)  # copied (zeros) by now
    for layer in range(LAYERS):
        _fill(pool, [0, 1, 2], layer)
    written.set()
    fetching.join(30)
    assert len(errors) == 1 and isinstance(errors[0], DigestMismatch), errors


def test_an_early_copy_then_a_prefill_announced_layer_by_layer_is_copied_again(rank, monkeypatch):
    source, pool, endpoint, agreement, kv = rank
    progress = LayerProgress(LAYERS)
    source.add("req", [(p, p) for p in range(3)], progress)
    asked, ready = threading.Event(), source.ready
    monkeypatch.setattr(source, "ready", lambda *args: (asked.set(), ready(*args))[1])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8, dtype=torch.float16)
    got = []
    fetching = threading.Thread(target=lambda: got.append(fast.fetch(
        endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], dst, list, lambda *a: None, epoch=None,
        timeout=30, expect=[0, 1, 2])))
    fetching.start()
    assert asked.wait(10)  # the rank waits for layer 0
    for layer in range(LAYERS):  # and announces each layer as it is written
        _fill(pool, [0, 1, 2], layer)
        progress.layer_written(layer)
        time.sleep(0.1)
    fetching.join(30)
    assert len(got) == 1 and got[0].chunks > 1  # fetched without an error, in more than one range
    assert torch.equal(dst, pool[:, :, rows_of([0, 1, 2])])


@pytest.mark.parametrize("expect,words", [
    ([0, 1], "2 places for 3 pages"),
    ([0, 1, 99], "outside the shared pool"),
    ([0, 1, -1], "outside the shared pool"),
    ([0, 1, 1], "a place twice"),
])
def test_bad_expected_places_are_refused_before_any_call(rank, expect, words):
    source, _, endpoint, agreement, kv = rank
    source.add("req", [(p, p) for p in range(3)])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    calls = []
    with pytest.raises(ValueError, match=f"expect.*{words}"):
        fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8),
                   list, lambda *a: None, epoch=None, timeout=30, on_call=calls.append, expect=expect)
    assert calls == []


@pytest.mark.parametrize("sequence,words", [
    ("sealed_first", "sealed before it was announced"),
    ("other_pages", "does not seal the range announced"),
    ("no_digest", "does not seal the range announced"),
])
def test_a_range_must_be_announced_then_sealed_as_announced(rank, monkeypatch, sequence, words):
    source, pool, endpoint, agreement, kv = rank
    pages = [(0, 1), (1, 4)]
    source.add("req", pages)
    announced = Descriptor("req", 0, 0, 0, LAYERS, (0, 1), (1, 4), None)
    sealed = dataclasses.replace(announced, digest=7)
    messages = {
        "sealed_first": [sealed],
        "other_pages": [announced, dataclasses.replace(sealed, physical=(4, 1))],
        "no_digest": [announced, announced],
    }[sequence]

    def descriptors(self, rid, span, ready):
        for d in messages:
            yield frame_chunk(d.encode(), memoryview(b""))

    monkeypatch.setattr(KVTransferService, "_descriptors", descriptors)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 2 * PAGE, 2, 8), dtype=torch.float16)
    with pytest.raises(CorruptChunk, match=words):
        fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0, 1], dst, lambda ps: list(ps),
                   lambda *a: None, epoch=None, timeout=30)


def test_a_range_of_the_asked_pages_in_another_order_is_copied_and_checked(rank, monkeypatch):
    """Descriptors need not list the pages in the order asked: such a range gets its own
    destination pages and digest (not the ones made ahead for the asked order)."""
    source, pool, endpoint, agreement, kv = rank
    source.add("req", [(0, 1), (1, 4)])
    for layer in range(LAYERS):
        _fill(pool, [1, 4], layer)
    announced = Descriptor("req", 0, 0, 0, LAYERS, (1, 0), (4, 1), None)
    sealed = dataclasses.replace(announced, digest=source.digest([4, 1], 0, LAYERS))

    def descriptors(self, rid, span, ready):
        for d in (announced, sealed):
            yield frame_chunk(d.encode(), memoryview(b""))

    monkeypatch.setattr(KVTransferService, "_descriptors", descriptors)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 4 * PAGE, 2, 8), dtype=torch.float16)
    copied = []
    fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0, 1], dst, lambda ps: [2 + p for p in ps],
               lambda ps, a, b: copied.append((tuple(ps), a, b)), epoch=None, timeout=30)
    assert copied == [((1, 0), 0, LAYERS)]
    assert torch.equal(dst[:, :, rows_of([2, 3])], pool[:, :, rows_of([1, 4])])


def test_descriptors_follow_the_prefill_layer_by_layer(rank):
    source, pool, endpoint, agreement, kv = rank
    pages = [(0, 2), (1, 3)]
    progress = LayerProgress(LAYERS)
    source.add("req", pages, progress)
    fast = FastPath(kv, agreement, transports=[SHM], copy_at_end=False)
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 4 * PAGE, 2, 8), dtype=torch.float16)
    copied = []
    fetch = threading.Thread(target=fast.fetch, args=(endpoint, 0, shared, "req", agreement.fingerprint, [0, 1],
                                                       dst, lambda ps: list(ps), lambda ps, a, b: copied.append((a, b))),
                             kwargs=dict(epoch=None, timeout=30))
    _fill(pool, [2, 3], 0)
    progress.layer_written(0)
    fetch.start()
    time.sleep(0.3)
    for layer in range(1, LAYERS):
        _fill(pool, [2, 3], layer)
        progress.layer_written(layer)
        time.sleep(0.3)
    fetch.join(30)
    # Each descriptor covers the layers written since the one before: here one at a time.
    assert copied == [(layer, layer + 1) for layer in range(LAYERS)]
    assert torch.equal(dst[:, :, :2 * PAGE], pool[:, :, rows_of([2, 3])])


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
    monkeypatch.setattr("transfer.fastpath.client.host_id", lambda: "elsewhere/0")
    fast = FastPath(kv, agreement, transports=[SHM])
    assert fast.pool(endpoint, None, 10) is None and fast.transport(endpoint) == "grpc"


@requires_gpu
@pytest.mark.parametrize("copy_at_end", [True, False])
def test_many_ranges_copied_between_gpus_match_their_digests(copy_at_end):
    """32 layers written one at a time on a GPU: as many announced ranges, copied at the end
    (all at once) or as they come, each in groups, into a pool on the last GPU."""
    layers = 32
    agreement = make_agreement(kv_dtype="float16", num_layers=layers)
    src_device = torch.device("cuda", 0)
    dst_device = torch.device("cuda", torch.cuda.device_count() - 1)
    pool = torch.randn((layers, 2, 8 * PAGE, 2, 8), device=src_device).half()
    source = TensorPageSource(agreement, 0, pool)
    served = serve(source)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    progress = LayerProgress(layers, src_device)
    source.add("req", [(0, 5), (1, 6), (2, 7), (3, 1)], progress)
    kv = KVClient()
    try:
        fast = FastPath(kv, agreement, transports=[], copy_at_end=copy_at_end)
        dst = torch.zeros((layers, 2, 6 * PAGE, 2, 8), dtype=torch.float16, device=dst_device)
        slot = {0: 1, 1: 2, 2: 3, 3: 5}
        done = []
        fetch = threading.Thread(target=lambda: done.append(fast.fetch(
            endpoint, 0, pool, "req", agreement.fingerprint, [0, 1, 2, 3], dst, lambda ps: [slot[p] for p in ps],
            lambda *a: None, epoch=None, timeout=60)))
        fetch.start()
        for layer in range(layers):
            progress.layer_written(layer)
            time.sleep(0.01)
        fetch.join(60)
        assert done and done[0].chunks >= 2  # several ranges, each digest matched
        assert torch.equal(dst[:, :, rows_of([1, 2, 3, 5])].cpu(), pool[:, :, rows_of([5, 6, 7, 1])].cpu())
    finally:
        kv.close()
        served.server.stop(None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=GPU_CASE)])
def test_digests_taken_as_layers_are_written_seal_any_range(monkeypatch, device):
    """A large request's layers are digested as they are written; a range's digest is then
    their sum, equal to digesting it afresh (each layer at its place among all layers)."""
    from kernels.page_digest import page_digest

    agreement = make_agreement(kv_dtype="float16")
    num_pages = TensorPageSource.DIGEST_AT_WRITE_MIN_PAGES + 4
    pool = torch.randn(LAYERS, 2, (num_pages + 3) * PAGE, 2, 8, device=device).half()
    source = TensorPageSource(agreement, 0, pool)
    physical = [(7 * i) % (num_pages + 3) for i in range(num_pages)]
    source.add("big", list(enumerate(physical)), LayerProgress(LAYERS, device))
    source.add("small", [(0, 1), (1, 2)], LayerProgress(LAYERS, device))
    for layer in range(LAYERS):
        source.digest_written(["big", "small", "unknown"], layer)
    index = torch.tensor(physical, device=device)

    def fresh(first, last, pages=index):
        return int(page_digest(pool, pages, PAGE, first, last, first_layer=0).item()) & U64

    ranges = [(0, LAYERS), (1, LAYERS - 1), (2, 3)]
    monkeypatch.setattr("transfer.rank.sources.page_digest", lambda *a, **k: pytest.fail("digested afresh"))
    got = [source.digest(physical, a, b, request_id="big") for a, b in ranges]
    monkeypatch.undo()
    assert got == [fresh(a, b) for a, b in ranges]
    # Other pages, another order, or a request digested at fetch time: afresh, the same digest.
    assert source.digest(physical[::-1], 0, 2, request_id="big") == fresh(0, 2, index.flip(0))
    assert source.digest([1, 2], 0, LAYERS, request_id="small") == fresh(0, LAYERS, index.new_tensor([1, 2]))
    # A layer out of order only ends the digests taken as written: fetches digest afresh.
    source.digest_written(["big"], 1)
    assert source.written_digest(physical, 0, 2, None, "big") is None
    assert source.digest(physical, 0, 2, request_id="big") == fresh(0, 2)
    source.release("big")
    assert "big" not in source._written


def _waits_for(wait, release, why: str) -> None:
    """``wait()`` (in a thread) does not return before ``release()``, and does after it."""
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: (wait(), returned.set()))
    waiter.start()
    assert not returned.wait(0.2), why
    release()
    assert returned.wait(5.0)
    waiter.join()


def test_copy_order_puts_ranks_with_pools_on_other_devices_first():
    here, away = torch.zeros(1), torch.zeros(1, device="meta")
    order = CopyOrder.for_pools({0: here, 1: away}, here.device)
    order.turn(1, 0.0)  # goes first: no wait
    _waits_for(lambda: order.turn(0, 10.0), lambda: order.done(1), "rank 0 queued its copies before rank 1 did")
    for pools in ({0: here, 1: here}, {0: away, 1: away}):  # all alike: nobody waits
        t0 = time.monotonic()
        CopyOrder.for_pools(pools, here.device).turn(0, 10.0)
        assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    CopyOrder([1]).turn(0, 0.2)  # a first rank that never queues: the wait ends at the timeout
    assert 0.15 < time.monotonic() - t0 < 5.0
    # Nobody waits for its copies before every rank has queued its own.
    order = CopyOrder.for_pools({0: here, 1: away, 2: here}, here.device)
    order.done(1)
    order.done(0)
    _waits_for(lambda: order.all_queued(10.0), lambda: order.done(2),
               "rank 0 waited for its copies before rank 2 queued its own")


def test_ranks_that_go_first_prepare_first():
    order = CopyOrder([1], [0, 1, 2])
    order.may_prepare(1, 0.0)  # goes first: no wait
    _waits_for(lambda: order.may_prepare(0, 10.0), lambda: order.prepared(1), "rank 0 prepared before rank 1 had")
    order = CopyOrder([1], [0, 1])
    order.done(1)  # a first rank that ended before preparing lets the others go on
    t0 = time.monotonic()
    order.may_prepare(0, 10.0)
    assert time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    CopyOrder([1]).may_prepare(0, 0.2)  # a first rank that never prepares: the wait ends at the timeout
    assert 0.15 < time.monotonic() - t0 < 5.0


def test_descriptors_come_on_a_direct_channel_that_a_cancel_ends(rank, monkeypatch):
    source, _, endpoint, agreement, kv = rank
    assert kv.channel(endpoint, direct=True) is kv.channel(endpoint, direct=True)
    assert kv.channel(endpoint, direct=True) is not kv.channel(endpoint)
    progress = LayerProgress(LAYERS)  # a prefill that never writes a layer
    source.add("req", [(0, 0)], progress)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    asked_for, channel = [], kv.channel
    monkeypatch.setattr(kv, "channel", lambda *a, **k: (asked_for.append(k.get("direct", False)), channel(*a, **k))[1])
    dst = torch.zeros(LAYERS, 2, PAGE, 2, 8, dtype=torch.float16)
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="CANCELLED"):  # cancelled from another thread, as the fast-path transport's stop does
        fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, list, lambda *a: None,
                   epoch=None, timeout=30, on_call=lambda call: threading.Timer(0.3, call.cancel).start())
    assert time.monotonic() - t0 < 10.0
    assert asked_for == [True]
    # A stuck connection is left behind: a fetch that runs out of time gets the next one a new channel.
    before = channel(endpoint, direct=True)
    with pytest.raises(RemoteError, match="DEADLINE_EXCEEDED"):
        fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, list, lambda *a: None,
                   epoch=None, timeout=0.5)
    assert channel(endpoint, direct=True) is not before
    kv.close()
    with pytest.raises(TransferError, match="closed"):
        channel(endpoint, direct=True)


def test_a_rank_waits_for_its_turn_and_a_failed_fetch_gives_its_turn_away(rank):
    source, pool, endpoint, agreement, kv = rank
    pages = [(p, p) for p in range(3)]
    for layer in range(LAYERS):
        _fill(pool, [p for _, p in pages], layer)
    source.add("req", pages)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8, dtype=torch.float16)
    order = CopyOrder([1])  # rank 1 (another device) goes first
    copied = []

    def fetch():
        fast.fetch(endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], dst, list,
                   lambda *a: copied.append(time.monotonic()), epoch=None, timeout=30, order=order)

    waiter = threading.Thread(target=fetch)
    waiter.start()
    time.sleep(0.3)
    assert copied == [], "copied before the rank that goes first queued its copies"
    with pytest.raises(RemoteError, match="NOT_FOUND"):  # rank 1's fetch fails: its turn passes on
        fast.fetch(endpoint, 1, shared, "no-such-request", agreement.fingerprint, [0], dst, list,
                   lambda *a: None, epoch=None, timeout=30, order=order)
    waiter.join(10)
    assert len(copied) == 1
    assert torch.equal(dst, pool[:, :, rows_of([0, 1, 2])])


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
    _fill(pool, [0, 1, 2, 3], 0)
    progress.layer_written(0)
    time.sleep(0.2)
    source.release("a")  # its client went away mid-prefill
    threads[0].join(5)
    assert isinstance(outcome.get("a"), RemoteError), outcome  # a's stream ends at once
    for layer in range(1, LAYERS):
        _fill(pool, [0, 1, 2, 3], layer)
        progress.layer_written(layer)
    threads[1].join(30)
    assert not isinstance(outcome.get("b"), Exception), outcome["b"]
    assert torch.equal(dest, pool[:, :, rows_of([2, 3])])


# -- the decode daemon's fetches of several ranks (transfer.connector.fastpath) --------------


class _Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def _fast_fetches(fetch, pools, *, physical_of=None):
    """The fast-path transport's fetch of one job over a stand-in FastPath whose ``fetch`` is ``fetch``."""
    job = FetchJob("req", "f" * 64, None, ("127.0.0.1:1",) * len(pools), {r: [r] for r in pools}, 1, 1,
                   torch.zeros(1), list, time.monotonic() + 30, physical_of=physical_of)
    routes = {rank: Route(SHM, pool) for rank, pool in pools.items()}
    return FastPathTransport(SimpleNamespace(fetch=fetch)).start(job, routes, Coverage(job.pages, 1))


def test_stopped_fast_fetches_cancel_late_calls_and_wait_for_their_threads():
    ended = []

    def fetch(endpoint, rank, *args, on_call, **kw):
        if rank == 1:
            time.sleep(0.3)  # calls after stop()
        call = _Call()
        on_call(call)
        call.cancelled.wait(10)
        time.sleep(0.2)  # its copies settle
        ended.append(rank)
        raise RemoteError(rank, endpoint, grpc.StatusCode.CANCELLED, "cancelled")

    fast = _fast_fetches(fetch, {0: torch.zeros(1), 1: torch.zeros(1)})
    time.sleep(0.1)
    t0 = time.monotonic()
    fast.stop(wait_s=5.0)
    assert sorted(ended) == [0, 1], "stop() returned while a rank's fetch still ran"
    assert time.monotonic() - t0 < 4.0  # rank 1's late call was cancelled as it was made


def test_a_rank_that_fails_before_its_fetch_gives_its_turn_away():
    waited = {}

    def fetch(endpoint, rank, *args, order, **kw):
        t0 = time.monotonic()
        order.may_prepare(rank, 5.0)
        waited[rank] = time.monotonic() - t0
        return SimpleNamespace(bytes=0, chunks=0, seconds=0.0)

    def physical_of(page):
        if page == 1:
            raise ValueError("page 1: no place")
        return page

    # Rank 1's pool is on another device: it goes first, and fails before its fetch.
    fast = _fast_fetches(fetch, {0: torch.zeros(1), 1: torch.zeros(1, device="meta")}, physical_of=physical_of)
    with pytest.raises(Refusal, match="no place"):
        fast.wait()
    assert waited[0] < 2.0, "rank 0 waited for a rank that had failed"
