"""A decode TP rank's share of a MoE block (``model.parallel.ep.ExpertShardMoE``) runs
the kernels the whole block runs for the same batch (``MoE.routed_experts``), so the
ranks' outputs, summed as the all-reduce sums them, are the whole block's output.

With block-FP8 experts the two kernel families compute different things: the
sort-free decode kernels (decode batches) keep the activations unquantized, the
grouped GEMMs quantize them per token group. A share that took the grouped GEMMs at
a decode batch differed from one GPU's block by a few percent (DeepSeek-V3 FP8 at
tp 2 decoded other tokens than at tp 1 on the same GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lanekv.model import deepseek
from lanekv.model.checkpoint import load_model
from lanekv.model.parallel.tp import TPRank, load_shard

from tests.checkpoints import write_deepseek_v3
from tests.fp8_checkpoints import quantize_checkpoint
from tests.markers import GPU_CASE

TP_SIZE = 2
MOE_LAYER = 1  # the first layer is dense


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("expert-shards")
    bf16 = write_deepseek_v3(root / "deepseek_v3")
    # the blocks of test_tp.py's FP8 copy: moe_intermediate_size 32 is two 16-row blocks
    return {"deepseek_v3": bf16, "deepseek_v3_fp8": quantize_checkpoint(bf16, root / "fp8", (16, 32))}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=GPU_CASE)])
@pytest.mark.parametrize("name", ["deepseek_v3_fp8", "deepseek_v3"])
def test_the_ranks_shares_of_the_experts_sum_to_the_whole_block(checkpoints, name, device,
                                                                monkeypatch) -> None:
    """A batch of 1 token (the sort-free kernels) and one of 3 tokens past
    ``MOE_DECODE_MAX_TOKENS`` (lowered to 2 here: the grouped GEMMs), through the Triton
    kernels (on the CPU, interpreted): the shares' sum equals the whole block to float32
    summation order."""
    monkeypatch.setenv("LANEKV_CPU_KERNELS", "triton")
    monkeypatch.setattr(deepseek, "MOE_DECODE_MAX_TOKENS", 2)
    path = checkpoints[name]
    whole = load_model(path, device=device).model.model.layers[MOE_LAYER].mlp
    shares = [load_shard(path, TPRank(rank, TP_SIZE), device=device).loaded.model.model.layers[MOE_LAYER].mlp
              for rank in range(TP_SIZE)]
    assert [len(s.experts) for s in shares] == [len(whole.experts) // TP_SIZE] * TP_SIZE
    gen = torch.Generator().manual_seed(3)
    for tokens in (1, 3):
        x = torch.randn(tokens, whole.gate.weight.shape[1], generator=gen).to(device)
        with torch.inference_mode():
            want = whole(x)
            got = sum(share(x) for share in shares)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, t=tokens: f"{t} tokens: {m}")
