"""``FastPath.fetch`` against one in-process rank: copies of a /dev/shm pool checked by digest.

A wrong digest is a ``DigestMismatch``; pages of a finished prefill are copied
before the announcement (and again from where the rank says when expected
elsewhere); descriptors must be announced then sealed as announced; they
follow the prefill layer by layer and come on a direct channel.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc
import pytest
import torch
from lanekv.kernels.page_digest import PageDigest
from lanekv.transfer.errors import CorruptChunk, RemoteError
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.fastpath.rankfetch import DigestMismatch, RankFetch
from lanekv.transfer.fastpath.tuning import CopyTuning, FastPathTuning
from lanekv.transfer.grpcfetch.client import KVClient, TransferError
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.descriptors import (
    SHM,
    Descriptor,
)
from lanekv.transfer.protocol.wire import frame_chunk
from lanekv.transfer.rank.progress import LayerProgress
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.service import KVTransferService
from lanekv.transfer.rank.sources import TensorPageSource

from tests.markers import requires_gpu
from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, rows_of
from tests.transfer.fastpath.rig import fetch_rank, fill

Code = grpc.StatusCode
U64 = (1 << 64) - 1





def test_fast_path_copies_a_shared_pool_and_checks_digests(rank, monkeypatch):
    source, pool, endpoint, agreement, kv = rank
    pages = [(p, (3 * p) % 8) for p in range(5)]
    for layer in range(LAYERS):
        fill(pool, [p for _, p in pages], layer)
    source.add("req", pages)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    assert shared is not None and fast.transport(endpoint) == SHM
    assert shared.data_ptr() != pool.data_ptr()  # a second mapping of the same file
    dst = torch.full((LAYERS, 2, 12 * PAGE, 2, 8), -1.0, dtype=torch.float16)
    slot = {logical: 11 - logical for logical, _ in pages}
    copied = []
    stats = fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [p for p, _ in pages], dst,
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

    monkeypatch.setattr("lanekv.transfer.fastpath.rangecopy.PageDigest", WrongDigest)
    with pytest.raises(DigestMismatch, match="digest"):
        fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, lambda ps: [0], lambda *a: None,
                   epoch=None, timeout=30)


def _early_fetch(rank, monkeypatch, pages, expect):
    """Fetch "req" (``pages``: (logical, physical), their layers not written yet) with
    ``expect``; once the fetch reads its stream, look at the destination, then write
    every layer. The destination, what it held then, the fetch's error."""
    source, pool, endpoint, agreement, kv = rank
    progress = LayerProgress(LAYERS)
    for layer in range(LAYERS):
        fill(pool, [p for _, p in pages], layer)
    source.add("req", pages, progress)
    reading, receive = threading.Event(), RankFetch.receive
    monkeypatch.setattr(RankFetch, "receive", lambda *args: (reading.set(), receive(*args))[1])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.full((LAYERS, 2, len(pages) * PAGE, 2, 8), -1.0, dtype=torch.float16)
    logical = [p for p, _ in pages]  # page i goes to slot i here
    errors = []

    def fetch():
        try:
            fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, logical, dst,
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
        fill(pool, [0, 1, 2, 3], layer, seed=100 + layer)
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
    ready, receive = source.ready, RankFetch.receive
    # The rank announces once the test has written the pages; the fetch copied them before.
    monkeypatch.setattr(source, "ready", lambda *args, **kw: (written.wait(10), ready(*args, **kw))[1])
    monkeypatch.setattr(RankFetch, "receive", lambda *args: (reading.set(), receive(*args))[1])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8, dtype=torch.float16)
    errors = []

    def fetch():
        try:
            fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], dst, list, lambda *a: None,
                       epoch=None, timeout=30, expect=[0, 1, 2])
        except Exception as err:  # noqa: BLE001 - looked at below
            errors.append(err)

    fetching = threading.Thread(target=fetch)
    fetching.start()
    assert reading.wait(10)  # copied (zeros) by now
    for layer in range(LAYERS):
        fill(pool, [0, 1, 2], layer)
    written.set()
    fetching.join(30)
    assert len(errors) == 1 and isinstance(errors[0], DigestMismatch), errors


def test_an_early_copy_then_a_prefill_announced_layer_by_layer_is_copied_again(rank, monkeypatch):
    source, pool, endpoint, agreement, kv = rank
    progress = LayerProgress(LAYERS)
    source.add("req", [(p, p) for p in range(3)], progress)
    asked, ready = threading.Event(), source.ready
    monkeypatch.setattr(source, "ready", lambda *args, **kw: (asked.set(), ready(*args, **kw))[1])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8, dtype=torch.float16)
    got = []
    fetching = threading.Thread(target=lambda: got.append(fetch_rank(fast,
        endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], dst, list, lambda *a: None, epoch=None,
        timeout=30, expect=[0, 1, 2])))
    fetching.start()
    assert asked.wait(10)  # the rank waits for layer 0
    for layer in range(LAYERS):  # and announces each layer as it is written
        fill(pool, [0, 1, 2], layer)
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
        fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8),
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

    def descriptors(self, rid, span, ready, exact=False, heads=None, lease=None):
        for d in messages:
            yield frame_chunk(d.encode(), memoryview(b""))

    monkeypatch.setattr(KVTransferService, "_descriptors", descriptors)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 2 * PAGE, 2, 8), dtype=torch.float16)
    with pytest.raises(CorruptChunk, match=words):
        fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0, 1], dst, lambda ps: list(ps),
                   lambda *a: None, epoch=None, timeout=30)


def test_a_range_of_the_asked_pages_in_another_order_is_copied_and_checked(rank, monkeypatch):
    """Descriptors need not list the pages in the order asked: such a range gets its own
    destination pages and digest (not the ones made ahead for the asked order)."""
    source, pool, endpoint, agreement, kv = rank
    source.add("req", [(0, 1), (1, 4)])
    for layer in range(LAYERS):
        fill(pool, [1, 4], layer)
    announced = Descriptor("req", 0, 0, 0, LAYERS, (1, 0), (4, 1), None)
    sealed = dataclasses.replace(announced, digest=source.digest([4, 1], 0, LAYERS))

    def descriptors(self, rid, span, ready, exact=False, heads=None, lease=None):
        for d in (announced, sealed):
            yield frame_chunk(d.encode(), memoryview(b""))

    monkeypatch.setattr(KVTransferService, "_descriptors", descriptors)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 4 * PAGE, 2, 8), dtype=torch.float16)
    copied = []
    fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0, 1], dst, lambda ps: [2 + p for p in ps],
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
    fetch = threading.Thread(target=fetch_rank, args=(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0, 1],
                                                       dst, lambda ps: list(ps), lambda ps, a, b: copied.append((a, b))),
                             kwargs=dict(epoch=None, timeout=30))
    fill(pool, [2, 3], 0)
    progress.layer_written(0)
    fetch.start()
    time.sleep(0.3)
    for layer in range(1, LAYERS):
        fill(pool, [2, 3], layer)
        progress.layer_written(layer)
        time.sleep(0.3)
    fetch.join(30)
    # Each descriptor covers the layers written since the one before: here one at a time.
    assert copied == [(layer, layer + 1) for layer in range(LAYERS)]
    assert torch.equal(dst[:, :, :2 * PAGE], pool[:, :, rows_of([2, 3])])


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
        fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, list, lambda *a: None,
                   epoch=None, timeout=30, on_call=lambda call: threading.Timer(0.3, call.cancel).start())
    assert time.monotonic() - t0 < 10.0
    assert asked_for == [True]
    # A stuck connection is left behind: a fetch that runs out of time gets the next one a new channel.
    before = channel(endpoint, direct=True)
    with pytest.raises(RemoteError, match="DEADLINE_EXCEEDED"):
        fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, list, lambda *a: None,
                   epoch=None, timeout=0.5)
    assert channel(endpoint, direct=True) is not before
    kv.close()
    with pytest.raises(TransferError, match="closed"):
        channel(endpoint, direct=True)


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
        # The rank serves descriptors only to a host that attached first; the copies then
        # read the source pool itself (opening its IPC handle in the same process is not asked).
        FastPath(kv, agreement).pool(endpoint, None, 10)
        fast = FastPath(kv, agreement, transports=[], copy_at_end=copy_at_end)
        dst = torch.zeros((layers, 2, 6 * PAGE, 2, 8), dtype=torch.float16, device=dst_device)
        slot = {0: 1, 1: 2, 2: 3, 3: 5}
        done = []

        def run_fetch():
            try:
                done.append(fetch_rank(fast, endpoint, 0, pool, "req", agreement.fingerprint, [0, 1, 2, 3], dst,
                                       lambda ps: [slot[p] for p in ps], lambda *a: None, epoch=None, timeout=60))
            except (RemoteError, DigestMismatch) as err:
                done.append(err)

        fetch = threading.Thread(target=run_fetch)
        fetch.start()
        for layer in range(layers):
            progress.layer_written(layer)
            time.sleep(0.01)
        fetch.join(60)
        assert done and not isinstance(done[0], Exception), done
        assert done[0].chunks >= 2  # several ranges, each digest matched
        assert torch.equal(dst[:, :, rows_of([1, 2, 3, 5])].cpu(), pool[:, :, rows_of([5, 6, 7, 1])].cpu())
    finally:
        kv.close()
        served.server.stop(None)


def test_a_fetch_tuned_off_the_direct_channel_asks_for_the_bulk_one(rank, monkeypatch):
    """The tuning is a value handed to the fetch, not a switch of the module: the
    fetch's own tuning wins over the FastPath's, and the next fetch is back to it."""
    source, _, endpoint, agreement, kv = rank
    source.add("req", [(0, 0)], LayerProgress(LAYERS))  # a prefill that never writes a layer
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    asked_for, channel = [], kv.channel
    monkeypatch.setattr(kv, "channel", lambda *a, **k: (asked_for.append(k.get("direct", False)), channel(*a, **k))[1])
    dst = torch.zeros(LAYERS, 2, PAGE, 2, 8, dtype=torch.float16)
    for tuning in (FastPathTuning(direct_descriptors=False), None):
        with pytest.raises(RemoteError, match="CANCELLED"):
            fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0], dst, list, lambda *a: None,
                       epoch=None, timeout=30, on_call=lambda call: threading.Timer(0.2, call.cancel).start(),
                       tuning=tuning)
    assert asked_for == [False, True]


@pytest.mark.parametrize("kwargs, field", [
    (dict(group_layers=0), "group_layers"), (dict(last_group_min_layers=True), "last_group_min_layers"),
    (dict(push=1), "push"), (dict(keep_gil="yes"), "keep_gil"),
])
def test_a_bad_copy_tuning_is_refused_naming_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=f"{field}="):
        CopyTuning(**kwargs)


def test_a_bad_fast_path_tuning_is_refused_naming_the_field():
    with pytest.raises(TypeError, match="prepare_in_order="):
        FastPathTuning(prepare_in_order=None)
    with pytest.raises(TypeError, match="copy="):
        FastPathTuning(copy={"push": False})
