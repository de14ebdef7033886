"""The fast-path transport's fetch of several ranks (``transfer.connector.fastpath``),
over a stand-in ``FastPath``: stop cancels late calls and waits for the ranks' threads;
a rank that fails before its fetch gives its turn away; a fast path that copies at
the end calls the ranks once the prefill has answered."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch
from lanekv.runtime.status import Refusal
from lanekv.transfer.connector.base import Coverage, FetchJob, Route
from lanekv.transfer.connector.fastpath import FastPathTransport
from lanekv.transfer.errors import RemoteError
from lanekv.transfer.protocol.descriptors import (
    SHM,
)

Code = grpc.StatusCode
U64 = (1 << 64) - 1




class _Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def _fast_fetches(fetch, pools, *, physical_of=None, written=None, copy_at_end=True, wait_for_answer=True):
    """The fast-path transport's fetch of one job over a stand-in FastPath whose ``fetch`` is ``fetch``."""
    job = FetchJob("req", "f" * 64, None, ("127.0.0.1:1",) * len(pools), {r: [r] for r in pools}, 1, 1,
                   torch.zeros(1), list, time.monotonic() + 30, physical_of=physical_of, written=written)
    routes = {rank: Route(SHM, pool) for rank, pool in pools.items()}
    fastpath = SimpleNamespace(fetch=fetch, copy_at_end=copy_at_end,
                               tuning=SimpleNamespace(wait_for_answer=wait_for_answer))
    return FastPathTransport(fastpath).start(job, routes, Coverage(job.pages, 1))


class _Prefill:
    """A prefill that answers (True) or fails (False) once ``finish`` is called; ``written`` as
    ``PrefillCall.written`` answers it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.outcome: bool | None = None

    def finish(self, ok: bool) -> None:
        self.outcome = ok
        self._done.set()

    def written(self, timeout_s: float) -> bool | None:
        return self.outcome if self._done.wait(timeout_s) else None


def _recording_fetch(calls):
    def fetch(request, part, **kw):
        calls.append((time.monotonic(), None if part.expect is None else list(part.expect)))
        return SimpleNamespace(bytes=0, chunks=0, seconds=0.0)
    return fetch


def test_copying_at_the_end_calls_the_rank_once_the_prefill_answered():
    calls, prefill = [], _Prefill()
    fast = _fast_fetches(_recording_fetch(calls), {0: torch.zeros(1)}, physical_of=lambda p: p + 10,
                         written=prefill.written)
    time.sleep(0.3)
    assert calls == [], "the rank was called while its prefill ran"
    answered = time.monotonic()
    prefill.finish(True)
    fast.wait()
    (at, expect), = calls
    assert at >= answered and expect == [10]  # every layer written: copied from where its page is


@pytest.mark.parametrize("how", ["prefill failed", "copies per layer", "no waiting"])
def test_a_fetch_that_does_not_wait_streams_from_the_rank(how):
    """A failed prefill, a fast path that copies each layer as it comes, or one tuned not to
    wait: the rank is called at once (or after the failure) and nothing is copied early."""
    calls, prefill = [], _Prefill()
    if how == "prefill failed":
        threading.Timer(0.2, prefill.finish, (False,)).start()
    fast = _fast_fetches(_recording_fetch(calls), {0: torch.zeros(1)}, physical_of=lambda p: p,
                         written=prefill.written, copy_at_end=how != "copies per layer",
                         wait_for_answer=how != "no waiting")
    started = time.monotonic()
    fast.wait()
    (at, expect), = calls
    assert expect is None
    if how != "prefill failed":
        assert at - started < 0.15, "it waited for an answer that was not to be waited for"


def test_a_fetch_waiting_for_the_answer_ends_when_stopped():
    calls, prefill = [], _Prefill()
    fast = _fast_fetches(_recording_fetch(calls), {0: torch.zeros(1)}, physical_of=lambda p: p,
                         written=prefill.written)
    time.sleep(0.1)
    t0 = time.monotonic()
    fast.stop(wait_s=5.0)
    assert time.monotonic() - t0 < 1.0, "stop() waited for a prefill that never answered"
    assert [expect for _, expect in calls] == [None]  # the late call is cancelled as it is made


def test_stopped_fast_fetches_cancel_late_calls_and_wait_for_their_threads():
    ended = []

    def fetch(request, part, *, on_call, **kw):
        rank, endpoint = part.rank, part.endpoint
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

    def fetch(request, part, *, order, **kw):
        rank = part.rank
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
