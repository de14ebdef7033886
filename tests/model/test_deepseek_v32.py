"""DeepSeek-V3.2 (MLA + DSA indexer + MoE) against transformers on tiny random checkpoints,
with index_topk below the prompt length so that the indexer's selection decides the output."""

from __future__ import annotations

import pytest
import torch
from lanekv.model.checkpoint import load_model
from lanekv.model.config import ModelConfig
from lanekv.model.deepseek_v32 import DeepseekV32CausalLM, dsa_causal_attention

from tests.model.test_dsa import _write_v32

VOCAB = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("v32")
    _write_v32(path, index_n_heads=4, index_topk=6, seed=11)
    return path


def _ids(length: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(length))


def _ours(model, ids):
    with torch.inference_mode():
        hidden = model(ids, torch.arange(ids.numel()), dsa_causal_attention(model))
        return model.compute_logits(hidden)


def _theirs(path, ids, **overrides):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                              dtype=torch.float32, **overrides).eval()
    with torch.inference_mode():
        return hf(ids[None], use_cache=False).logits[0].float()


@pytest.mark.parametrize("length", [5, 19, 33])
def test_logits_match_transformers(checkpoint, length):
    loaded = load_model(checkpoint)
    assert isinstance(loaded.model, DeepseekV32CausalLM)
    assert loaded.config.dsa.index_topk == 6
    ids = _ids(length)
    ours, theirs = _ours(loaded.model, ids), _theirs(checkpoint, ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    if length > 6:
        # The selection decides: keeping every key gives other logits.
        dense = _theirs(checkpoint, ids, index_topk=length)
        assert (dense[6:] - theirs[6:]).abs().max() > 1e-2


def test_config_reads_the_indexer_and_refuses_it_elsewhere(checkpoint):
    config = ModelConfig.from_dir(checkpoint)
    assert config.architecture == "DeepseekV32ForCausalLM"
    assert (config.dsa.index_n_heads, config.dsa.index_head_dim) == (4, 32)
    with pytest.raises(ValueError, match="needs dsa exactly when"):
        ModelConfig(**{**vars(config), "dsa": None})


def test_both_daemons_take_it_and_refuse_an_unknown_index_cache_dtype(checkpoint):
    from lanekv.decode.config import DecodeConfig
    from lanekv.prefill.engine_config import EngineConfig

    assert EngineConfig(model_path=str(checkpoint)).index_cache_dtype == "fp8_e4m3"
    assert DecodeConfig(model_path=str(checkpoint), prefill_endpoint="127.0.0.1:1",
                        index_cache_dtype="model").index_cache_dtype == "model"
    with pytest.raises(ValueError, match="index_cache_dtype='fp4'"):
        EngineConfig(model_path=str(checkpoint), index_cache_dtype="fp4")
    with pytest.raises(ValueError, match="index_cache_dtype='bf16'"):
        DecodeConfig(model_path=str(checkpoint), prefill_endpoint="127.0.0.1:1",
                     index_cache_dtype="bf16")
