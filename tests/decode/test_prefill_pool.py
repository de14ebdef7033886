"""xPyD: which prefill daemon takes a prompt, how one leaves and rejoins the pick, and
how the Generate pipeline retries a request on another one."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2
from lanekv.decode.budget import PageBudget
from lanekv.decode.generate import (
    GenerateCall,
    GenerateContext,
    GeneratePipeline,
    GenerateSpec,
    Prepared,
)
from lanekv.decode.prefill_call import RETRY_CODES, PrefillClient, PrefillPool, PrefillTarget
from lanekv.proto import lanekv_pb2
from lanekv.runtime.status import Refusal
from lanekv.transfer.errors import ContractMismatch
from lanekv.transfer.protocol.contract import Topology
from lanekv.transfer.protocol.fielddiff import FieldDiff

Code = grpc.StatusCode
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Down(grpc.RpcError):
    def code(self):
        return Code.UNAVAILABLE

    def details(self):
        return "connection refused"


class FakeHealth:
    """A health stub whose answer the test sets (None: the daemon does not answer)."""

    def __init__(self) -> None:
        self.status: int | None = SERVING
        self.asked = 0

    def Check(self, request, timeout):  # noqa: N802 (the stub's name)
        self.asked += 1
        if self.status is None:
            raise _Down()
        return health_pb2.HealthCheckResponse(status=self.status)


def _topology(i: int, cp_size: int = 1) -> Topology:
    return Topology(cp_size, "in_seq", "page_mod_cp", tuple(f"127.0.0.1:{7100 + 10 * i + r}" for r in range(cp_size)))


def _pool(n: int, interval_s: float = 60.0, rejoin=None, topologies=None, on_available=None):
    topologies = topologies or [_topology(i) for i in range(n)]
    targets = [PrefillTarget(PrefillClient(None, f"127.0.0.1:{7000 + i}"), topologies[i], FakeHealth())
               for i in range(n)]
    return PrefillPool(targets, interval_s=interval_s, timeout_s=0.5, rejoin=rejoin,
                       on_available=on_available), targets


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


def test_ties_take_turns():
    pool, targets = _pool(2)
    try:
        picked = []
        for _ in range(6):
            t = pool.pick(7)
            picked.append(t)
            pool.done(t, 7)
        assert picked.count(targets[0]) == 3 and picked.count(targets[1]) == 3
        assert all(t.queued_tokens == 0 for t in targets)
    finally:
        pool.close()


def test_exclude_lost_and_none_left():
    pool, (a, b) = _pool(2)
    try:
        pool.lost(a, "UNAVAILABLE: gone")
        assert all(pool.pick(1) is b for _ in range(3))
        assert pool.others([a]) is True and pool.others([b]) is False
        with pytest.raises(Refusal) as err:
            pool.pick(1, exclude=[b])
        assert err.value.code == Code.UNAVAILABLE
        assert "127.0.0.1:7000: UNAVAILABLE: gone" in err.value.message
        assert "127.0.0.1:7001: failed this request" in err.value.message
    finally:
        pool.close()


def test_health_puts_a_daemon_back_and_takes_one_out():
    pool, (a, b) = _pool(2, interval_s=0.05)
    try:
        pool.lost(a, "refused a call")
        b.health.status = None
        deadline = time.monotonic() + 5
        while (not a.healthy or b.healthy) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.healthy and a.problem == ""
        assert not b.healthy and "UNAVAILABLE" in b.problem
        assert pool.pick(1) is a
    finally:
        pool.close()


def test_not_serving_leaves_and_a_rejoin_takes_the_new_topology():
    """A daemon back at SERVING handshakes again before it rejoins: a restart may have
    moved its ranks, and the KV fetch must go to the ranks it has now."""
    moved = _topology(5, cp_size=2)
    asked = []

    def rejoin(endpoint):
        asked.append(endpoint)
        return moved

    pool, (a, b) = _pool(2, rejoin=rejoin)
    try:
        a.health.status = NOT_SERVING
        pool.check(a)
        assert not a.healthy and a.problem == "health NOT_SERVING"
        pool.check(b)
        assert asked == [] and b.healthy  # in the pick already: no handshake
        a.health.status = SERVING
        pool.check(a)
        assert asked == [a.endpoint] and a.healthy and a.topology is moved
    finally:
        pool.close()


def test_a_rejoin_refused_by_contract_stays_out():
    def rejoin(endpoint):
        raise ContractMismatch([FieldDiff("page_size", 4, 8)], f"{endpoint}: page_size differs")

    pool, (a, b) = _pool(2, rejoin=rejoin)
    try:
        pool.lost(a, "UNAVAILABLE: gone")
        pool.check(a)  # SERVING, but the handshake refuses
        assert not a.healthy and "page_size" in a.problem
        assert all(pool.pick(1) is b for _ in range(3))
    finally:
        pool.close()


def test_a_daemon_not_reached_at_start_joins_through_its_handshake():
    pool, (a, b) = _pool(2, rejoin=lambda endpoint: _topology(9),
                         topologies=[None, _topology(1)])
    try:
        assert not a.healthy and a.problem == "not handshaken yet"
        assert all(pool.pick(1) is b for _ in range(2))
        pool.check(a)
        assert a.healthy and a.topology == _topology(9)
    finally:
        pool.close()


def test_needs_a_daemon_and_a_rejoin_for_unknown_topologies():
    with pytest.raises(ValueError, match="at least one prefill daemon"):
        PrefillPool([])
    target = PrefillTarget(PrefillClient(None, "127.0.0.1:7000"), None, FakeHealth())
    with pytest.raises(ValueError, match="rejoin"):
        PrefillPool([target])
    with pytest.raises(ValueError, match="interval_s"):
        PrefillPool([PrefillTarget(PrefillClient(None, "127.0.0.1:7000"), _topology(0), FakeHealth())],
                    interval_s=0)


# -- the pipeline's retry ------------------------------------------------------


class _Pipeline(GeneratePipeline):
    """The Generate pipeline with steps 2-5 replaced by a script: each daemon fails with
    the code given for it, or prepares."""

    def __init__(self, ctx, failures):
        super().__init__(ctx)
        self.failures = failures
        self.tried = []
        self.queued_at = []  # each daemon's queued prompt tokens while it prefills

    def _prepare_on(self, target, call, deadline):
        self.tried.append(target.endpoint)
        self.queued_at.append(target.queued_tokens)
        code = self.failures.get(target.endpoint)
        if code is not None:
            raise Refusal(code, f"{target.endpoint} failed")
        return Prepared(7, 0.0, None, {})


def _pipeline(pool, failures):
    config = SimpleNamespace(request_timeout_s=30.0, page_size=4, page_wait_s=1.0)
    ctx = GenerateContext(config, SimpleNamespace(num_pages=100), None, None, pool, PageBudget(100), None, None,
                          None, 1000, 1000, None)
    return _Pipeline(ctx, failures)


def _call(prompt_len=5):
    spec = GenerateSpec("r1", list(range(prompt_len)), None, None, 4, ())
    return GenerateCall(spec, queue.SimpleQueue())


@pytest.mark.parametrize("code", [Code.UNAVAILABLE, Code.RESOURCE_EXHAUSTED, Code.INTERNAL, Code.DATA_LOSS,
                                  Code.FAILED_PRECONDITION, Code.DEADLINE_EXCEEDED])
def test_a_failed_prefill_goes_to_the_other_daemon(code):
    pool, targets = _pool(2)
    try:
        a = pool.pick(50)  # a holds queued tokens: the request goes to b first
        b = next(t for t in targets if t is not a)
        pipeline = _pipeline(pool, {b.endpoint: code})
        prepared = pipeline._prepare(_call(), None)
        assert prepared.first_token == 7 and pipeline.tried == [b.endpoint, a.endpoint]
        assert pipeline.queued_at == [5, 55]  # the prompt counted on the daemon prefilling it
        assert b.retried == 1 and (a.queued_tokens, b.queued_tokens) == (50, 0)
        # Down or no longer ours: out of the pick; full or failing once: still in it.
        assert b.healthy is (code not in (Code.UNAVAILABLE, Code.FAILED_PRECONDITION))
    finally:
        pool.close()


def test_each_other_daemon_is_tried_once_then_the_failure_is_the_answer():
    pool, targets = _pool(3)
    try:
        pipeline = _pipeline(pool, {t.endpoint: Code.RESOURCE_EXHAUSTED for t in targets})
        with pytest.raises(Refusal) as err:
            pipeline._prepare(_call(), None)
        assert err.value.code == Code.RESOURCE_EXHAUSTED
        assert sorted(pipeline.tried) == sorted(t.endpoint for t in targets)  # each once
        assert [t.retried for t in targets].count(1) == 2 and all(t.queued_tokens == 0 for t in targets)
        assert pipeline._ctx.budget.used == 2  # admitted once: 5 + 4 - 1 cache tokens in pages of 4
    finally:
        pool.close()


@pytest.mark.parametrize("code", [Code.INVALID_ARGUMENT, Code.OUT_OF_RANGE, Code.CANCELLED,
                                  Code.ALREADY_EXISTS])
def test_the_requests_own_faults_are_not_retried(code):
    pool, (a, b) = _pool(2)
    try:
        pipeline = _pipeline(pool, {a.endpoint: code, b.endpoint: code})
        with pytest.raises(Refusal) as err:
            pipeline._prepare(_call(), None)
        assert err.value.code == code and len(pipeline.tried) == 1
        assert a.healthy and b.healthy and a.retried == b.retried == 0
    finally:
        pool.close()


def test_a_client_that_left_is_not_retried():
    pool, (a, b) = _pool(2)
    try:
        pipeline = _pipeline(pool, {a.endpoint: Code.UNAVAILABLE, b.endpoint: Code.UNAVAILABLE})
        call = _call()
        original = pipeline._prepare_on

        def leave_then_fail(target, call, deadline):
            call.abandoned.set()
            return original(target, call, deadline)

        pipeline._prepare_on = leave_then_fail
        with pytest.raises(Refusal):
            pipeline._prepare(call, None)
        assert len(pipeline.tried) == 1
    finally:
        pool.close()


def test_no_healthy_daemon_is_unavailable_before_any_prefill():
    pool, (a, b) = _pool(2)
    try:
        pool.lost(a, "UNAVAILABLE: gone")
        pool.lost(b, "health NOT_SERVING")
        pipeline = _pipeline(pool, {})
        with pytest.raises(Refusal) as err:
            pipeline._prepare(_call(), None)
        assert err.value.code == Code.UNAVAILABLE and "health NOT_SERVING" in err.value.message
        assert pipeline.tried == []
    finally:
        pool.close()


def test_the_pick_turning_empty_and_back_is_told_once_each():
    """The decode daemon's health follows this: NOT_SERVING while no prefill daemon
    can take a prompt, SERVING again once one is back."""
    told: list[bool] = []
    pool, (a, b) = _pool(2, on_available=told.append)
    try:
        assert pool.available
        pool.lost(a, "Prefill UNAVAILABLE")
        assert told == []  # b still takes prompts
        b.health.status = None
        pool.check(b)
        assert told == [False] and not pool.available
        pool.lost(b, "again")  # already out: nothing new to tell
        assert told == [False]
        a.health.status = SERVING
        pool.check(a)
        assert told == [False, True] and pool.available
        pool.check(a)  # still in: nothing new
        assert told == [False, True]
    finally:
        pool.close()


class _Slow(grpc.RpcError):
    def code(self):
        return Code.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"


def test_a_slow_health_check_leaves_only_after_several_in_a_row():
    """A busy prefill daemon may answer its health check late: it stays in the pick
    until SLOW_CHECKS_TO_LEAVE checks in a row time out (one answer between starts
    the count again); a refused connection or NOT_SERVING takes it out at once."""
    from lanekv.decode.prefill_call import SLOW_CHECKS_TO_LEAVE

    pool, (a,) = _pool(1)
    slow = lambda request, timeout: (_ for _ in ()).throw(_Slow())  # noqa: E731
    answer = a.health.Check
    try:
        a.health.Check = slow
        for _ in range(SLOW_CHECKS_TO_LEAVE - 1):
            pool.check(a)
        assert a.healthy and pool.pick(1) is a
        a.health.Check = answer
        pool.check(a)  # answered: the count starts again
        a.health.Check = slow
        for _ in range(SLOW_CHECKS_TO_LEAVE - 1):
            pool.check(a)
        assert a.healthy
        pool.check(a)
        assert not a.healthy
        assert a.problem == (f"health check DEADLINE_EXCEEDED: Deadline Exceeded "
                             f"({SLOW_CHECKS_TO_LEAVE} checks in a row)")
        a.health.Check = answer
        pool.check(a)
        assert a.healthy and a.slow_checks == 0
        a.health.status = None  # connection refused: out at once
        pool.check(a)
        assert not a.healthy and "UNAVAILABLE" in a.problem
    finally:
        pool.close()


class _Cut(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Cancelled"


class _CutStream:
    """A PrefillStream whose server cancels it before its first message."""

    def __next__(self):
        raise _Cut()

    def cancel(self) -> bool:
        return True


def test_a_prefill_call_the_prefill_daemon_cancels_is_its_loss_not_the_clients():
    # A prefill daemon that stops cuts its calls with CANCELLED; the decode daemon's client
    # did not leave, so its Generate must not end CANCELLED (seen on CI in
    # tests/reliability/test_prefill_restart.py) but UNAVAILABLE, which is retried.
    client = PrefillClient(SimpleNamespace(PrefillStream=lambda request, timeout: _CutStream()), "10.0.0.9:7000")
    call = client.stream("r1", [1, 2, 3], lanekv_pb2.SamplingParams(), timeout_s=5.0)
    with pytest.raises(Refusal) as refused:
        call.started()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE and refused.value.code in RETRY_CODES
    assert refused.value.message == "prefill daemon 10.0.0.9:7000 cancelled the call (stopping?): Cancelled"
    # Cancelled by us (our client left, or the call is done with): CANCELLED as it was.
    ours = client.stream("r2", [1, 2, 3], lanekv_pb2.SamplingParams(), timeout_s=5.0)
    ours.close()
    with pytest.raises(Refusal) as refused:
        ours.started()
    assert refused.value.code == grpc.StatusCode.CANCELLED
