"""xPyD: which prefill daemon takes a prompt, and how one leaves and rejoins the pick."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from decode.prefill_call import PrefillClient, PrefillPool, PrefillTarget
from runtime.status import Refusal
from transfer.protocol.contract import Topology

SERVING = health_pb2.HealthCheckResponse.SERVING


class _Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


class FakeHealth:
    """A health stub whose answer the test sets."""

    def __init__(self) -> None:
        self.up = True
        self.asked = 0

    def Check(self, request, timeout):  # noqa: N802 (the stub's name)
        self.asked += 1
        if not self.up:
            raise _Down()
        return health_pb2.HealthCheckResponse(status=SERVING)


def _pool(n: int, interval_s: float = 60.0):
    targets = [PrefillTarget(PrefillClient(None, f"127.0.0.1:{7000 + i}"),
                             Topology(1, "in_seq", "page_mod_cp", (f"127.0.0.1:{7100 + i}",)), FakeHealth())
               for i in range(n)]
    return PrefillPool(targets, interval_s=interval_s, timeout_s=0.5), targets


def test_fewest_queued_prompt_tokens_win():
    pool, (a, b, c) = _pool(3)
    try:
        first = pool.pick(100)
        second = pool.pick(10)
        third = pool.pick(10)
        assert len({first, second, third}) == 3  # each idle daemon takes one
        # Now queued: 100, 10, 10: the two light ones take the next prompts.
        assert pool.pick(5) in (second, third)
        pool.done(first, 100)
        assert pool.pick(1) is first  # back to 0 queued: the lightest
        assert first.queued_tokens == 1
    finally:
        pool.close()


def test_exclude_lost_and_none_left():
    pool, (a, b) = _pool(2)
    try:
        pool.lost(a, "UNAVAILABLE: gone")
        assert all(pool.pick(1) is b for _ in range(3))
        assert pool.others([a]) and not pool.others([b])
        with pytest.raises(Refusal) as err:
            pool.pick(1, exclude=[b])
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        assert "127.0.0.1:7000: UNAVAILABLE: gone" in err.value.message
    finally:
        pool.close()


def test_health_puts_a_daemon_back_and_takes_one_out():
    pool, (a, b) = _pool(2, interval_s=0.05)
    try:
        pool.lost(a, "refused a call")
        b.health.up = False
        deadline = time.monotonic() + 5
        while (not a.healthy or b.healthy) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.healthy and a.problem == ""
        assert not b.healthy and "UNAVAILABLE" in b.problem
        assert pool.pick(1) is a
    finally:
        pool.close()


def test_needs_a_daemon():
    with pytest.raises(ValueError, match="at least one prefill daemon"):
        PrefillPool([])
