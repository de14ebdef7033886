"""After the decode engine's warm-up (graph capture, transfer kernels), 200
random requests in random batches, above the ladder too, compile nothing: a
Llama-family model and a DeepSeek one (MLA latent pages, the MoE's grouped GEMMs)."""

from __future__ import annotations

import random

import pytest
import torch
from lanekv.decode.cuda.warmup import warm_up_kernels
from lanekv.decode.engine import DecodeEngine
from lanekv.decode.pool import PagePool, PageTable
from lanekv.kernels.backend import recording_compiles
from lanekv.model.checkpoint import load_model
from lanekv.model.sampling import SamplingParams

from tests.checkpoints import write_deepseek_v3, write_llama
from tests.fp8_checkpoints import quantize_checkpoint
from tests.markers import requires_gpu


@requires_gpu
@pytest.mark.parametrize("write", [write_llama, write_deepseek_v3], ids=["llama", "deepseek_v3"])
def test_no_kernel_compiles_after_warm_up_gpu(tmp_path, write):
    loaded = load_model(write(tmp_path / "model"), dtype=torch.bfloat16, device="cuda")
    pool = PagePool.for_model(loaded.config, 8192, 16, torch.bfloat16, "cuda")
    pool.tensor.normal_()
    engine = DecodeEngine(loaded.model, pool, max_batch_size=24, eos_token_ids=(),
                          graph_sizes=(1, 2, 4, 8, 16))  # 17..24: eager
    engine.capture_graphs()
    warm_up_kernels(pool, loaded.config)
    rng = random.Random(0)
    pending = [(f"r{i}", rng.randint(1, 700), rng.randint(1, 12),
                SamplingParams() if i % 3 else SamplingParams(temperature=0.8, top_k=rng.randint(0, 50),
                                                              top_p=rng.choice([1.0, 0.9]), seed=i))
               for i in range(200)]
    with recording_compiles() as compiles:
        steps = 0
        while pending or engine.has_work:
            for _ in range(rng.randint(0, 6)):
                if pending:
                    rid, context, new, sampling = pending.pop()
                    engine.add(rid, PageTable.allocate(pool, context), 7, sampling, new)
            if rng.random() < 0.05 and engine.num_running:
                engine.cancel(f"r{rng.randint(0, 199)}")
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    assert steps > 50
    assert compiles == [], f"{len(compiles)} kernels compiled after warm-up: {compiles[:3]}"


@requires_gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_short_ladder_deepseek_eager_batches_compile_nothing_gpu(tmp_path, fp8):
    """A ladder of 1 and 2 under a batch limit of 12: eager steps of 3 to 12 requests take
    the MoE decode kernels at token buckets no captured size compiled; the capture's
    warm-up (``DeepseekCausalLM.warm_up_decode_kernels``) compiled them (block-FP8: the
    block-FP8 decode experts)."""
    path = write_deepseek_v3(tmp_path / "model")
    if fp8:
        path = quantize_checkpoint(path, tmp_path / "fp8", (16, 16))
    loaded = load_model(path, dtype=torch.bfloat16, device="cuda")
    pool = PagePool.for_model(loaded.config, 4096, 16, torch.bfloat16, "cuda")
    pool.tensor.normal_()
    engine = DecodeEngine(loaded.model, pool, max_batch_size=12, eos_token_ids=(),
                          graph_sizes=(1, 2))
    engine.capture_graphs()
    warm_up_kernels(pool, loaded.config)
    rng = random.Random(1)
    with recording_compiles() as compiles:
        for i in range(12):
            engine.add(f"r{i}", PageTable.allocate(pool, rng.randint(1, 300)), 7, SamplingParams(), 6)
        steps = 0
        while engine.has_work:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    assert compiles == [], f"{len(compiles)} kernels compiled after warm-up: {compiles[:3]}"
    assert steps >= 5  # 6 tokens each, the first from the prefill: batches of 12 down to 1
