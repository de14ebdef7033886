"""The fast-path transport's fetch of several ranks (``transfer.connector.fastpath``),
over a stand-in ``FastPath``: stop cancels late calls and waits for the ranks' threads;
a rank that fails before its fetch gives its turn away."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from runtime.status import Refusal
from transfer.connector.base import Coverage, FetchJob, Route
from transfer.connector.fastpath import FastPathTransport
from transfer.errors import RemoteError
from transfer.protocol.descriptors import (
    SHM,
)

Code = grpc.StatusCode
U64 = (1 << 64) - 1




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
