"""The front's choice of decode daemon: fewest running requests, health in and out of rotation."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from lanekv.http.backends import Backends, NoBackend
from lanekv.http.config import FrontConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Down(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details="connection refused")


class _Slow(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                         details="Deadline Exceeded")


class FakeHealth:
    """An asyncio health stub whose answer the test sets (None: no answer; "slow": it times out)."""

    def __init__(self) -> None:
        self.status: int | str | None = SERVING

    async def Check(self, request, timeout, metadata):  # noqa: N802 (the stub's name)
        if self.status is None:
            raise _Down()
        if self.status == "slow":
            raise _Slow()
        return health_pb2.HealthCheckResponse(status=self.status)


def _backends(tmp_path, n: int, **config) -> Backends:
    endpoints = tuple(f"127.0.0.1:{9000 + i}" for i in range(n))
    backends = Backends.of(FrontConfig(str(tmp_path), endpoints, **config))
    for member in backends.members:
        member.health = FakeHealth()
    asyncio.run(backends.check_all())
    return backends


def test_fewest_running_requests_win_and_ties_take_turns(tmp_path):
    backends = _backends(tmp_path, 3)
    a, b, c = backends.members
    first = [backends.pick() for _ in range(3)]
    assert set(first) == {a, b, c}  # idle daemons take turns
    backends.done(b)
    assert backends.pick() is b  # the one with fewest running
    backends.done(a)  # a: 0 running, b and c: 1
    assert backends.pick() is a
    assert [m.running for m in backends.members] == [1, 1, 1]
    for _ in range(6):
        m = backends.pick()
        backends.done(m)
    assert [m.served for m in backends.members] == [2 + 2, 2 + 2, 1 + 2]


def test_full_is_429_and_none_healthy_is_503(tmp_path):
    backends = _backends(tmp_path, 2, max_running_per_decode=1)
    backends.pick(), backends.pick()
    with pytest.raises(NoBackend) as err:
        backends.pick()
    assert err.value.status == 429
    for member in backends.members:
        backends.lost(member, "Generate UNAVAILABLE: gone")
    with pytest.raises(NoBackend) as err:
        backends.pick()
    assert err.value.status == 503 and "127.0.0.1:9001: Generate UNAVAILABLE: gone" in err.value.message


def test_health_takes_a_daemon_out_and_puts_it_back(tmp_path):
    backends = _backends(tmp_path, 2)
    a, b = backends.members
    a.health.status = None
    b.health.status = NOT_SERVING
    asyncio.run(backends.check_all())
    assert not a.healthy and "UNAVAILABLE" in a.problem
    assert not b.healthy and b.problem == "NOT_SERVING"
    with pytest.raises(NoBackend):
        backends.pick()
    a.health.status = SERVING
    asyncio.run(backends.check_all())
    assert a.healthy and a.problem == "" and backends.pick() is a
    with pytest.raises(NoBackend) as err:  # the only healthy one already tried
        backends.pick(exclude=[a])
    assert err.value.status == 503


def test_a_daemon_slow_to_answer_its_health_check_stays_until_several_in_a_row(tmp_path):
    from lanekv.runtime.status import SLOW_CHECKS_TO_LEAVE

    backends = _backends(tmp_path, 1)
    (a,) = backends.members
    a.health.status = "slow"
    for _ in range(SLOW_CHECKS_TO_LEAVE - 1):
        asyncio.run(backends.check_all())
    assert a.healthy and backends.pick() is a  # busy is not gone
    asyncio.run(backends.check_all())
    assert not a.healthy and a.problem == (f"health check DEADLINE_EXCEEDED: Deadline Exceeded "
                                           f"({SLOW_CHECKS_TO_LEAVE} checks in a row)")
    a.health.status = SERVING
    asyncio.run(backends.check_all())
    assert a.healthy and a.slow_checks == 0
