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
fails the call in time, a decode daemon killed mid-fetch leaves pages that
its leases free (and a new one serves), a prefill rank killed mid-fetch
fails the call UNAVAILABLE and the prefill daemon says so from then on, and
a restarted prefill daemon on the same ports refuses the old start's
requests (even one whose id it reuses) while the decode daemon serves on.
Each checks that no page is left held on either side.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from tests.reliability.kv_cluster import (
    LAYERS,
    PAGE_LAYER_BYTES,
    placer,
    same_bits,
    start_servers,
)
from tests.reliability.proxy import FaultProxy
from transfer.client import KVClient, RemoteError, RetryPolicy
from transfer.security import SecurityConfig
from transfer.server import KVTransferService

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
