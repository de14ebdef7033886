"""The CP rank processes (gloo on CPU): same results as the rank threads, clean
shutdown, a clear error when a rank dies and no /dev/shm pool left behind
by it; and one run through the Triton
kernels under the interpreter."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from lanekv.prefill.cp.launcher import CPPrefillEngine, PrefillInput, RankDiedError
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig

from tests.checkpoints import write_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    write_llama(path)
    return path


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 290, (n,), generator=g).tolist() for n in (3, 40, 97)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cp_size, page_size", [(2, 4), (3, 16)])
def test_rank_processes_match_rank_threads(checkpoint, cp_size, page_size):
    cfg = EngineConfig(str(checkpoint), cp_size=cp_size, page_size=page_size, pages_per_lane=64, start_timeout_s=120)
    ref = ThreadedPrefillEngine(cfg)
    want = ref.prefill([PrefillInput(p) for p in _prompts()], return_logits=True)
    with CPPrefillEngine(cfg) as eng:
        got = eng.prefill([PrefillInput(p) for p in _prompts()], return_logits=True)
        for g, w in zip(got, want):
            assert g.first_token == w.first_token
            assert [p.page for p in g.pages] == [p.page for p in w.pages]
            torch.testing.assert_close(g.logits, w.logits, rtol=1e-5, atol=1e-5)
            n = g.num_tokens
            torch.testing.assert_close(
                eng.read_pages([p.page for p in g.pages])[:, :, :n],
                ref.read_pages([p.page for p in w.pages])[:, :, :n],
                rtol=1e-5,
                atol=1e-5,
            )
            # Each rank's own time, until its host had queued the forward, and its GC pauses.
            for r in range(cp_size):
                total, queued, gc_s = (g.timings[f"rank{r}_{k}s"] for k in ("", "queued_", "gc_"))
                assert 0 < queued <= total and 0 <= gc_s <= total
            slowest = max(range(cp_size), key=lambda r: g.timings[f"rank{r}_s"])
            assert [g.timings[k] for k in ("compute_s", "queued_s", "gc_s")] == \
                [g.timings[f"rank{slowest}_{k}s"] for k in ("", "queued_", "gc_")]
        # Each rank process freezes what it holds (the threaded engine's ranks are not theirs to freeze).
        frozen = eng.freeze_heap()
        assert len(frozen) == cp_size and all(count > 1000 for count in frozen), frozen
        assert ref.freeze_heap() == []
        # Each rank process runs its own GEMM ladder; the rank threads share one model, run once.
        gemms = eng.warm_gemms(100)
        assert [g.max_rows for g in gemms] == [-(-100 // page_size) * page_size] * cp_size
        assert len({g.calls for g in gemms}) == 1 and gemms[0].calls > 0
        assert [g.calls for g in ref.warm_gemms(100)] == [gemms[0].calls]
        again = eng.prefill([PrefillInput(_prompts()[1])], return_logits=True)[0]
        assert again.first_token == want[1].first_token  # still serving after the freeze
        procs = list(eng.processes)
    assert all(not p.is_alive() for p in procs), "close() left a rank running"


@pytest.mark.timeout(180)
def test_a_dead_rank_is_reported(checkpoint):
    cfg = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32, start_timeout_s=120)
    with CPPrefillEngine(cfg) as eng:
        eng.prefill([PrefillInput([5, 6, 7])])
        os.kill(eng.processes[1].pid, signal.SIGKILL)
        eng.processes[1].join(10)
        with pytest.raises(RankDiedError, match="rank1"):
            eng.prefill([PrefillInput([5, 6, 7, 8])])
        # the failed batch's pages went back to the lanes
        assert eng.allocator.num_used() == 1  # the first request's page only
        with pytest.raises(RankDiedError, match="unusable"):
            eng.prefill([PrefillInput([5])])


@pytest.mark.timeout(240)
def test_cp_prefill_through_interpreted_triton_kernels(checkpoint, monkeypatch):
    """The whole CP path with the Triton kernels (interpreter) instead of the references.

    Rank processes, not threads: the interpreter patches triton.language while
    a kernel runs, so two interpreted kernels must not run in one process at once."""
    cfg = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32)
    prompts = [[5, 9, 11, 200, 17, 3, 8], [100, 101, 102]]
    want = ThreadedPrefillEngine(cfg).prefill([PrefillInput(p) for p in prompts], return_logits=True)
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    from lanekv.kernels.backend import use_triton

    assert use_triton(torch.empty(1)), "the interpreter must be on (tests/conftest.py)"
    with CPPrefillEngine(cfg) as eng:  # the rank processes inherit both variables
        got = eng.prefill([PrefillInput(p) for p in prompts], return_logits=True)
    for g, w in zip(got, want):
        assert g.first_token == w.first_token
        torch.testing.assert_close(g.logits, w.logits, rtol=1e-4, atol=1e-4)


def test_the_shm_pool_of_a_killed_rank_is_removed_by_the_launcher(checkpoint):
    """A CPU rank serving transfers keeps its pool in /dev/shm; one killed with SIGKILL
    cannot remove it, so the launcher does once it sees the rank gone, and every
    other rank's at close."""
    import time

    from lanekv.prefill.cp.rank_worker import TransferServing

    cfg = EngineConfig(str(checkpoint), cp_size=2, page_size=4, pages_per_lane=32, start_timeout_s=120)
    with CPPrefillEngine(cfg, serve_transfer=TransferServing("127.0.0.1", 0, epoch="killtest")) as eng:
        paths = list(eng.shared_paths)
        assert all(path is not None and path.exists() for path in paths), paths
        os.kill(eng.processes[1].pid, signal.SIGKILL)
        eng.processes[1].join(10)
        deadline = time.monotonic() + 10
        while paths[1].exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not paths[1].exists() and paths[0].exists()
    assert not any(path.exists() for path in paths)


def test_a_cpu_pool_goes_to_shm_only_when_it_fits(checkpoint, monkeypatch, tmp_path):
    import lanekv.prefill.cp.rank_worker as rank_worker
    from lanekv.prefill.engine_config import load_for
    from lanekv.transfer.protocol.descriptors import SHM_DIR, remove_shared_pool

    cfg = EngineConfig(str(checkpoint), cp_size=1, page_size=4, pages_per_lane=8)
    loaded = load_for(cfg, "cpu")
    path = SHM_DIR / f"lanekv-test-{os.getpid()}-fits"
    try:
        shared = rank_worker.build_runner(loaded, cfg, 0, None, path)
        assert shared.process.shared_path == path and path.stat().st_size == shared.pool.numel() * shared.pool.element_size()
    finally:
        remove_shared_pool(path)
    # A /dev/shm with too little room (64 MiB in many containers) would fault on the first write.
    monkeypatch.setattr(rank_worker, "shm_room", lambda directory: 1024)
    private = rank_worker.build_runner(loaded, cfg, 0, None, path)
    assert private.process.shared_path is None and not path.exists()
    assert torch.equal(private.pool, shared.pool)  # the same fill either way
