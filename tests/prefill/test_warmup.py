"""Prefill warm-up: every warm-up shape runs, and afterwards nothing is held
(every page free, the ranks serve none of the warm-up requests); the GEMM ladder
runs first (``tests/prefill/test_gemm_warmup.py`` checks what it runs)."""

from __future__ import annotations

import pytest
from lanekv.prefill.cp.gemm_warmup import LOGIT_ROWS
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.warmup import settle_after_freeze, warm_up

from tests.checkpoints import VOCAB_SIZE, write_llama


@pytest.mark.parametrize("cp", [2])
def test_warm_up_leaves_nothing_held(tmp_path, cp):
    ckpt = write_llama(tmp_path / "llama")
    engine = ThreadedPrefillEngine(EngineConfig(str(ckpt), cp_size=cp, page_size=4,
                                                pages_per_lane=400))
    try:
        free_before = engine.allocator.free_counts()
        done = warm_up(engine, VOCAB_SIZE, max_tokens=1024, max_batch_tokens=100)
        # lengths 1 and 17 (300 and 2048 are past the batch limit), batches of 2..9 x 8 tokens
        assert done.prefills == 2 + 4
        # before them, the GEMM ladder up to the 100-token limit: 4 shapes x 25 row counts, plus the head's
        assert done.gemm_calls == 4 * 100 // 4 + LOGIT_ROWS
        assert engine.allocator.free_counts() == free_before
        out = engine.prefill([PrefillInput([5, 6, 7, 8, 9])])  # still serves
        assert out[0].num_tokens == 5
    finally:
        engine.close()


def test_warm_up_leaves_out_batches_larger_than_the_pool(tmp_path):
    """A daemon with a small pool (as tests and small deployments run) still starts:
    the warm-up shapes that could never fit are left out, the rest run."""
    ckpt = write_llama(tmp_path / "llama")
    # 2 lanes of 6 pages of 4 rows: a 17-token prompt (5 pages, 3+1 a lane) fits, 2048 would not.
    engine = ThreadedPrefillEngine(EngineConfig(str(ckpt), cp_size=2, page_size=4, pages_per_lane=6))
    try:
        free_before = engine.allocator.free_counts()
        done = warm_up(engine, VOCAB_SIZE, max_tokens=4096, max_batch_tokens=4096)
        # lengths 1 and 17, batches of 2 and 3 x 8 tokens (2 a lane each); 300, 2048 and 5+ do not fit
        assert done.prefills == 4
        assert engine.allocator.free_counts() == free_before
    finally:
        engine.close()


def test_settling_after_a_freeze_leaves_nothing_held(tmp_path):
    ckpt = write_llama(tmp_path / "llama")
    engine = ThreadedPrefillEngine(EngineConfig(str(ckpt), cp_size=2, page_size=4, pages_per_lane=8))
    forgotten: list[str] = []
    try:
        free_before = engine.allocator.free_counts()
        settle_after_freeze(engine, VOCAB_SIZE, forgotten.append)
        assert len(forgotten) == 1 and forgotten[0].startswith("warmup-")
        assert engine.allocator.free_counts() == free_before
    finally:
        engine.close()
