"""Layer-wise streaming over gRPC: a rank's span cut into several streams, a broken one
resumed for only what it lacks, and reads that wait only for their own layers."""

from __future__ import annotations

import time

import pytest
import torch
from lanekv.transfer.grpcfetch.client import KVClient, RetryPolicy
from lanekv.transfer.grpcfetch.layerwise import MAX_STREAMS_PER_RANK, split_span
from lanekv.transfer.grpcfetch.spans import Span
from lanekv.transfer.rank import progress as progress_module
from lanekv.transfer.rank.progress import LayerProgress
from lanekv.transfer.rank.service import KVTransferService

from tests.markers import requires_gpu
from tests.reliability.kv_cluster import LAYERS, PAGE_LAYER_BYTES, placer, same_bits, start_servers
from tests.reliability.proxy import FaultProxy

NUM_PAGES = 14  # rank 0 holds 7 pages, rank 1 holds 7
CHUNK_BYTES = 2 * PAGE_LAYER_BYTES
FAST = RetryPolicy(attempts=3, backoff_s=0.02, stall_s=0.3)


def test_split_span_cuts_pages_into_consecutive_runs_of_every_layer():
    span = Span(1, 4, tuple(range(10, 17)))
    parts = split_span(span, 3)
    assert [p.pages for p in parts] == [(10, 11, 12), (13, 14), (15, 16)]
    assert all((p.layer_start, p.layer_end) == (1, 4) for p in parts)
    assert split_span(span, 1) == [span]
    assert [p.pages for p in split_span(Span(0, 2, (5, 6)), 4)] == [(5,), (6,)]  # never an empty one
    unnamed = Span(0, None, None)
    assert split_span(unnamed, 4) == [unnamed]  # the rank's own pages: not known here, not cut
    for bad in (0, MAX_STREAMS_PER_RANK + 1, True, 2.0):
        with pytest.raises(ValueError, match="streams_per_rank"):
            split_span(span, bad)


class _Event:
    def __init__(self) -> None:
        self.recorded = False

    def record(self) -> None:
        self.recorded = True


def test_an_exact_wait_gives_the_event_of_its_own_last_layer(monkeypatch):
    # The host queues layers ahead of the device: a read of layer 0 must wait for layer 0's
    # event, not for that of the last layer queued so far.
    monkeypatch.setattr(progress_module.torch.cuda, "Event", _Event)
    progress = LayerProgress(4)
    monkeypatch.setattr(progress, "_cuda", True)  # as on a GPU: one event per layer
    for layer in range(3):
        progress.layer_written(layer)
    events = progress._events
    assert progress.wait(1, 1.0, exact=True) == (3, events[0])
    assert progress.wait(2, 1.0, exact=True) == (3, events[1])
    assert progress.wait(1, 1.0) == (3, events[2])  # not exact: everything queued (the fast path's)
    with pytest.raises(TimeoutError):
        progress.wait(4, 0.05, exact=True)


@pytest.fixture
def asked(monkeypatch):
    log: list = []
    fetch = KVTransferService.FetchKV

    def logged(self, request, context):
        log.append((self._source.rank, request.layer_start, tuple(request.pages), context.peer()))
        yield from fetch(self, request, context)

    monkeypatch.setattr(KVTransferService, "FetchKV", logged)
    return log


@pytest.mark.timeout(60)
def test_several_streams_per_rank_place_every_cell_once_and_resume_a_broken_one(asked):
    cluster = start_servers(2, NUM_PAGES)
    try:
        with FaultProxy(cluster.endpoints[1]) as proxy, KVClient(retry=FAST) as kv:
            kv.handshake(proxy.endpoint, cluster.sources[0].contract(), 10.0)
            proxy.cut_after(4 * (CHUNK_BYTES + 200))  # rank 1's connection breaks after a few chunks
            dest, log = torch.zeros_like(cluster.full), []
            pages = {r: cluster.pages_of(r) for r in (0, 1)}
            stats = kv.fetch({0: cluster.endpoints[0], 1: proxy.endpoint}, "req", cluster.fingerprint,
                             placer(dest, log), max_chunk_bytes=CHUNK_BYTES, timeout=10.0, pages=pages,
                             layer_end=LAYERS, streams_per_rank=2)
        assert same_bits(dest, cluster.full)
        assert len(log) == len(set(log)) == LAYERS * NUM_PAGES  # every cell placed exactly once
        assert proxy.faulted.is_set() and stats.per_rank[1].retries >= 1 and stats.per_rank[0].retries == 0
        for rank in (0, 1):
            first_two = [(start, p) for r, start, p, _ in asked if r == rank][:2]
            # Two streams of consecutive runs of the rank's pages, each from layer 0 (in either order).
            assert sorted(first_two) == sorted([(0, tuple(pages[rank][:4])), (0, tuple(pages[rank][4:]))])
        # Each stream of rank 0 on a connection of its own (the peer's port differs).
        first_peers = [peer for r, _, _, peer in asked if r == 0][:2]
        assert len(set(first_peers)) == 2, first_peers
        # The broken stream was asked again, for pages of its own rank only.
        resumed = [(start, p) for r, start, p, _ in asked if r == 1][2:]
        assert resumed and all(set(p) <= set(pages[1]) for _, p in resumed)
        assert stats.bytes == LAYERS * NUM_PAGES * PAGE_LAYER_BYTES
    finally:
        cluster.stop()


@requires_gpu
def test_on_a_gpu_a_read_of_an_early_layer_does_not_wait_for_later_ones():
    """Layer 0 written, then seconds of GPU work before layer 1: a FetchKV read of layer 0
    (the exact event, on the page source's own stream) is back long before that work ends.

    The source compiles and loads its read kernels when it is made: a kernel loaded
    during the prefill (Triton's first launch) may wait for the whole context, the
    prefill's later layers included."""
    from lanekv.prefill.cp.page_source import RankPageSource

    from tests.reliability.kv_cluster import make_agreement

    agreement = make_agreement(num_layers=2)
    pool = torch.randn(2, 2, 8 * 4, 2, 8, device="cuda").to(torch.bfloat16)
    source = RankPageSource(agreement, 0, pool, lambda rid, pages: None)
    progress = LayerProgress(2, "cuda")
    source.add("req", [(0, 1), (1, 3)], progress)
    torch.cuda.synchronize()  # the pool and the source are ready: nothing before this counts
    progress.layer_written(0)
    # About 5 s of work on the prefill's stream (an H200 runs near 2 GHz), queued after layer 0.
    torch.cuda._sleep(10_000_000_000)
    progress.layer_written(1)
    start = time.perf_counter()
    written, after = source.ready("req", 1, 10.0, lambda: True, exact=True)
    payload = source.read([1, 3], 0, 1, after)
    read_s = time.perf_counter() - start
    still_running = not progress._events[1].query()
    torch.cuda.synchronize()
    assert written == 2 and still_running, f"the sleep ended before the read ({read_s:.2f} s): lengthen it"
    assert read_s < 0.5
    rows = torch.cat([torch.arange(4) + 4, torch.arange(4) + 12])
    assert torch.equal(payload, pool[0:1, :, rows].cpu())


@requires_gpu
def test_on_a_gpu_a_read_of_a_written_layer_does_not_queue_behind_one_that_waits():
    """Two fetch streams of one rank: one reads layer 1, which seconds of GPU work still
    hold back, the other layer 0, already written. Each read has a stream of its own, so
    the second is back long before the first (one shared stream would queue it behind)."""
    import threading

    from lanekv.prefill.cp.page_source import RankPageSource

    from tests.reliability.kv_cluster import make_agreement

    agreement = make_agreement(num_layers=2)
    pool = torch.randn(2, 2, 8 * 4, 2, 8, device="cuda").to(torch.bfloat16)
    source = RankPageSource(agreement, 0, pool, lambda rid, pages: None)
    progress = LayerProgress(2, "cuda")
    source.add("req", [(0, 1), (1, 3)], progress)
    torch.cuda.synchronize()
    progress.layer_written(0)
    torch.cuda._sleep(10_000_000_000)  # about 5 s before layer 1 is written
    progress.layer_written(1)
    _, late = source.ready("req", 2, 10.0, lambda: True, exact=True)
    _, early = source.ready("req", 1, 10.0, lambda: True, exact=True)
    waiting = threading.Thread(target=source.read, args=([1, 3], 1, 2, late), daemon=True)
    waiting.start()
    time.sleep(0.2)  # the late read is queued on its stream first
    start = time.perf_counter()
    payload = source.read([1, 3], 0, 1, early)
    read_s = time.perf_counter() - start
    still_waiting = waiting.is_alive()
    torch.cuda.synchronize()
    waiting.join(timeout=30)
    assert still_waiting, f"the late read ended before the early one ({read_s:.2f} s): lengthen the sleep"
    assert read_s < 0.5
    rows = torch.cat([torch.arange(4) + 4, torch.arange(4) + 12])
    assert torch.equal(payload, pool[0:1, :, rows].cpu())
