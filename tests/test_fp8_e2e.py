"""Block-FP8 checkpoints end to end: greedy tokens through CP prefill (rank threads)
-> the pages as the wire carries them -> decode equal transformers' generate on the
same weights dequantized (the installed transformers dequantizes FP8 only with
``accelerate``, which is not installed, so it loads a dequantized float32 copy).
Two daemons that load the same model quantized differently refuse each other by field."""

from __future__ import annotations

import json

import pytest
import torch
from lanekv.model.config import ModelConfig
from lanekv.transfer.protocol.agreement import Agreement
from lanekv.transfer.protocol.fielddiff import diff

from tests.checkpoints import (
    EOS_TOKEN_ID,
    VOCAB_SIZE,
    write_deepseek_v3,
    write_deepseek_v32,
    write_llama,
    write_qwen3_moe,
)
from tests.fp8_checkpoints import dequantized_copy, quantize_checkpoint
from tests.threaded_e2e import threaded_generate

PROMPT_LENS = [1, 9, 30]
MAX_NEW_TOKENS = 6
MODELS = {"llama": (write_llama, (16, 16)), "qwen3_moe": (write_qwen3_moe, (16, 16)),
          "deepseek_v3": (write_deepseek_v3, (16, 32)), "deepseek_v32": (write_deepseek_v32,
                                                                         (128, 128))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-e2e")
    out = {}
    for name, (writer, block) in MODELS.items():
        fp8 = quantize_checkpoint(writer(root / f"{name}-src"), root / name, block, shards=2)
        out[name] = (fp8, dequantized_copy(fp8, root / f"{name}-dequantized"))
    return out


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(checkpoints) -> dict[str, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    out = {}
    for name, (_, dequantized) in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(dequantized, attn_implementation="eager",
                                                  dtype=torch.float32).eval()
        with torch.inference_mode():
            out[name] = [hf.generate(torch.tensor([ids]), attention_mask=torch.ones(
                1, len(ids), dtype=torch.long), do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                pad_token_id=EOS_TOKEN_ID)[0, len(ids):].tolist() for ids in _prompts()]
    return out


@pytest.mark.parametrize("name,cp_size,page_size", [
    ("llama", 1, 4), ("llama", 3, 16), ("qwen3_moe", 2, 1), ("qwen3_moe", 3, 4),
    ("deepseek_v3", 1, 16), ("deepseek_v3", 2, 4), ("deepseek_v32", 3, 1), ("deepseek_v32", 2, 16),
])
def test_fp8_prefill_transfer_decode_equals_transformers(checkpoints, reference, name, cp_size,
                                                         page_size):
    # DSA's index keys kept in the model dtype, as transformers keeps them
    cache = {"index_cache_dtype": "model"} if name == "deepseek_v32" else {}
    assert threaded_generate(checkpoints[name][0], cp_size, page_size, _prompts(),
                             MAX_NEW_TOKENS, **cache) == reference[name]


def test_daemons_loading_the_model_quantized_differently_refuse_each_other(checkpoints):
    hf = json.loads((checkpoints["deepseek_v3"][0] / "config.json").read_text())
    fp8 = ModelConfig.from_hf(hf)
    plain = ModelConfig.from_hf({k: v for k, v in hf.items() if k != "quantization_config"})
    other_block = ModelConfig.from_hf({**hf, "quantization_config": {
        **hf["quantization_config"], "weight_block_size": [128, 128]}})

    def agreement(config):
        return Agreement.from_model(config.contract_fields(), "same-digest", "float32", 16)

    assert [d.name for d in diff(agreement(fp8), agreement(plain))] == [
        "model_config.weight_quant"]
    assert [str(d) for d in diff(agreement(fp8), agreement(other_block))] == [
        "model_config.weight_quant.block: ours=[16, 32] theirs=[128, 128]"]
