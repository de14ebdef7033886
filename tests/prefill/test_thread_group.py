"""The rank threads of ``ThreadGroup``: one thread per rank for the group's life (state a
library keeps per thread survives from call to call), a failure re-raised once every rank
ended, the group usable after it, and ``close`` ending the threads."""

from __future__ import annotations

import threading

import pytest
import torch
from lanekv.prefill.cp.thread_group import ThreadGroup


@pytest.mark.timeout(30)
def test_each_rank_runs_on_the_same_thread_from_call_to_call():
    group = ThreadGroup(3, timeout_s=5)
    try:
        first = group.run(lambda rank: threading.get_ident())
        again = group.run(lambda rank: threading.get_ident())
        assert first == again
        assert len(set(first)) == 3 and threading.get_ident() not in first
        local = threading.local()

        def count(rank: int) -> int:
            local.calls = getattr(local, "calls", 0) + 1
            return local.calls

        assert group.run(count) == [1, 1, 1]
        assert group.run(count) == [2, 2, 2]  # per-thread state kept
    finally:
        group.close()


@pytest.mark.timeout(30)
def test_a_failing_rank_is_raised_and_the_group_gathers_again_after_it():
    group = ThreadGroup(2, timeout_s=5)

    def gather(rank: int) -> torch.Tensor:
        return group.all_gather(rank, torch.full((2,), float(rank)))

    def fail_on_rank_1(rank: int) -> torch.Tensor:
        if rank == 1:
            raise ValueError("rank 1 refused its batch")
        return gather(rank)  # rank 0 waits at the barrier until rank 1's failure aborts it

    try:
        with pytest.raises(ValueError, match="rank 1 refused its batch"):
            group.run(fail_on_rank_1)
        out = group.run(gather)
        assert all(torch.equal(o, torch.tensor([0.0, 0.0, 1.0, 1.0])) for o in out)
    finally:
        group.close()


@pytest.mark.timeout(30)
def test_close_ends_the_rank_threads():
    group = ThreadGroup(2, timeout_s=5)
    idents = set(group.run(lambda rank: threading.get_ident()))
    group.close()
    assert not idents & {t.ident for t in threading.enumerate()}
    with pytest.raises(RuntimeError):
        group.run(lambda rank: rank)
