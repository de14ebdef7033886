"""After warm-up, a prefill engine on the GPU compiles nothing for 200 random
prompts in batches of random composition, some of them past the row count where
the attention changes tiles (GQA, and MLA's wide heads when fewer than 64)."""

from __future__ import annotations

import random

import pytest
from lanekv.kernels.backend import recording_compiles
from lanekv.prefill.cp.launcher import PrefillInput
from lanekv.prefill.cp.threaded import ThreadedPrefillEngine
from lanekv.prefill.engine_config import EngineConfig
from lanekv.prefill.warmup import warm_up

from tests.checkpoints import VOCAB_SIZE, write_deepseek_v2, write_llama
from tests.markers import requires_gpu


@requires_gpu
@pytest.mark.parametrize("write", [write_llama, write_deepseek_v2], ids=["llama", "deepseek_v2"])
def test_no_kernel_compiles_after_warm_up_gpu(tmp_path, write):
    ckpt = write(tmp_path / "model")
    engine = ThreadedPrefillEngine(EngineConfig(str(ckpt), cp_size=1, page_size=16,
                                                pages_per_lane=4096, dtype="bfloat16",
                                                device="cuda"))
    try:
        # Prompts past the attention's tile switch too (4 heads: 16,769 rows on an H200).
        assert engine.tile_switch_rows(), "no tile switch to cross"
        switch = max(engine.tile_switch_rows())
        warm_up(engine, VOCAB_SIZE, max_tokens=switch + 4096, max_batch_tokens=65536)
        rng = random.Random(1)
        lengths = [rng.randint(1, 900) for _ in range(170)] + [
            rng.randint(switch - 900, switch + 4000) for _ in range(30)]
        rng.shuffle(lengths)
        with recording_compiles() as compiles:
            while lengths:
                batch, size = [lengths.pop()], rng.randint(1, 12)
                while lengths and len(batch) < size and sum(batch) + lengths[-1] <= 60000:
                    batch.append(lengths.pop())
                inputs = [PrefillInput([(3 + 7 * t) % VOCAB_SIZE for t in range(n)]) for n in batch]
                for res in engine.prefill(inputs):
                    engine.free(res.new_pages)
        assert compiles == [], f"{len(compiles)} kernels compiled after warm-up: {compiles[:3]}"
    finally:
        engine.close()
