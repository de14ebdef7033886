"""``CopyOrder``: ranks with pools on other devices prepare and queue first, nobody waits
on its copies before every rank has queued, and a failed fetch gives its turn away."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from lanekv.transfer.errors import RemoteError
from lanekv.transfer.fastpath.client import FastPath
from lanekv.transfer.fastpath.copyorder import CopyOrder
from lanekv.transfer.protocol.descriptors import (
    SHM,
)

from tests.reliability.kv_cluster import LAYERS, PAGE, rows_of
from tests.transfer.fastpath.rig import fetch_rank, fill

Code = grpc.StatusCode
U64 = (1 << 64) - 1




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


def test_a_rank_waits_for_its_turn_and_a_failed_fetch_gives_its_turn_away(rank):
    source, pool, endpoint, agreement, kv = rank
    pages = [(p, p) for p in range(3)]
    for layer in range(LAYERS):
        fill(pool, [p for _, p in pages], layer)
    source.add("req", pages)
    fast = FastPath(kv, agreement, transports=[SHM])
    shared = fast.pool(endpoint, None, 10)
    dst = torch.zeros(LAYERS, 2, 3 * PAGE, 2, 8, dtype=torch.float16)
    order = CopyOrder([1])  # rank 1 (another device) goes first
    copied = []

    def fetch():
        fetch_rank(fast, endpoint, 0, shared, "req", agreement.fingerprint, [0, 1, 2], dst, list,
                   lambda *a: copied.append(time.monotonic()), epoch=None, timeout=30, order=order)

    waiter = threading.Thread(target=fetch)
    waiter.start()
    time.sleep(0.3)
    assert copied == [], "copied before the rank that goes first queued its copies"
    with pytest.raises(RemoteError, match="NOT_FOUND"):  # rank 1's fetch fails: its turn passes on
        fetch_rank(fast, endpoint, 1, shared, "no-such-request", agreement.fingerprint, [0], dst, list,
                   lambda *a: None, epoch=None, timeout=30, order=order)
    waiter.join(10)
    assert len(copied) == 1
    assert torch.equal(dst, pool[:, :, rows_of([0, 1, 2])])
