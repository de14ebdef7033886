"""The fast path with a KV head range (a tensor-parallel decode rank's heads of each row).

The decode rank asks for descriptors with ``head_start/head_count``; it copies
only those heads' bytes of each page (a strided copy over the head dim) into a
pool that holds only them, and the rank's digest covers exactly those bytes:
a digest of whole rows, or of other heads, does not match.
"""

from __future__ import annotations

import re
import time

import grpc
import pytest
import torch
from lanekv.kernels.page_digest import PageDigest, head_slice_digest
from lanekv.proto import lanekv_pb2
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.fastpath.poolcopy import PlannedCopy
from lanekv.transfer.fastpath.rankfetch import DigestMismatch, FastRequest, RankPages
from lanekv.transfer.grpcfetch.client import FETCH_METHOD, KVClient
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.descriptors import SHM
from lanekv.transfer.rank.server import serve
from lanekv.transfer.rank.sources import TensorPageSource

from tests.markers import requires_gpu
from tests.reliability.kv_cluster import LAYERS, PAGE, make_agreement, rows_of
from tests.transfer.fastpath.rig import POOL_PAGES, fill

Code = grpc.StatusCode


def _fetch(fast, endpoint, shared, agreement, logical, dst, slot, heads, expect=None):
    copied = []
    request = FastRequest("req", agreement.fingerprint, dst, lambda ps: [slot[p] for p in ps],
                          lambda ps, a, b: copied.append((tuple(ps), a, b)), None, time.monotonic() + 30, heads)
    part = RankPages(0, endpoint, shared, tuple(logical), expect)
    return fast.fetch(request, part), copied


@pytest.mark.parametrize("heads", [(0, 1), (1, 1)])
@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("early", [False, True])
def test_a_head_range_copies_only_those_heads_and_verifies(rank, heads, scattered, early):
    source, pool, endpoint, agreement, kv = rank
    # Scattered: more runs of consecutive pages than a copy moves run by run (gathered, then scattered).
    physical = [7, 0, 5, 2, 6, 3] if scattered else [2, 3, 4]
    pages = list(enumerate(physical))
    for layer in range(LAYERS):
        fill(pool, physical, layer, seed=10 + layer)
    source.add("req", pages)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.full((LAYERS, 2, 10 * PAGE, 1, 8), -1.0, dtype=torch.float16)
    slot = {p: ([9, 1, 7, 3, 5, 0][p] if scattered else 1 + p) for p, _ in pages}
    logical = [p for p, _ in pages]
    stats, copied = _fetch(fast, endpoint, shared, agreement, logical, dst, slot, heads,
                           expect=tuple(physical) if early else None)
    assert copied == [(tuple(logical), 0, LAYERS)]
    first, count = heads
    want = pool[:, :, rows_of(physical), first:first + count]
    assert torch.equal(dst[:, :, rows_of([slot[p] for p in logical])], want)
    others = [s for s in range(10) if s not in slot.values()]
    assert bool((dst[:, :, rows_of(others)] == -1).all())  # nothing else written
    # The bytes that crossed: this rank's heads only, half of each row.
    assert stats.bytes == LAYERS * 2 * len(physical) * PAGE * count * 8 * 2


def test_a_rank_digest_of_other_bytes_than_the_heads_copied_does_not_match(rank, monkeypatch):
    source, pool, endpoint, agreement, kv = rank
    for layer in range(LAYERS):
        fill(pool, [1, 2], layer)
    source.add("req", [(0, 1), (1, 2)])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 4 * PAGE, 1, 8), dtype=torch.float16)
    digest = source.digest
    for wrong in ({"heads": None}, {"heads": slice(0, 1)}):  # whole rows; the other head
        monkeypatch.setattr(source, "digest", lambda *a, _w=wrong, **kw: digest(*a, **{**kw, **_w}))
        with pytest.raises(DigestMismatch, match="digest"):
            _fetch(fast, endpoint, shared, agreement, [0, 1], dst, {0: 0, 1: 1}, (1, 1))
    monkeypatch.setattr(source, "digest", digest)
    _fetch(fast, endpoint, shared, agreement, [0, 1], dst, {0: 0, 1: 1}, (1, 1))  # and the right one does


def test_a_head_range_the_pool_here_cannot_hold_is_refused_before_any_call(rank):
    source, pool, endpoint, agreement, kv = rank
    source.add("req", [(0, 1)])
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros((LAYERS, 2, 2 * PAGE, 1, 8), dtype=torch.float16)
    for heads in ((1, 2), (2, 1), (0, 0)):
        with pytest.raises(ValueError, match=rf"heads \(first={heads[0]}, count={heads[1]}\)"):
            _fetch(fast, endpoint, shared, agreement, [0], dst, {0: 0}, heads)


@pytest.mark.parametrize(("layer_start", "layer_end"), [(0, LAYERS), (1, LAYERS), (0, 1)])
def test_head_slice_digest_is_the_digest_of_a_pool_of_those_heads(layer_start, layer_end):
    g = torch.Generator().manual_seed(3)
    pool = torch.randn(LAYERS, 2, POOL_PAGES * PAGE, 4, 8, generator=g).half()
    pages = torch.tensor([5, 1, 6])
    for first, count in ((0, 4), (1, 2), (3, 1)):
        heads = slice(first, first + count)
        alone = pool[:, :, :, heads].contiguous()  # what a decode rank of these heads holds
        want = PageDigest(alone, pages, PAGE, layer_start, layer_end, first_layer=0)
        want.add(layer_start, layer_end)
        assert head_slice_digest(pool, pages, PAGE, layer_start, layer_end, heads) \
            == int(want.total()) & ((1 << 64) - 1)


def test_heads_outside_the_rows_or_with_nixl_before_an_attach_are_refused(rank):
    source, pool, endpoint, agreement, kv = rank
    source.add("req", [(0, 1)])
    FastPath(kv, agreement, transports=[SHM]).pool(endpoint, None, 10)  # attached: descriptors may be asked
    fetch = kv.channel(endpoint).unary_stream(FETCH_METHOD,
                                              request_serializer=lanekv_pb2.FetchRequest.SerializeToString,
                                              response_deserializer=lanekv_pb2.KVChunk.FromString)
    # NIXL serves head ranges (staged: tests/transfer/nixl/test_nixl_heads.py), after a NixlAttach.
    cases = [({"nixl": True, "head_start": 0, "head_count": 1}, Code.FAILED_PRECONDITION,
              "nixl=true needs a NixlAttach on rank 0 first"),
             ({"head_start": 1, "head_count": 2}, Code.INVALID_ARGUMENT, r"heads \[1, 3\).*num_kv_heads=2")]
    for fields, code, message in cases:
        request = lanekv_pb2.FetchRequest(request_id="req", fingerprint=agreement.fingerprint, descriptors=True,
                                          **fields)
        with pytest.raises(grpc.RpcError) as caught:
            list(fetch(request, timeout=10))
        assert caught.value.code() == code
        assert re.search(message, caught.value.details() or ""), caught.value.details()


@requires_gpu
def test_a_head_range_is_copied_between_gpus_and_matches_the_rank_digest():
    """A GPU pool of 4 KV heads (the rank digests heads [2, 4) on its device, Triton's
    gather), a decode pool of 2 heads on the last GPU; scattered and consecutive pages."""
    layers = 8
    agreement = make_agreement(kv_dtype="float16", num_layers=layers, num_kv_heads=4)
    src_device = torch.device("cuda", 0)
    dst_device = torch.device("cuda", torch.cuda.device_count() - 1)
    pool = torch.randn((layers, 2, 16 * PAGE, 4, 8), device=src_device).half()
    source = TensorPageSource(agreement, 0, pool)
    served = serve(source)
    endpoint = f"127.0.0.1:{served.port}"
    source.set_topology(Topology(1, "in_seq", "page_mod_cp", (endpoint,)))
    physical = [5, 6, 7, 1, 12, 3, 9, 14]  # more runs than a copy moves run by run
    source.add("req", list(enumerate(physical)))
    kv = KVClient()
    try:
        FastPath(kv, agreement).pool(endpoint, None, 10)  # attached: descriptors may be asked
        fast = FastPath(kv, agreement, transports=[])
        # Runs of consecutive pages of a head slice are planned as 2-D copies per layer and plane.
        planned = PlannedCopy.plan(pool[:, :, :, 2:4], [5, 6, 7], torch.zeros((layers, 2, 4 * PAGE, 2, 8),
                                   dtype=torch.float16, device=dst_device), [1, 2, 3], PAGE, 0, layers)
        assert planned is not None and planned.runs == 1
        for pages in ([0, 1, 2], list(range(len(physical)))):  # 3 runs (2-D copies); 8 (gathered)
            dst = torch.zeros((layers, 2, 10 * PAGE, 2, 8), dtype=torch.float16, device=dst_device)
            slot = {p: 9 - p for p in pages}
            stats, _ = _fetch(fast, endpoint, pool, agreement, pages, dst, slot, (2, 2))
            assert stats.bytes == layers * 2 * len(pages) * PAGE * 2 * 8 * 2
            want = pool[:, :, rows_of([physical[p] for p in pages]), 2:4].cpu()
            assert torch.equal(dst[:, :, rows_of([slot[p] for p in pages])].cpu(), want)
    finally:
        kv.close()
        served.server.stop(None)
